"""The fused staging gather (the gather kernel of engram_serve/kernels.py, wrapped by `engram.staging`) against
the torch path (`dequantize_rows` of `index_select`ed bytes) and the plain-loop bit decoder of
tests/test_checkpoint_tables.py: every E4M3 byte under every E8M0 code, random tables with odd row
counts, duplicates, NaN bytes and extreme scales, float32 and bfloat16 staging, float32 tables; the
dedup's key check with its negative control; ids out of range."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_hooks import gather_trust, hooks
from test_checkpoint_tables import reference_rows, same_bits, table_from_bytes

from engram_serve import kernels
from engram_serve.engram import staging
from engram_serve.engram.quantized import dequantize_rows
from engram_serve.engram.quantized import Fp8Table
from engram_serve.engram.row_cache import HotRowCache
from engram_serve.engram.tables import EngramTables

kernel = kernels.get("gather")
if kernel is None:
    pytest.skip("the C gather kernel is not loaded (`engram-serve env` says why)", allow_module_level=True)

EXTREME_CODES = [0, 1, 2, 126, 127, 128, 134, 135, 200, 253, 254, 255]  # subnormal scales, x1, the 2^127 edge, NaN


def torch_path(w: np.ndarray, s: np.ndarray, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    idx = torch.tensor(ids, dtype=torch.int64)
    out = torch.empty(len(ids), w.shape[1], dtype=dtype)
    return dequantize_rows(torch.from_numpy(w).index_select(0, idx), torch.from_numpy(s).index_select(0, idx), out)


def staged(tab, ids: list[int], dtype: torch.dtype, dedup: bool) -> tuple[torch.Tensor, int]:
    out = torch.full((len(ids), tab.shape[1]), 3.0, dtype=dtype)
    read = staging.stage_rows(tab, torch.tensor(ids, dtype=torch.int64), out, dedup)
    return out, read


@pytest.fixture
def decode_path(request):
    """Decode through the best path up to request.param (3 AVX-512 VBMI byte tables, 2 AVX-512F, 1 AVX2,
    0 the portable loop) that this CPU has; skips a path it does not have."""
    old, used = hooks("gather").set_decode_path(request.param)
    try:
        if used != request.param:
            pytest.skip(f"this CPU has no decode path {request.param} (best: {used})")
        yield used
    finally:
        hooks("gather").set_decode_path(old)


@pytest.mark.parametrize("decode_path", [3, 2, 1, 0], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_byte_under_every_scale_code_equals_the_plain_decoder(dtype, decode_path):
    w = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row k: every byte
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)  # row k: scale code k
    got, read = staged(table_from_bytes(w, s), list(range(256)), dtype, dedup=True)
    with np.errstate(over="ignore"):
        ref = reference_rows(w, s, list(range(256)))
    assert read == 256
    assert same_bits(got.float().numpy(), torch.from_numpy(ref).to(dtype).float().numpy())
    assert same_bits(got.float().numpy(), torch_path(w, s, list(range(256)), dtype).float().numpy())


@pytest.mark.parametrize("decode_path", [3, 2, 1], indirect=True)
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])  # set per test
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 41), groups=st.integers(1, 5), n=st.integers(0, 37),
       dedup=st.booleans(), bf16=st.booleans(), extremes=st.booleans())
def test_kernel_equals_torch_path_and_plain_loop(decode_path, seed, rows, groups, n, dedup, bf16, extremes):
    """Widths of 1 to 5 groups of 32: the VBMI path takes two groups a step, and an odd last one apart."""
    rng = np.random.default_rng(seed)
    hd = 32 * groups
    w = rng.integers(0, 256, (rows, hd), dtype=np.uint8)
    w[rng.random((rows, hd)) < 0.05] = rng.choice([0x7F, 0xFF, 0x00, 0x80, 0x01, 0x7E])  # NaN, +-0, edges
    codes = EXTREME_CODES if extremes else list(range(110, 140))
    s = rng.choice(np.array(codes, dtype=np.uint8), (rows, groups))
    ids = (np.minimum(rng.zipf(1.5, n), rows) - 1).tolist()  # duplicates, like real text
    dtype = torch.bfloat16 if bf16 else torch.float32
    got, read = staged(table_from_bytes(w, s), ids, dtype, dedup)
    assert read == (len(set(ids)) if dedup else n)
    with np.errstate(over="ignore"):
        ref = torch.from_numpy(reference_rows(w, s, ids)).to(dtype).float().numpy()
    assert same_bits(got.float().numpy(), ref)
    assert same_bits(got.float().numpy(), torch_path(w, s, ids, dtype).float().numpy())


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 23), n=st.integers(0, 29), dedup=st.booleans(),
       bf16=st.booleans())
def test_float32_table_rows_equal_index_select(seed, rows, n, dedup, bf16):
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((rows, 32)).astype(np.float32)
    f.flat[rng.integers(0, f.size, 4)] = [np.nan, np.inf, -0.0, 3.4e38]
    tab = torch.from_numpy(f)
    ids = (np.minimum(rng.zipf(1.5, n), rows) - 1).tolist()
    dtype = torch.bfloat16 if bf16 else torch.float32
    got, read = staged(tab, ids, dtype, dedup)
    assert read == (len(set(ids)) if dedup else n)
    assert same_bits(got.float().numpy(), tab.index_select(0, torch.tensor(ids, dtype=torch.int64)).to(dtype).float().numpy())


def colliding_ids(count: int, cap: int = 16) -> list[int]:
    """Distinct ids that all hash to one slot of the kernel's dedup set of `cap` slots."""
    out, r = [], 0
    while len(out) < count:
        if ((r * 0x9E3779B97F4A7C15 % 2**64) >> 32) & (cap - 1) == 0:
            out.append(r)
        r += 1
    return out


