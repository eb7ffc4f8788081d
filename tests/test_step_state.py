"""Persistent step state (engram_serve/inputs/step_state.py): the device block tables follow every
request's block list through joins, growth, preemption and leaving, updated incrementally."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.inputs.step_state import StepState
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import load_model
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams

OPS = st.lists(st.tuples(st.sampled_from(["grow", "leave"]), st.integers(0, 3), st.integers(0, 5)), max_size=40)


@given(OPS)
def test_tables_equal_a_plain_dict_of_block_lists(ops):
    state, truth, nxt = StepState(4, 12), {}, [0]
    for op, slot, k in ops:
        if op == "grow":
            ids = truth.setdefault(slot, [])
            ids += list(range(nxt[0], nxt[0] + min(k, 12 - len(ids))))
            nxt[0] += k
            state.sync(slot, ids)
        else:
            truth.pop(slot, None)
            state.clear(slot)
        state.flush()
        for s in range(4):  # a plain loop: every row is its block list, then nulls
            want = truth.get(s, []) + [-1] * (12 - len(truth.get(s, [])))
            assert state.tables[s].tolist() == want


def test_sync_refuses_a_list_that_was_freed_without_clear():
    state = StepState(2, 8)
    state.sync(0, [3, 4])
    with pytest.raises(RuntimeError, match="free was not cleared"):
        state.sync(0, [5, 6, 7])  # the request left and another took the slot, but clear() never ran


class _NoClear(StepState):
    """Negative control: leaving or preemption does not null the row, and sync trusts the count."""

    def clear(self, slot):
        pass

    def sync(self, slot, block_ids):
        n = int(self.count[slot])
        if len(block_ids) > n:
            self._pending.append((slot, n, block_ids[n:]))
            self.count[slot] = len(block_ids)


def _run(loaded, stale: bool) -> tuple[int, list[str]]:
    """A small KV pool so that requests are preempted; after every step each live slot's device row must
    be its request's block list and every free slot's row null. Returns (preemptions, problems)."""
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, block_size=4, num_blocks=22,
                       microbatch=MicrobatchConfig(1))
    eng = LLMEngine(loaded, cfg)
    if stale:
        eng.runner.state = _NoClear(cfg.max_num_seqs, cfg.max_blocks_per_seq)
    rng = np.random.default_rng(0)
    for i in range(6):
        eng.add_request(f"r{i}", rng.integers(6, 4000, int(rng.integers(5, 30))).tolist(),
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    problems = []
    while eng.has_unfinished() and not problems:
        eng.step()
        live = {s.slot: s for s in eng.seqs.values() if s.slot is not None}
        for slot in range(cfg.max_num_seqs):
            want = live[slot].block_ids if slot in live else []
            try:
                eng.runner.state.check(slot, want)
            except AssertionError as e:
                problems.append(str(e))
    return eng.stats.preemptions, problems


def test_tables_follow_the_engine_through_preemption_and_leaving():
    torch.manual_seed(0)
    loaded = load_model()
    preemptions, problems = _run(loaded, stale=False)
    assert preemptions > 0 and problems == []
    _, stale_problems = _run(loaded, stale=True)  # negative control: stale rows are seen
    assert stale_problems
