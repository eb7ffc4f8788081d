"""Runner safety: per-microbatch buffers, the ownership check, failures mid-forward (docs/contract.md §5)."""
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from engram_serve.errors import OwnershipError
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from runner_controls import NoRowsWait, SharedStaging, SharedTopk


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_random_checkpoint(path, seed=0)
    return load_model(path)


def runner_and_batch(loaded, runner_cls=ModelRunner, **kw):
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128, num_blocks=64,
                       **{"microbatch": MicrobatchConfig(2, "tokens", 0, 0, when="always"), **kw})
    r = runner_cls(loaded, cfg)
    rng = np.random.default_rng(0)
    lens = [30, 7, 50]
    slots = np.array([r.store.add(rng.integers(6, 4096, n).tolist()) for n in lens])
    b = r.build(slots, np.zeros(3, int), np.array(lens), np.arange(48).reshape(3, 16), np.ones(3, bool))
    return r, b


@pytest.mark.parametrize("graph", [(), (128,)])
def test_every_cut_matches_the_whole_step(loaded, graph):
    r, b = runner_and_batch(loaded, graph_sizes=graph, debug_ownership=True)
    whole = r.execute(b, [0, b.num_tokens], record=True)
    for c in range(1, b.num_tokens, 7):
        out = r.execute(b, [0, c, b.num_tokens], record=True)
        assert torch.equal(out.hash_ids, whole.hash_ids) and torch.equal(out.staged, whole.staged)
        assert torch.equal(out.logits, whole.logits)


def test_logits_bit_identical_at_every_cut_offset_for_two_and_three_microbatches(loaded):
    """Each cut swept over every token offset of the step (the other cut fixed, for three)."""
    r, b = runner_and_batch(loaded, microbatch=MicrobatchConfig(3, "tokens", 0, 0, when="always"))
    t = b.num_tokens
    whole = r.execute(b, [0, t]).logits
    cuts = [[0, c, t] for c in range(1, t)]
    cuts += [[0, c, 60, t] for c in range(1, 60)] + [[0, 20, c, t] for c in range(21, t)]
    for bounds in cuts:
        assert torch.equal(r.execute(b, bounds).logits, whole), bounds


@pytest.mark.parametrize("cls,name", [(SharedTopk, "'topk'"), (SharedStaging, "'staging'")])
def test_ownership_check_names_a_shared_buffer(loaded, cls, name):
    r, b = runner_and_batch(loaded, cls, debug_ownership=True)
    with pytest.raises(OwnershipError, match=f"{name}.*microbatch 0.*microbatch 1"):
        r.execute(b, [0, 40, b.num_tokens])
    r2, b2 = runner_and_batch(loaded, debug_ownership=True)  # negative control: own buffers pass
    r2.execute(b2, [0, 40, b2.num_tokens])


def test_shared_staging_without_the_check_gives_wrong_logits(loaded):
    r, b = runner_and_batch(loaded, SharedStaging)
    whole = r.execute(b, [0, b.num_tokens])
    cut = r.execute(b, [0, 40, b.num_tokens])
    assert (cut.logits - whole.logits).abs().max() > 1e-3


def test_a_microbatch_that_raises_ends_the_step_fast_and_the_runner_recovers(loaded, monkeypatch):
    r, b = runner_and_batch(loaded)
    whole = r.execute(b, [0, b.num_tokens], record=True)
    moe = r.model.layers[2].ffn
    real = moe.shared
    calls = {"n": 0}

    def flaky(x, ops):
        calls["n"] += 1
        if calls["n"] == 2:  # the second microbatch's layer-2 shared expert
            raise RuntimeError("injected failure in microbatch 1")
        return real(x, ops)

    monkeypatch.setattr(moe, "shared", flaky)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="injected failure"):
        r.execute(b, [0, 40, b.num_tokens])
    assert time.monotonic() - t < 1.0
    monkeypatch.setattr(moe, "shared", real)
    again = r.execute(b, [0, 40, b.num_tokens])
    assert torch.equal(again.logits, whole.logits)


def test_static_shape_forward_used_by_graph_capture_matches_eager(loaded):
    """The forward with the static bound a graph capture passes (`max_seq_len`: the compressed-entry
    width fixed by the model length, not read from the positions) gives the eager result; run here on CPU
    over padded static buffers."""
    from engram_serve.engram.hashing import hash_step
    from engram_serve.inputs.static import StaticInputPool
    from engram_serve.model.context import ForwardContext
    from engram_serve.model.deepseek_v41 import run_stages
    r, b = runner_and_batch(loaded)
    r.execute(b, [0, b.num_tokens])  # prefill the KV cache
    r.store.append(b.req_slots, torch.full((3,), 77))
    dec = r.build(b.req_slots.numpy(), np.array([30, 7, 50]), np.ones(3, int), np.arange(48).reshape(3, 16),
                  np.ones(3, bool))
    view = StaticInputPool([8]).get(0, 8, dec).refresh(dec)
    view.hash_ids = hash_step(view.input_ids, view.qsl, view.history, r.layout, r.token_map, r.pad_id, dead=view.dead)
    staging = r.bufs[0].staging[:, :8]
    r._stage_rows(view.hash_ids, staging, dec.num_tokens)
    eager = run_stages(r.model.stages(ForwardContext(view, r.kv, r.bufs[0], lambda i: staging[i])))
    static = run_stages(r.model.stages(ForwardContext(view, r.kv, r.bufs[0], lambda i: staging[i], max_query_len=1,
                                                      max_seq_len=256)))
    assert torch.equal(eager[:3], static[:3]) and torch.isfinite(static).all()