def test_dedup_compares_keys_in_a_crowded_slot_and_its_negative_control_fails():
    ids = colliding_ids(6)  # n = 8 ids -> 16 slots: all of these probe from slot 0
    ids = [ids[0], ids[1], ids[0], *ids[2:], ids[3]]
    f = torch.arange((max(ids) + 1) * 32, dtype=torch.float32).view(-1, 32)
    idx = torch.tensor(ids, dtype=torch.int64)
    out = torch.empty(len(ids), 32)
    assert kernel.gather_rows(f.numpy(), None, idx.numpy(), out.numpy(), True) == 6
    assert torch.equal(out, f.index_select(0, idx))
    with gather_trust(slots=True):
        assert kernel.gather_rows(f.numpy(), None, idx.numpy(), out.numpy(), True) == 1  # trusts the slot
    assert not torch.equal(out, f.index_select(0, idx))  # the control breaks the property


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_id_out_of_range_raises_before_anything_is_written(bad):
    f = torch.randn(10, 32)
    out = torch.full((3, 32), 7.0)
    with pytest.raises(IndexError, match=rf"ids\[2\] = {bad} is out of range for a table of 10 rows"):
        staging.stage_rows(f, torch.tensor([0, 1, bad]), out, True)
    assert torch.equal(out, torch.full((3, 32), 7.0))
    tables = EngramTables((1,), [f], pin=False)  # the production gather refuses it the same way
    with pytest.raises(IndexError):
        tables.gather(torch.tensor([[[bad]]]), torch.empty(1, 1, 1, 32))


def test_shapes_and_dtypes_are_checked():
    f = torch.randn(10, 32)
    with pytest.raises(ValueError, match="out has shape"):
        kernel.gather_rows(f.numpy(), None, np.zeros(2, np.int64), np.zeros((3, 32), np.float32), True)
    with pytest.raises(ValueError, match="scale"):
        kernel.gather_rows(np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8), np.zeros(1, np.int64),
                           np.zeros((1, 64), np.float32), True)
    with pytest.raises(ValueError, match="ids must be"):
        kernel.gather_rows(f.numpy(), None, np.zeros(1, np.int32), np.zeros((1, 32), np.float32), True)


def test_backend_choice():
    f, out = torch.randn(4, 32), torch.empty(2, 32)
    assert staging.gather_backend(f, out) == "kernel"
    assert staging.gather_backend(f.to(torch.bfloat16), out) == "torch"  # a bfloat16 table: torch path
    assert staging.gather_backend(f, torch.empty(2, 64)[:, :32]) == "torch"  # strided staging
    assert staging.gather_backend(f, torch.empty(2, 32, device="meta")) == "torch"  # staging off the CPU
    with kernels.override("-gather"):
        assert staging.gather_backend(f, out) == "torch"
    assert staging.gather_backend(f, out) == "kernel"


