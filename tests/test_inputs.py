"""Split-invariant step inputs: history, slicing, planning, static buffers (docs/contract.md §3, §4, §6)."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engram_serve.config import EngramConfig
from engram_serve.engram.hashing import hash_step
from engram_serve.engram.layout import build_layout
from engram_serve.errors import SliceError, StaticBufferError
from engram_serve.inputs.batch import StepBatch
from engram_serve.inputs.static import PADDING, StaticInputPool
from engram_serve.inputs.step import build_step
from engram_serve.inputs.step_state import StepState
from engram_serve.inputs.token_store import TokenStore
from engram_serve.microbatch.plan import MicrobatchConfig, plan_microbatches
from batches import assert_same_batch
from engram_serve.microbatch.slicing import SLICE_RULES, check_slice_invariants, slice_microbatch

CFG = EngramConfig([1, 3], [0, 0], 4, 3, 4, 50, 40, 0)
LAYOUT = build_layout(CFG, check_rows=False)
TMAP = torch.arange(64) % 40
BLOCK = 16


def spec_batch() -> StepBatch:
    """The docs/contract.md §3 regression step: history [[9,8,7],[29,28,27]], ids [10,11,12,30,31], qsl [0,3,5]."""
    z = torch.zeros(2, dtype=torch.int64)
    return StepBatch(input_ids=torch.tensor([10, 11, 12, 30, 31]), positions=torch.tensor([3, 4, 5, 3, 4]),
                     dead=torch.zeros(5, dtype=torch.bool), slot_mapping=torch.arange(5), req_slots=torch.arange(2),
                     num_computed=torch.tensor([3, 3]), seq_lens=torch.tensor([6, 5]), block_tables=z[:, None],
                     sample=torch.ones(2, dtype=torch.bool), qsl=torch.tensor([0, 3, 5]),
                     history=torch.tensor([[9, 8, 7], [29, 28, 27]]), qsl_host=np.array([0, 3, 5]))


@pytest.mark.parametrize("t0,t1,rows", [
    (0, 2, [[9, 8, 7], [-1, -1, -1]]),
    (2, 5, [[11, 10, 9], [29, 28, 27], [-1, -1, -1]]),
    (3, 5, [[29, 28, 27], [-1, -1, -1]]),
    (1, 3, [[10, 9, 8], [-1, -1, -1]]),
])
def test_spec_regression_table(t0, t1, rows):
    """Per-row history padded to [num_tokens_in_slice, D] with -1 rows, through the static buffers."""
    mb = slice_microbatch(spec_batch(), t0, t1)
    view = StaticInputPool([t1 - t0]).get(0, t1 - t0, mb).refresh(mb)
    assert view.history.tolist() == rows


def test_spec_prompt_history():
    store = TokenStore(2, 8)
    slot = store.add([10, 11, 12, 13])
    s = torch.tensor([slot, slot])
    assert store.history(s, torch.tensor([4, 2]), 3).tolist() == [[13, 12, 11], [11, 10, -1]]


def test_every_field_has_a_slicing_rule_and_unknown_fields_raise(monkeypatch):
    assert set(spec_batch().fields()) <= set(SLICE_RULES)
    monkeypatch.delitem(SLICE_RULES, "slot_mapping")
    with pytest.raises(SliceError, match="slot_mapping"):
        slice_microbatch(spec_batch(), 0, 2)


def random_step(seed: int, long_context: bool):
    """A random step over a fresh store: mixed prefill chunks and decodes, length-1 requests, position-0
    starts and (optionally) contexts beyond 100k tokens."""
    rng = np.random.default_rng(seed)
    num_req = int(rng.integers(1, 7))
    max_len = 100_050 if long_context else 200
    store = TokenStore(num_req, max_len)
    slots, computed, new = [], [], []
    for _ in range(num_req):
        kind = rng.choice(["decode", "prefill0", "chunk", "len1"])
        length = int(rng.integers(2, 40))
        start = {"decode": length - 1, "prefill0": 0, "chunk": int(rng.integers(1, length)), "len1": 0}[kind]
        if kind == "len1":
            length = 1
        if long_context and rng.random() < 0.5:
            start += 100_000
            length += 100_000
        seq = rng.integers(0, 64, size=length)
        dead = rng.random(length) < 0.05
        slots.append(store.add(seq, dead))
        computed.append(start)
        new.append(int(rng.integers(1, length - start + 1)))
    max_blocks = -(-max_len // BLOCK)
    tables = np.arange(num_req * max_blocks).reshape(num_req, max_blocks)
    batch = build_step(store, np.array(slots), np.array(computed), np.array(new), tables, BLOCK, CFG.history_len)
    return batch, rng, store


@given(seed=st.integers(0, 2**32 - 1), long_context=st.booleans(), persistent=st.booleans(),
       sample=st.booleans())
def test_the_numpy_build_on_a_cpu_store_equals_the_torch_build(seed, long_context, persistent, sample):
    """build_step computes a CPU store's batch in numpy (`on_host`); every field equals, in dtype, shape
    and value, what the torch ops that serve device stores give, from explicit block tables (with null
    blocks) and from the persistent StepState."""
    batch, rng, store = random_step(seed, long_context)
    rows = batch.num_rows
    args = (batch.req_slots.numpy(), batch.num_computed.numpy(), np.diff(batch.qsl_host))
    tables = batch.block_tables.numpy().copy()
    tables[rng.random(tables.shape) < 0.2] = -1
    if persistent:
        state = StepState(store.max_slots, tables.shape[1])
        for slot, row in zip(args[0], tables):
            state.sync(int(slot), row.tolist())
        tables = state
    flags = rng.random(rows) < 0.5 if sample else None
    host, dev = (build_step(store, *args, tables, BLOCK, CFG.history_len, flags, on_host=h) for h in (True, False))
    assert_same_batch(host, dev)


def step_hash(b: StepBatch) -> torch.Tensor:
    return hash_step(b.input_ids, b.qsl, b.history, LAYOUT, TMAP, CFG.engram_pad_token_id, dead=b.dead)


def all_cuts(batch: StepBatch):
    """For 1..4 microbatches and both policies: the planned cuts, and the plan with every offset added."""
    total = batch.num_tokens
    for n in range(1, 5):
        for policy in ("tokens", "requests"):
            cfg = MicrobatchConfig(n, policy, 0, 0, when="always")
            plan = plan_microbatches(batch.qsl_host, cfg, is_decode_only=False)
            yield plan
            interior = plan[1:-1]
            for c in range(1, total) if interior else ():
                cuts = list(interior)
                cuts[int(np.argmin([abs(x - c) for x in cuts]))] = c  # move the nearest cut onto offset c
                yield [0] + sorted(set(cuts)) + [total]


def sweep_mismatches(batch: StepBatch, rebuild_history: bool = True) -> int:
    whole = step_hash(batch)
    bad = 0
    for bounds in all_cuts(batch):
        mbs = [slice_microbatch(batch, a, b, rebuild_history) for a, b in zip(bounds, bounds[1:])]
        check_slice_invariants(batch, mbs, bounds)
        bad += not torch.equal(torch.cat([step_hash(u) for u in mbs]), whole)
    return bad


@given(seed=st.integers(0, 2**32 - 1), long_context=st.booleans())
def test_hash_ids_identical_for_every_cut(seed, long_context):
    batch, _, _ = random_step(seed, long_context)
    assert sweep_mismatches(batch) == 0


def test_store_history_matches_python_lists():
    store = TokenStore(3, 50)
    seqs = [[5, 6, 7, 8, 9], [1], [3, 4, 5, 6, 7, 8, 9, 10]]
    slots = torch.tensor([store.add(s) for s in seqs])
    first = torch.tensor([3, 0, 8])
    want = [[s[p - 1 - j] if p - 1 - j >= 0 else -1 for j in range(3)] for s, p in zip(seqs, first.tolist())]
    assert store.history(slots, first, 3).tolist() == want


def test_negative_control_slicing_without_history_rebuild_fails():
    """Turn the protection off: the sweep must find mismatches (a prefill row cut at every offset)."""
    store = TokenStore(1, 32)
    slot = store.add(list(range(3, 15)))
    batch = build_step(store, np.array([slot]), np.array([0]), np.array([12]), np.zeros((1, 2), int), BLOCK, 3)
    assert sweep_mismatches(batch, rebuild_history=True) == 0
    assert sweep_mismatches(batch, rebuild_history=False) > 0


def test_planning_policies():
    qsl = np.array([0, 10, 12, 100])

    def plan(q, n, policy, decode=0, prefill=0, imbalance=0.25, decode_only=False):
        return plan_microbatches(q, MicrobatchConfig(n, policy, decode, prefill, imbalance, when="always"), decode_only)
    assert plan(qsl, 2, "tokens") == [0, 50, 100]
    assert plan(qsl, 2, "requests") == [0, 50, 100]  # 12 is too far
    assert plan(np.array([0, 45, 100]), 2, "requests") == [0, 45, 100]
    assert plan(qsl, 2, "tokens", prefill=200) == [0, 100]  # below the prefill threshold
    assert plan(np.arange(9), 2, "tokens", decode=16, decode_only=True) == [0, 8]  # below the decode threshold
    assert plan(np.array([0, 3]), 4, "tokens") == [0, 1, 2, 3]


def padded_view(batch, size, pad=True):
    pool = StaticInputPool([size])
    static = pool.get(0, size, batch)
    for buf in static.buffers.values():  # plant stale values from an imaginary previous step
        buf.fill_(7)
    static.qsl.fill_(7)
    return static, static.refresh(batch, pad=pad)


def assert_padding_neutral(view: StepBatch, n_tok: int, n_rows: int):
    for name, (fill, kind) in PADDING.items():
        buf = getattr(view, name)
        if buf is not None:
            start = n_tok if kind == "token" else n_rows
            assert (buf[start:] == fill).all(), f"stale padding visible in {name}"
    assert (view.qsl[n_rows + 1:] == n_tok).all(), "stale padding visible in qsl"


@given(seed=st.integers(0, 2**32 - 1), extra=st.integers(0, 20))
def test_static_buffers_pad_neutrally_and_keep_pointers(seed, extra):
    batch, _, _ = random_step(seed, False)
    size = batch.num_tokens + extra
    static, view = padded_view(batch, size)
    assert_padding_neutral(view, batch.num_tokens, batch.num_rows)
    ptrs = static.data_ptrs()
    h = step_hash(view)
    assert torch.equal(h[: batch.num_tokens], step_hash(batch))
    static.refresh(slice_microbatch(batch, 0, 1))
    assert static.data_ptrs() == ptrs


def test_negative_control_stale_padding_is_caught():
    batch, _, _ = random_step(3, False)
    _, view = padded_view(batch, batch.num_tokens + 5, pad=False)
    with pytest.raises(AssertionError, match="stale padding"):
        assert_padding_neutral(view, batch.num_tokens, batch.num_rows)


def test_static_buffer_shape_and_dtype_errors_name_the_buffer():
    batch, _, _ = random_step(5, False)
    static = StaticInputPool([64]).get(0, 64, batch)
    wide = StepBatch(**{**batch.fields(), "block_tables": torch.zeros(batch.num_rows, 99, dtype=torch.int64)})
    with pytest.raises(StaticBufferError, match="block_tables"):
        static.refresh(wide)
    f32 = StepBatch(**{**batch.fields(), "positions": batch.positions.float()})
    with pytest.raises(StaticBufferError, match="positions"):
        static.refresh(f32)
    with pytest.raises(StaticBufferError, match="padded size 8"):
        StaticInputPool([8]).get(0, 8, batch).refresh(StepBatch(**{**batch.fields(), "input_ids": torch.zeros(9)}))


def test_token_store_append_truncate_free():
    store = TokenStore(2, 16)
    a = store.add([1, 2, 3])
    b = store.add([7])
    store.append(torch.tensor([a, b]), torch.tensor([4, 8]))  # sampled tokens committed on the device
    assert store.lengths.tolist() == [4, 2]
    assert store.history(torch.tensor([a, b]), torch.tensor([4, 2]), 3).tolist() == [[4, 3, 2], [8, 7, -1]]
    store.append(torch.tensor([a]), torch.tensor([5]))
    store.truncate(a, 4)  # a rejected speculative token is dropped
    store.append(torch.tensor([a]), torch.tensor([6]))
    assert store.history(torch.tensor([a]), torch.tensor([5]), 2).tolist() == [[6, 4]]
    store.free(a)
    c = store.add([9, 9])  # the freed slot is reused; its old tokens are not readable as history
    assert c == a and store.history(torch.tensor([c]), torch.tensor([0]), 2).tolist() == [[-1, -1]]


def test_overlap_planning_cuts_only_what_can_hide_something():
    qsl = np.array([0, 10, 12, 100])
    auto = MicrobatchConfig(2, "tokens", 0, 0, min_hidden_ms=1.0)
    assert plan_microbatches(qsl, auto, False) == [0, 100]  # nothing to hide: whole
    assert plan_microbatches(qsl, auto, False, hideable_ms=0.5) == [0, 100]
    assert plan_microbatches(qsl, auto, False, hideable_ms=1.0) == [0, 50, 100]
    assert plan_microbatches(qsl, auto, False, hideable_ms=float("inf")) == [0, 50, 100]
    with pytest.raises(ValueError, match="when"):
        MicrobatchConfig(when="sometimes")