class _SlowTables:
    """Engram tables whose gather takes 250 ms per call, like rows read from disk (wraps the real tables):
    a good share of a step even where the forward of the test's 87 tokens is slow (a loaded machine; the
    planner hides a gather of at least a quarter of a step)."""

    def __init__(self, tables):
        self.inner, self.tables = tables, tables.tables

    def gather(self, hash_ids, out):
        time.sleep(0.25)
        return self.inner.gather(hash_ids, out)


class _SlowOffMainThread(_SlowTables):
    """A gather that takes 50 ms off the main thread only: the worker's wait for the GIL, which the
    forward holds, stretched out."""

    def gather(self, hash_ids, out):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
        return self.inner.gather(hash_ids, out)


def test_the_gather_estimate_comes_from_inline_runs_only(loaded):
    """The planner's gather estimate counts gathers run inline (one step in MEASURE_EVERY), never the
    worker's wall time, which includes its waits for the GIL: a short gather is not mistaken for a slow one."""
    r, b = runner_and_batch(loaded, microbatch=MicrobatchConfig(1))
    r.loaded = dataclasses.replace(loaded, tables=_SlowOffMainThread(loaded.tables))
    r.planner.MEASURE_EVERY, r.planner.PREFETCH_MIN_MS = 3, 0.0  # every gather on the worker but the measuring ones
    for _ in range(7):  # steps 0, 3 and 6 measure
        r.execute(b)
    assert r.planner.gather_ms_per_token * b.num_tokens < 25, "the worker's 50 ms counted as the gather's time"
    assert r.gather_wait_ms < 5  # step 6 ran its gather inline (no 50 ms wait)


def test_the_planner_cuts_only_when_a_cut_hides_something(loaded):
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128, num_blocks=64,
                       microbatch=MicrobatchConfig(2, "tokens", 0, 0, min_hidden_ms=0.5))
    r = ModelRunner(loaded, cfg)
    slots = np.array([r.store.add(list(range(6, 6 + n))) for n in (30, 7, 50)])
    b = r.build(slots, np.zeros(3, int), np.array([30, 7, 50]), np.arange(48).reshape(3, 16), np.ones(3, bool))
    assert r.execute(b).bounds == [0, 87]  # CPU, tables in memory: nothing to hide, the step runs whole
    r.launches_collectives = True  # a collective per layer (tensor parallelism) is worth hiding
    assert r.plan(b) == [0, 44, 87]
    r.launches_collectives = False
    r.loaded = dataclasses.replace(loaded, tables=_SlowTables(loaded.tables))
    r.planner.steps = 0  # the next step measures its gather (MicrobatchPlanner.MEASURE_EVERY)
    r.execute(b)  # measures the slow gather (the step itself still ran whole)
    assert r.plan(b) == [0, 44, 87]


def _slow_after_one_step(r, b):
    """Swap in the slow tables and run one step, so that the runner measures the slow gather."""
    r.loaded = dataclasses.replace(r.loaded, tables=_SlowTables(r.loaded.tables))
    r.planner.steps = 0  # the next step measures its gather (MicrobatchPlanner.MEASURE_EVERY)
    r.execute(b)


def test_a_whole_step_with_a_slow_gather_overlaps_it_and_waits_for_the_rows(loaded):
    """A whole step whose gather is measured slow (250 ms here) starts it on the worker, overlapped with
    the layers before the first Engram layer, and that layer waits for the rows: the bits of the gather
    run inline. Negative control: without the wait, the Engram layers read the staging buffer before
    the rows land (here zeroed, as a buffer's earlier contents), and the logits are wrong."""
    r, b = runner_and_batch(loaded, microbatch=MicrobatchConfig(1))
    inline = r.execute(b).logits  # nothing measured yet: the gather runs inline
    _slow_after_one_step(r, b)
    r.bufs[0].staging.zero_()
    out = r.execute(b)
    assert r.gather_wait_ms > 10  # on the worker, and the step blocked on it
    assert torch.equal(out.logits, inline)
    bad, b2 = runner_and_batch(loaded, NoRowsWait, microbatch=MicrobatchConfig(1))
    _slow_after_one_step(bad, b2)
    bad.bufs[0].staging.zero_()
    wrong = bad.execute(b2).logits
    assert not torch.equal(wrong, inline) and (wrong - inline).abs().max() > 1e-3