def test_a_process_without_the_kernel_gathers_through_torch():
    f = torch.randn(50, 32)
    tables = EngramTables((1,), [f], pin=False)
    ids = torch.tensor([[[3, 3]], [[49, 0]]])  # [T=2, L=1, C=2]
    out = torch.empty(1, 2, 2, 32)
    with kernels.override("none"):
        assert staging.gather_backend(f, torch.empty(2, 32)) == "torch"
        calls = []
        with pytest.MonkeyPatch.context() as mp:  # the torch path never reaches the kernel's stage_step
            mp.setattr("engram_serve.engram.tables.stage_step", lambda *a: calls.append(1))
            tables.gather(ids, out)
        assert not calls
    assert torch.equal(out[0], f[ids[:, 0]])


# ---- the kernel's hot-row cache: hits copy cached staged rows, never other values ----

def cached_steps(cache_cls, tab, steps: list[list[int]], dtype, cache_rows: int) -> tuple[list[torch.Tensor], list]:
    """Stage each step through stage_step with one cache of ~cache_rows rows; the staged rows and (hits, lookups)."""
    row_bytes = tab.shape[1] + tab.shape[1] // 32 if isinstance(tab, Fp8Table) else tab.shape[1] * 4
    cache = cache_cls(cache_rows * (row_bytes + 10), row_bytes)
    assert cache.num_slots == cache_rows and cache.nbytes <= cache_rows * (row_bytes + 10)
    outs, stats = [], []
    for ids in steps:
        out = torch.full((1, len(ids), tab.shape[1]), 3.0, dtype=dtype)
        h0 = cache.hits
        staging.stage_step([tab], torch.tensor(ids, dtype=torch.int64).view(-1, 1, 1), out, True, [cache])
        outs.append(out[0])
        stats.append((cache.hits - h0, len(set(ids))))
    return outs, stats


def random_table(rng, rows: int, hd: int, fp8: bool):
    """A random table (FP8 bytes under extreme scale codes, or float32 rows) and its plain-loop
    reference: reference(ids) -> the rows [len(ids), hd] as the spec defines them."""
    if fp8:
        w = rng.integers(0, 256, (rows, hd), dtype=np.uint8)
        s = rng.choice(np.array(EXTREME_CODES, dtype=np.uint8), (rows, hd // 32))
        return table_from_bytes(w, s), lambda ids: reference_rows(w, s, ids)
    f = rng.standard_normal((rows, hd)).astype(np.float32)
    return torch.from_numpy(f), lambda ids: np.stack([f[i] for i in ids]) if ids else np.zeros((0, hd))


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 400), steps=st.integers(1, 6), n=st.integers(0, 60),
       cache_rows=st.sampled_from([8, 16, 24, 64, 512]), fp8=st.booleans(), bf16=st.booleans(),
       zipf=st.sampled_from([1.1, 1.5, 3.0]))
def test_cached_kernel_equals_uncached_and_plain_loop(seed, rows, steps, n, cache_rows, fp8, bf16, zipf):
    """Streams with heavy repetition across and within steps, caches from one set (constant eviction) up."""
    rng, hd = np.random.default_rng(seed), 32
    tab, reference = random_table(rng, rows, hd, fp8)
    dtype = torch.bfloat16 if bf16 else torch.float32
    stream = [(np.minimum(rng.zipf(zipf, n), rows) - 1).tolist() for _ in range(steps)]
    got, stats = cached_steps(HotRowCache, tab, stream, dtype, cache_rows)
    for ids, out, (hits, distinct) in zip(stream, got, stats):
        plain, read = staged(tab, ids, dtype, dedup=True)
        assert read == distinct and 0 <= hits <= distinct
        assert same_bits(out.float().numpy(), plain.float().numpy())  # cached == uncached kernel
        with np.errstate(over="ignore"):
            ref = reference(ids)
        assert same_bits(out.float().numpy(), torch.from_numpy(ref.astype(np.float32)).to(dtype).float().numpy())


