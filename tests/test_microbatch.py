"""The microbatch planner's cost model and the bounds check (microbatch/plan.py), without a model.

Planning and slicing rules are swept in test_inputs.py; the planner inside a running ModelRunner
(measured gathers, collectives) in test_runner.py.
"""
import math
from collections.abc import Iterator
from itertools import repeat

import numpy as np
import pytest

from engram_serve.errors import InvalidRequest
from engram_serve.microbatch.plan import MicrobatchConfig, MicrobatchPlanner, check_bounds

OVERLAP = MicrobatchConfig(2, "tokens", 0, 0, min_hidden_ms=1.0)


def planner(gather_ms_per_token=0.0, step_ms_per_token=0.0, tables_off_device=False) -> MicrobatchPlanner:
    p = MicrobatchPlanner(OVERLAP, tables_off_device)
    p.gather_ms_per_token, p.step_ms_per_token = gather_ms_per_token, step_ms_per_token
    return p


def test_hideable_time_is_what_a_cut_could_overlap():
    assert planner().hideable_ms(100, collectives=True) == math.inf
    assert planner(tables_off_device=True).hideable_ms(100, collectives=False) == math.inf
    assert planner(0.01, 1.0).hideable_ms(100, collectives=False) == 0.0  # below HIDE_FRACTION of a step
    assert planner(0.5, 1.0).hideable_ms(100, collectives=False) == 50.0


def test_a_step_is_cut_only_when_the_cost_model_says_it_hides_enough():
    qsl = np.array([0, 30, 100])
    assert planner(0.01, 1.0).plan(qsl, False, collectives=False) == [0, 100]
    assert planner(0.5, 1.0).plan(qsl, False, collectives=False) == [0, 50, 100]
    assert planner().plan(qsl, False, collectives=True) == [0, 50, 100]
    always = MicrobatchConfig(3, "tokens", 0, 0, when="always")
    assert planner().plan(qsl, False, collectives=False, cfg=always) == [0, 33, 67, 100]  # an explicit config wins


def test_gathers_measure_one_step_in_measure_every_and_run_on_the_worker_only_when_worth_it():
    p = planner()
    p.MEASURE_EVERY = 3
    assert [p.start_step() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert not p.gather_on_worker(2, 100, measure=True)  # a measuring step runs its gathers inline
    assert p.gather_on_worker(2, 1, measure=False)  # another microbatch's compute hides it
    assert planner(tables_off_device=True).gather_on_worker(1, 1, measure=False)
    assert not planner(0.001).gather_on_worker(1, 10, measure=False)  # 0.01 ms: a thread handoff costs more
    assert planner(0.001).gather_on_worker(1, 1000, measure=False)  # 1 ms: overlapped with the first layers


def test_moving_averages_follow_the_measurements():
    p = planner()
    p.record_gather(10.0, 100)  # 0.1 ms per token
    p.record_step(40.0, 100, microbatched=False)
    p.record_gather(5.0, 0)  # no tokens: nothing learned
    assert p.gather_ms_per_token == pytest.approx(p.SMOOTHING * 0.1)
    assert p.step_ms_per_token == pytest.approx(p.SMOOTHING * 0.4)


def run(p: MicrobatchPlanner, qsl, whole_ms: float, cut_ms, steps: int) -> list[bool]:
    """Plan and "run" `steps` steps whose whole form takes whole_ms and cut form cut_ms (a float, or an
    iterator giving each cut step's time in turn); which were cut."""
    cut_times = cut_ms if isinstance(cut_ms, Iterator) else repeat(cut_ms)
    out = []
    for _ in range(steps):
        cut = len(p.plan(qsl, False, collectives=True)) > 2
        p.record_step(next(cut_times) if cut else whole_ms, int(qsl[-1]), cut)
        out.append(cut)
    return out


def test_the_planner_cuts_only_where_cut_steps_ran_faster():
    qsl = np.array([0, 30, 100])
    paying = run(planner(), qsl, whole_ms=10.0, cut_ms=8.0, steps=64)
    costly = run(planner(), qsl, whole_ms=10.0, cut_ms=13.0, steps=64)
    warm = 2 * 2  # StepCosts.WARMUP of each form, alternated
    assert paying[:warm] == [True, False, True, False] == costly[:warm]
    after_p, after_c = paying[warm:], costly[warm:]
    # after warm-up: the faster form, the other one in EXPLORE_EVERY decisions (to keep its estimate current)
    explored = len(after_p) // MicrobatchPlanner.EXPLORE_EVERY + 1
    assert 1 <= after_p.count(False) <= explored
    assert 1 <= after_c.count(True) <= explored


def test_a_cold_first_step_does_not_decide_the_form():
    """The first cut step of a class ran 3x slower (first touch of its buffers); cut steps then take 8 ms
    against 10 whole. After the warm-up the planner cuts (with the cold sample averaged into the estimate
    it would keep steps whole for the next ~100 steps)."""
    forms = run(planner(), np.array([0, 30, 100]), whole_ms=10.0, cut_ms=iter([30.0] + [8.0] * 100), steps=40)
    assert forms[:4] == [True, False, True, False]
    assert forms[4:].count(True) >= len(forms[4:]) - len(forms[4:]) // MicrobatchPlanner.EXPLORE_EVERY - 1


def test_predictions_are_measured_against_the_steps():
    p = planner()
    run(p, np.array([0, 100]), whole_ms=10.0, cut_ms=8.0, steps=40)
    assert p.predicted_gain(100, False) == pytest.approx(2.0)
    assert p.prediction_error() == pytest.approx(0.0)
    p.record_step(1.0, 100, microbatched=True)  # a step run with bounds nobody planned teaches nothing
    assert p.predicted_gain(100, False) == pytest.approx(2.0)
    assert p.predicted_gain(3, True) is None  # another class: no prediction yet


@pytest.mark.parametrize("bounds", [[1, 3], [0, 2], [0, 3, 3], [0, "a", 3], [0, True, 3], "0,3", [0], (0, 2.0, 3)])
def test_malformed_bounds_are_refused_naming_them(bounds):
    with pytest.raises(InvalidRequest, match="bounds="):
        check_bounds(bounds, 3, 4)


def test_more_microbatches_than_buffers_are_refused():
    check_bounds((0, 1, 2, 3), 3, 3)
    check_bounds([np.int64(0), np.int64(3)], 3, 1)
    with pytest.raises(InvalidRequest, match=r"3 microbatches.*microbatch\.num_microbatches=2"):
        check_bounds([0, 1, 2, 3], 3, 2)