def test_cache_hits_evicts_within_its_bound_and_its_negative_control_fails():
    f = torch.arange(4000 * 32, dtype=torch.float32).view(4000, 32)
    steps = [[5, 5, 17, 5, 17, 42], [5, 17, 42, 99], list(range(100, 400)), [5, 17, 42]]
    outs, stats = cached_steps(HotRowCache, f, steps, torch.float32, 64)
    assert stats[:2] == [(0, 3), (3, 4)]  # dedup: 3 distinct cold; then 3 hits and one miss
    assert stats[3][0] < 3  # 300 distinct rows through 64 slots evicted some of 5, 17, 42 (hit once each)
    for ids, out in zip(steps, outs):
        assert torch.equal(out, f[ids])
    # the control: skip the key compare on a hit, and a stream that revisits sets serves wrong rows
    with gather_trust(keys=True):
        bad, _ = cached_steps(HotRowCache, f, steps, torch.float32, 64)
    assert any(not torch.equal(out, f[ids]) for ids, out in zip(steps, bad))


def test_tables_gather_through_the_kernel_cache_equals_no_cache():
    tab = Fp8Table.from_float(torch.randn(3000, 64))
    cached = EngramTables((1,), [tab], pin=False, cache_bytes=256 * (64 * 4 + 10))
    plain = EngramTables((1,), [tab], pin=False)
    assert isinstance(cached.caches[0], HotRowCache)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = torch.from_numpy(np.minimum(rng.zipf(1.2, (40, 1, 4)), 3000) - 1)
        a, b = torch.empty(1, 40, 4, 64), torch.empty(1, 40, 4, 64)
        cached.gather(ids, a)
        plain.gather(ids, b)
        assert same_bits(a.numpy(), b.numpy())
    assert cached.caches[0].hits > 0
    with kernels.override("-gather"):  # the torch path swaps in its own (empty) RowCache
        cached.gather(ids, a)
    assert not isinstance(cached.caches[0], HotRowCache) and same_bits(a.numpy(), b.numpy())


def test_a_token_prefix_of_a_persistent_staging_buffer_is_gathered_by_the_kernel(monkeypatch):
    """The runner stages a microbatch into staging[:, :T] of a [L, T_cap, C, hd] buffer: not contiguous as
    a whole, each layer contiguous. The kernel serves it (one call per layer) and writes what the torch
    path writes, leaving the rest of the buffer alone."""
    tabs = EngramTables((1, 3), [Fp8Table.from_float(torch.randn(500, 64)) for _ in range(2)], pin=False)
    ids = torch.randint(0, 500, (5, 2, 4))
    buf = torch.full((2, 9, 4, 64), 7.0)
    calls = []
    monkeypatch.setattr("engram_serve.engram.tables.stage_step", lambda *a: calls.append(1) or staging.stage_step(*a))
    tabs.gather(ids, buf[:, :5])
    assert calls and not buf[:, :5].is_contiguous()
    want = torch.empty(2, 5, 4, 64)
    with kernels.override("-gather"):
        tabs.gather(ids, want)
    assert same_bits(buf[:, :5].numpy(), want.numpy()) and bool((buf[:, 5:] == 7.0).all())


# ---- prefetch distance: a hint, never a value ----

@pytest.fixture
def distance():
    old = hooks("gather").set_prefetch_distance(16)
    yield hooks("gather").set_prefetch_distance
    hooks("gather").set_prefetch_distance(old)


def cache_state(cache: HotRowCache) -> list[bytes]:
    return [cache.keys.tobytes(), cache.ref.tobytes(), cache.hand.tobytes(), cache.slab.tobytes()]


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])  # a setter
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 60), n=st.sampled_from([0, 1, 2, 5, 17, 40, 90]),
       dups_only=st.booleans(), cache_rows=st.sampled_from([0, 8, 64]), fp8=st.booleans(), bf16=st.booleans())
def test_prefetch_distance_changes_no_staged_value_and_no_cache_state(distance, seed, rows, n, dups_only, cache_rows,
                                                                       fp8, bf16):
    """Distances 0 (none), 1, 16 (the default) and beyond the row count, over 0 and 1 rows, a step of one id
    repeated, and Zipfian steps, with and without a cache (hits, misses, evictions within a call): the staged
    rows equal the plain loop's, and the cache ends in the same state whatever the distance."""
    rng, hd = np.random.default_rng(seed), 64
    tab, reference = random_table(rng, rows, hd, fp8)
    dtype = torch.bfloat16 if bf16 else torch.float32
    steps = [([int(rng.integers(0, rows))] * n) if dups_only else (np.minimum(rng.zipf(1.3, n), rows) - 1).tolist()
             for _ in range(3)]
    row_bytes = hd + hd // 32 if fp8 else hd * 4
    results, states = [], []
    for d in (0, 1, 16, 10 * n + 3):
        distance(d)
        got = []  # (ids, staged rows)
        if cache_rows:
            cache = HotRowCache(cache_rows * (row_bytes + 10), row_bytes)
            for ids in steps:
                out = torch.full((1, len(ids), hd), 3.0, dtype=dtype)
                staging.stage_step([tab], torch.tensor(ids, dtype=torch.int64).view(-1, 1, 1), out, True, [cache])
                got.append((ids, out[0].float().numpy()))
            states.append(cache_state(cache) + [cache.hits])
        else:
            for ids in steps:
                for dedup in (True, False):
                    out, read = staged(tab, ids, dtype, dedup)
                    assert read == (len(set(ids)) if dedup else len(ids))
                    got.append((ids, out.float().numpy()))
        for ids, out in got:
            with np.errstate(over="ignore"):
                ref = reference(ids)
            assert same_bits(out, torch.from_numpy(ref.astype(np.float32)).to(dtype).float().numpy())
        results.append(got)
    for other in results[1:]:
        assert all(same_bits(a, b) for (_, a), (_, b) in zip(results[0], other))
    assert all(state == states[0] for state in states)


@pytest.fixture
def stream_bytes():
    old = hooks("gather").set_stream_bytes(8 << 20)
    yield hooks("gather").set_stream_bytes
    hooks("gather").set_stream_bytes(old)


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])  # a setter
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 60), n=st.sampled_from([0, 1, 2, 5, 17, 40, 90]),
       groups=st.integers(1, 3), cache_rows=st.sampled_from([0, 8, 64]), dedup=st.booleans(), offset=st.sampled_from([0, 1, 8]))
def test_streamed_staging_equals_the_plain_loop(stream_bytes, seed, rows, n, groups, cache_rows, dedup, offset):
    """Non-temporal stores (float32 staging of FP8 rows at least `set_stream_bytes` large; forced here
    with 0) give the plain loop's rows, with and without dedup, with a cache (hits, misses, repeats of
    both), and on staging that starts 1 or 8 floats past an aligned address (misaligned for the
    stores: the kernel writes those rows as usual, and must not crash)."""
    rng, hd = np.random.default_rng(seed), 32 * groups
    w = rng.integers(0, 256, (rows, hd), dtype=np.uint8)
    sc = rng.integers(110, 140, (rows, groups), dtype=np.uint8)
    tab = table_from_bytes(w, sc)
    steps = [(np.minimum(rng.zipf(1.3, n), rows) - 1).tolist() for _ in range(3)]
    cache = HotRowCache(cache_rows * (hd + groups + 10), hd + groups) if cache_rows else None
    for threshold in (0, 1 << 40):  # streamed, then the regular stores
        stream_bytes(threshold)
        for ids in steps:
            buf = torch.full((len(ids) * hd + offset,), 3.0)
            out = buf[offset:].view(1, len(ids), hd)
            staging.stage_step([tab], torch.tensor(ids, dtype=torch.int64).view(-1, 1, 1), out, dedup,
                               [cache] if cache else None)
            with np.errstate(over="ignore"):
                assert same_bits(out[0].numpy(), reference_rows(w, sc, ids))
            assert bool((buf[:offset] == 3.0).all())


def test_a_hit_evicted_later_in_the_same_call_is_staged_from_its_slot_first(distance):
    """One set of 8 ways, all hit again (bits set), then 12 misses in the same call: their CLOCK sweep clears
    the bits and replaces rows that this very call hit, some twice over. Every hit is staged before any
    slot is rewritten, and each slot ends holding the stored row its key names (the cache's invariant), at
    every distance."""
    rows = 64
    f = torch.arange(rows * 32, dtype=torch.float32).view(rows, 32)
    w, s = (np.random.default_rng(1).integers(0, 127, (rows, 32), dtype=np.uint8),
            np.full((rows, 1), 120, dtype=np.uint8))
    for tab, stored in ((f, lambda r: f[r].numpy().tobytes()),
                        (table_from_bytes(w, s), lambda r: w[r].tobytes() + s[r].tobytes())):
        for d in (0, 1, 16, 100):
            distance(d)
            cache = HotRowCache(8 * (tab.shape[1] * 4 + 10) if tab is f else 8 * (33 + 10), 128 if tab is f else 33)
            assert cache.num_slots == 8
            warm = list(range(8))
            step = warm + list(range(8, 20)) + warm[:3]  # 8 hits, 12 misses, then 3 repeats of hits
            for ids in (warm, warm, step):
                out = torch.full((1, len(ids), 32), 3.0)
                staging.stage_step([tab], torch.tensor(ids, dtype=torch.int64).view(-1, 1, 1), out, True, [cache])
            want = f[step].numpy() if tab is f else reference_rows(w, s, step)
            assert same_bits(out[0].numpy(), want)
            assert set(cache.keys.tolist()) - set(warm), "the misses replaced rows hit in the same call"
            for slot, r in enumerate(cache.keys.tolist()):
                assert cache.slab[slot].tobytes() == stored(r)


def test_tables_replaced_after_a_gather_are_the_ones_staged():
    """EngramTables keeps the kernel's views of its tables; a table replaced in `tables` is staged from,
    not the one the views were made of (they are remade when the table objects change)."""
    a, b = Fp8Table.from_float(torch.randn(50, 32)), Fp8Table.from_float(torch.randn(50, 32) + 3)
    tabs = EngramTables((1,), [a], pin=False)
    ids = torch.tensor([[[3, 7]], [[3, 49]]])  # [T=2, L=1, C=2]
    out = torch.empty(1, 2, 2, 32)
    tabs.gather(ids, out)
    assert same_bits(out[0].reshape(4, 32).numpy(), a.dequantize()[ids.reshape(-1)].numpy())
    tabs.tables[0] = b
    tabs.gather(ids, out)
    assert same_bits(out[0].reshape(4, 32).numpy(), b.dequantize()[ids.reshape(-1)].numpy())


@pytest.mark.parametrize("cache_rows", [0, 64])
def test_a_prepared_stager_stages_what_gather_stages_from_the_current_ids(cache_rows):
    """`EngramTables.stager` (a decode step's gather, its views made once) stages into a token prefix of a
    persistent buffer what `gather` stages, from the ids in the buffer at each call (the ids change between
    calls), and stages from a table replaced after it was made. Its own copy of the ids is refreshed every
    call: a stager reading the ids it was made with would stage the first step's rows again."""
    tabs = EngramTables((1, 3), [Fp8Table.from_float(torch.randn(500, 64)) for _ in range(2)], pin=False,
                        cache_bytes=cache_rows * (64 * 4 + 10))
    plain = EngramTables((1, 3), list(tabs.tables), pin=False)
    ids_buf, buf = torch.zeros(6, 2, 4, dtype=torch.int64), torch.full((2, 9, 4, 64), 7.0)
    want = torch.empty(2, 5, 4, 64)
    stage = tabs.stager(ids_buf[:5], buf[:, :5])
    assert stage is not None
    rng = np.random.default_rng(1)
    for step in range(4):
        if step == 3 and not cache_rows:  # (a hot-row cache holds the rows of the tables it was made for)
            tabs.tables[1] = plain.tables[1] = Fp8Table.from_float(torch.randn(500, 64) + 2)
        ids_buf[:5] = torch.from_numpy(rng.integers(0, 500, (5, 2, 4)))
        assert stage()
        plain.gather(ids_buf[:5], want)
        assert same_bits(buf[:, :5].numpy(), want.numpy()) and bool((buf[:, 5:] == 7.0).all())
    assert tabs.stager(ids_buf[:5].transpose(0, 1).contiguous().transpose(0, 1), buf[:, :5]) is None  # not one block
