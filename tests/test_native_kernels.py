"""The C kernels of the CPU forward (model/_attention_kernel.c, model/_token_kernel.c, model/_kernel_math.h)
against independent float64 plain loops (and, for full attention, bit for bit against its definition run
in float32 one operation at a time), and the property they exist for: a token's bits do not depend
on its batch mates, on how its row is chunked, or on its place in a call. Negative controls: the
isolation switches of the attention kernel (its test hooks, tests/kernel_hooks.py) make a planted NaN
reach a query."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_hooks import attention_leaks

from engram_serve import kernels
from engram_serve.model import attention_kernels as ak, fused, layers

pytestmark = pytest.mark.skipif(not kernels.loaded("attention", "token"),
                                reason="the attention and token kernels are not loaded (`engram-serve env` says why)")


@dataclass
class Batch:  # the StepBatch fields attend_native reads
    qsl: torch.Tensor
    num_computed: torch.Tensor
    block_tables: torch.Tensor
    block_size: int

    @property
    def num_rows(self) -> int:
        return self.qsl.shape[0] - 1


@dataclass
class World:
    k: torch.Tensor  # [kvh, slots + 1, hd] pools, the last slot the zero slot
    v: torch.Tensor
    q: dict  # (row, position) -> [heads, hd]
    tables: list[list[int]]  # per row its blocks
    seq: list[int]  # per row its length
    bs: int
    heads: int

    @property
    def zero(self) -> int:
        return self.k.shape[1] - 1

    def slot(self, r: int, pos: int) -> int:
        return self.tables[r][pos // self.bs] * self.bs + pos % self.bs

    def batch(self, rows: list[tuple[int, int, int]]) -> tuple[Batch, torch.Tensor]:
        """rows: (row, first position, query count) -> the batch and its q [T, heads, hd]."""
        width = max(len(t) for t in self.tables)
        qsl = np.cumsum([0] + [n for _, _, n in rows])
        tables = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, (r, _, _) in enumerate(rows):
            tables[i, :len(self.tables[r])] = torch.tensor(self.tables[r])
        q = torch.stack([self.q[r, p] for r, first, n in rows for p in range(first, first + n)])
        return Batch(torch.tensor(qsl, dtype=torch.int64), torch.tensor([f for _, f, _ in rows], dtype=torch.int64),
                     tables, self.bs), q


@st.composite
def worlds(draw, integer: bool = False):
    kvh = draw(st.sampled_from([1, 2]))
    heads = kvh * draw(st.sampled_from([1, 2, 3]))
    hd = draw(st.sampled_from([16, 24, 32]))  # 24: the kernel's general (non-vector) dot
    bs = draw(st.sampled_from([4, 16]))
    seq = draw(st.lists(st.integers(1, 70), min_size=1, max_size=4))
    nblocks = [-(-s // bs) for s in seq]
    order = draw(st.permutations(range(sum(nblocks))))
    tables, i = [], 0
    for n in nblocks:
        tables.append(list(order[i:i + n]))
        i += n
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    shape = (kvh, sum(nblocks) * bs + 1, hd)
    mk = (lambda *s: torch.randint(-3, 4, s, generator=g).float()) if integer else (lambda *s: torch.randn(*s, generator=g))
    k, v = mk(*shape), mk(*shape)
    k[:, -1], v[:, -1] = 0.0, 0.0
    q = {(r, p): mk(heads, hd) for r, s in enumerate(seq) for p in range(s)}
    return World(k, v, q, tables, seq, bs, heads)


def run(world: World, rows, mode: str = "full", sel=None, topk: int = 8, read_past: int = 0, later: bool = False):
    """attend_native over `rows`; read_past / later switch the kernel's isolation off (negative controls)."""
    b, q = world.batch(rows)
    if mode != "full" and sel is None:
        sel = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    with attention_leaks(read_past, later):
        return ak.attend_native(b, q, world.k, world.v, world.zero, world.zero, mode, sel), sel


def reference(world: World, r: int, p: int, keys: list[int] | None = None) -> np.ndarray:
    """Plain float64 loop: softmax over the row's keys at `keys` (default 0..p) of q . k / sqrt(hd)."""
    heads, hd = world.heads, world.k.shape[2]
    g = heads // world.k.shape[0]
    keys = list(range(p + 1)) if keys is None else keys
    out = np.zeros((heads, hd))
    for h in range(heads):
        qh = world.q[r, p][h].double().numpy()
        ks = [world.k[h // g, world.slot(r, j)].double().numpy() for j in keys]
        vs = [world.v[h // g, world.slot(r, j)].double().numpy() for j in keys]
        s = [float(qh @ kk) / math.sqrt(hd) for kk in ks]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        out[h] = sum(w * vv for w, vv in zip(e, vs)) / sum(e)
    return out.reshape(-1)


def whole(world: World) -> list[tuple[int, int, int]]:
    return [(r, 0, s) for r, s in enumerate(world.seq)]


@settings(max_examples=25, deadline=None)
@given(world=worlds())
def test_full_attention_matches_the_plain_loop(world):
    out, _ = run(world, whole(world))
    t = 0
    for r, s in enumerate(world.seq):
        for p in range(s):
            np.testing.assert_allclose(out[t].double().numpy(), reference(world, r, p), rtol=2e-5, atol=2e-6)
            t += 1


F32 = np.float32


def f32_dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """The kernel's dot, in float32 one operation at a time: lane l (of 16) sums a[i] * b[i] for i = l,
    l + 16, ... from 0, then lanes l + 8, l + 4, l + 2, l + 1 are added in (_kernel_math.h)."""
    acc = [F32(0)] * 16
    for i in range(len(a)):
        acc[i % 16] = F32(acc[i % 16] + F32(a[i] * b[i]))
    for w in (8, 4, 2, 1):
        acc = [F32(acc[j] + acc[j + w]) for j in range(w)] + acc[w:]
    return acc[0]


def f32_exp(x: np.float32) -> np.float32:
    """exp_fixed of _kernel_math.h (Cephes' expf), in float32 one operation at a time."""
    hi, lo, magic = F32(88.7228317), F32(-87.3365479), F32(12582912.0)
    xc = hi if x > hi else (lo if x < lo else x)
    t = F32(F32(xc * F32(1.44269504088896341)) + magic)
    n = F32(t - magic)
    r = F32(F32(xc - F32(n * F32(0.693359375))) - F32(n * F32(-2.12194440e-4)))
    p = F32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = F32(F32(p * r) + F32(c))
    p = F32(F32(F32(p * F32(r * r)) + r) + F32(1))
    bits = (int(np.array(t).view(np.uint32)) - 0x4B400000 + 127) << 23 & 0xFFFFFFFF
    y = F32(p * np.array(bits, dtype=np.uint32).view(F32))
    return F32(np.inf) if x > hi else (F32(0) if x < lo else y)


def reference_bits(world: World, r: int, p: int) -> np.ndarray:
    """A query's full attention as the kernel defines it, in float32 one operation at a time: scores
    dot * scale in key order, their max, exp(s - max), the sum and the value sums in key order, one
    division (_attention_kernel.c). Shares nothing with the kernel but the definition."""
    heads, hd = world.heads, world.k.shape[2]
    g, scale = heads // world.k.shape[0], F32(1.0 / math.sqrt(hd))
    k, v = world.k.numpy(), world.v.numpy()
    out = []
    for h in range(heads):
        q = world.q[r, p][h].numpy()
        slots = [world.slot(r, j) for j in range(p + 1)]
        s = [F32(f32_dot(q, k[h // g, sl]) * scale) for sl in slots]
        m = max(s)
        e = [f32_exp(F32(x - m)) for x in s]
        total, acc = F32(0), np.zeros(hd, dtype=F32)
        for ej, sl in zip(e, slots):
            total = F32(total + ej)
            acc = (acc + ej * v[h // g, sl]).astype(F32)  # lane-wise float32 products and sums
        out.append((acc / total).astype(F32))
    return np.concatenate(out)


@settings(max_examples=12, deadline=None)
@given(world=worlds())
def test_full_attention_has_the_bits_of_the_float32_definition(world):
    """Bit for bit, not within a tolerance: the kernel's vectorised forms (keys scored 8 at a time with
    the tree's last levels on transposed vectors, two heads' value sums in one pass) must compute
    exactly the operations written in the definition, for rows long enough to hold whole groups of 8
    keys and a remainder."""
    out, _ = run(world, whole(world))
    t = 0
    for r, s in enumerate(world.seq):
        for p in range(s):
            assert np.array_equal(out[t].numpy().view(np.int32), reference_bits(world, r, p).view(np.int32)), (r, p)
            t += 1


def reference_select(world: World, r: int, p: int, topk: int) -> list[int]:
    """The topk positions <= p by (head-mean q . k descending, position ascending); integer inputs, so
    every score is exact in float32 and ties are real ties."""
    g = world.heads // world.k.shape[0]
    score = {j: sum(float(world.q[r, p][h] @ world.k[h // g, world.slot(r, j)]) for h in range(world.heads))
             for j in range(p + 1)}
    return sorted(score, key=lambda j: (-score[j], j))[:topk]


@settings(max_examples=20, deadline=None)
@given(world=worlds(integer=True), topk=st.integers(1, 12))
def test_selection_and_attention_to_the_selected_keys(world, topk):
    out, sel = run(world, whole(world), "select", topk=topk)
    reuse, _ = run(world, whole(world), "reuse", sel=sel.clone())
    assert torch.equal(out, reuse)  # reuse attends to exactly what select chose
    t = 0
    for r, s in enumerate(world.seq):
        for p in range(s):
            want = reference_select(world, r, p, topk)
            assert sel[t].tolist() == want + [-1] * (topk - len(want))
            np.testing.assert_allclose(out[t].double().numpy(), reference(world, r, p, want), rtol=2e-5, atol=2e-5)
            t += 1


@settings(max_examples=25, deadline=None)
@given(world=worlds(), data=st.data(), mode=st.sampled_from(["full", "select"]))
def test_a_token_gets_the_same_bits_alone_in_any_chunk_and_beside_any_rows(world, data, mode):
    base, _ = run(world, whole(world), mode)
    r = data.draw(st.integers(0, len(world.seq) - 1))
    s = world.seq[r]
    cut = data.draw(st.integers(0, s - 1))
    mates = data.draw(st.lists(st.sampled_from(range(len(world.seq))), max_size=3))
    rows = [(m, 0, world.seq[m]) for m in mates] + [(r, cut, s - cut)] + [(m, 0, world.seq[m]) for m in mates[:1]]
    got, _ = run(world, rows, mode)
    start = sum(world.seq[:r]) + cut
    offset = sum(world.seq[m] for m in mates)
    assert torch.equal(got[offset:offset + s - cut], base[start:start + s - cut])


def poisoned(world: World) -> World:
    """Every pool slot that no row may read (past a row's length, other blocks) set to NaN."""
    k, v = world.k.clone(), world.v.clone()
    readable = torch.zeros(k.shape[1], dtype=torch.bool)
    readable[world.zero] = True
    for r, s in enumerate(world.seq):
        for p in range(s):
            readable[world.slot(r, p)] = True
    k[:, ~readable], v[:, ~readable] = float("nan"), float("nan")
    return World(k, v, world.q, world.tables, world.seq, world.bs, world.heads)


@settings(max_examples=20, deadline=None)
@given(world=worlds())
def test_unreadable_slots_never_reach_a_query(world):
    for mode in ("full", "select"):
        clean, _ = run(world, whole(world), mode)
        dirty, _ = run(poisoned(world), whole(world), mode)
        assert torch.equal(clean, dirty)


def test_negative_controls_reading_past_the_row_or_later_keys_leak_nan():
    world = World(torch.randn(1, 2 * 4 + 1, 8), torch.randn(1, 2 * 4 + 1, 8), {}, [[0], [1]], [3, 2], 4, 2)
    world.k[:, -1], world.v[:, -1] = 0.0, 0.0
    world.q = {(r, p): torch.randn(2, 8) for r in range(2) for p in range(world.seq[r])}
    dirty = poisoned(world)  # slot 3 (row 0, position 3) is past row 0's length
    assert torch.isfinite(run(dirty, whole(dirty))[0]).all()
    assert torch.isnan(run(dirty, whole(dirty), read_past=1)[0][:3]).any()
    later = World(world.k.clone(), world.v.clone(), world.q, world.tables, world.seq, 4, 2)
    later.v[:, world.slot(0, 2)] = float("nan")  # row 0's last key: only its own query may see it
    out = run(later, whole(later))[0]
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2]).all()
    assert torch.isnan(run(later, whole(later), later=True)[0][:2]).all()  # 0 * NaN through the earlier queries


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), heads=st.sampled_from([1, 2, 4]), kvh=st.sampled_from([1, 2]), hd=st.sampled_from([8, 32]),
       seed=st.integers(0, 2**31))
def test_rotate_store_is_apply_rotary_and_stores_at_the_slots(t, heads, kvh, hd, seed):
    heads = max(heads, kvh) // kvh * kvh
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, heads + 2 * kvh, hd, generator=g)
    cos, sin = layers.rotary_cos_sin(torch.randint(0, 500, (t,), generator=g), hd, 10000.0)
    slots = torch.randperm(20, generator=g)[:t]
    slots[0] = -1  # writes nowhere
    kc, vc = torch.zeros(kvh, 21, hd), torch.zeros(kvh, 21, hd)
    want = layers.apply_rotary(qkv[:, :heads + kvh], cos, sin)
    out = qkv.clone()
    ak.rotate_store(out, heads, cos, sin, slots, kc, vc, 20)
    assert torch.equal(out[:, :heads + kvh], want) and torch.equal(out[:, heads + kvh:], qkv[:, heads + kvh:])
    for i in range(1, t):
        assert torch.equal(kc[:, slots[i]], want[i, heads:]) and torch.equal(vc[:, slots[i]], qkv[i, heads + kvh:])
    assert int((kc != 0).any(-1).any(0).sum()) == t - 1


def test_exp_fixed_is_accurate_and_the_same_in_any_place():
    x = torch.linspace(-87.0, 88.0, 100_003)
    gu = torch.stack([x, torch.ones_like(x)], 1)  # silu(x) * 1
    y = fused.silu_mul(gu, 1).view(-1).double()
    want = x.double() / (1 + torch.exp(-x.double()))
    assert float(((y - want).abs() / want.abs().clamp(min=1e-30)).max()) < 4e-7
    for start, n in ((0, 1), (5, 17), (1000, 33), (99_990, 13)):  # alone, or in another vector lane
        part = fused.silu_mul(gu[start:start + n].contiguous(), 1).view(-1)
        assert torch.equal(part, fused.silu_mul(gu, 1).view(-1)[start:start + n])
    special = fused.silu_mul(torch.tensor([[float("nan"), 1.0], [100.0, 1.0], [-100.0, 1.0]]), 1).view(-1)
    assert math.isnan(special[0]) and special[1] == 100.0 and special[2] == 0.0


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), hc=st.sampled_from([1, 2, 4]), dim=st.sampled_from([16, 40]), seed=st.integers(0, 2**31))
def test_token_kernels_match_the_plain_loops_and_a_row_alone(n, hc, dim, seed):
    g = torch.Generator().manual_seed(seed)
    h, delta, w = torch.randn(n, hc, dim, generator=g), torch.randn(n, dim, generator=g), torch.randn(dim, generator=g)
    kv = torch.randn(n, (hc + 1) * dim, generator=g)
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    dead = torch.rand(n, generator=g) < 0.3
    h2, x = fused.residual_norm(h, delta, w, 1e-6)
    gated = fused.engram_gate(h, kv, qw, kw, dead, 1e-6)

    def rms(a):
        return a / math.sqrt(sum(float(e) ** 2 for e in a) / dim + 1e-6)
    for t in range(n):
        hh = h[t].double() + delta[t].double()
        np.testing.assert_allclose(h2[t].double(), hh, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x[t].double(), rms(hh.mean(0)) * w.double(), rtol=1e-5, atol=1e-5)
        for i in range(hc):
            dot = float((rms(h[t, i].double()) * qw[i].double() * rms(kv[t, i * dim:(i + 1) * dim].double())
                         * kw[i].double()).sum()) / math.sqrt(dim)
            gate = 0.0 if dead[t] else 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            np.testing.assert_allclose(gated[t, i].double(), h[t, i].double() + gate * kv[t, hc * dim:].double(),
                                       rtol=1e-5, atol=1e-5)
        one = slice(t, t + 1)  # a token alone: the same bits
        assert torch.equal(fused.residual_norm(h[one], delta[one], w, 1e-6)[1], x[one])
        assert torch.equal(fused.engram_gate(h[one], kv[one], qw, kw, dead[one], 1e-6), gated[one])


def test_the_form_taken_does_not_depend_on_the_layout():
    """A column slice of one row is contiguous, of several rows not (tensor parallelism's summed Engram
    projections are such slices): the C form must run for both, or a token's bits would depend on
    its batch. (Choosing the form by contiguity broke verify at TP=2 across cuts.)"""
    g = torch.Generator().manual_seed(0)
    hc, dim = 2, 16
    h = torch.randn(3, hc, dim, generator=g)
    both = torch.randn(3, 2 * (hc + 1) * dim, generator=g)
    kv = both[:, :(hc + 1) * dim]  # not contiguous
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    assert not kv.is_contiguous() and kv[1:2].is_contiguous()
    batch = fused.engram_gate(h, kv, qw, kw, None, 1e-6)
    for t in range(3):
        assert torch.equal(fused.engram_gate(h[t:t + 1], kv[t:t + 1], qw, kw, None, 1e-6), batch[t:t + 1])
    gu = torch.randn(3, 2 * 2 * 8, generator=g)[:, :2 * 8]
    assert torch.equal(fused.silu_mul(gu, 8)[1:2], fused.silu_mul(gu[1:2], 8))
    delta = torch.randn(3, 2 * dim, generator=g)[:, :dim]
    w = torch.randn(dim, generator=g)
    assert torch.equal(fused.residual_norm(h, delta, w, 1e-6)[1][2:], fused.residual_norm(h[2:], delta[2:], w, 1e-6)[1])


def test_a_block_outside_the_pool_is_refused():
    world = World(torch.randn(1, 2 * 4 + 1, 8), torch.randn(1, 2 * 4 + 1, 8), {}, [[0, 5]], [6], 4, 2)
    world.q = {(0, p): torch.randn(2, 8) for p in range(6)}
    with pytest.raises(ValueError, match="block 5, outside the pool's 8 slots"):
        run(world, [(0, 0, 6)])  # row 0 reads positions 0..5: its second block is block 5


def plain_argmax(row: list[float]) -> int:
    """The first index of the row's maximum, a NaN above every number: a plain loop."""
    best = 0
    for j, v in enumerate(row):
        b = row[best]
        if math.isnan(b):
            break
        if math.isnan(v) or v > b:
            best = j
    return best


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), v=st.integers(1, 70), data=st.data())
def test_argmax_rows_is_the_first_maximum_with_nan_first(rows, v, data):
    """`fused.argmax_rows` (the sampler's argmax) against a plain loop and torch.argmax, on rows with ties,
    +-0, +-inf and NaN, in the vector body and the tail."""
    special = st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 3.5])
    x = torch.tensor([[data.draw(special | st.floats(-4, 4, width=32)) for _ in range(v)] for _ in range(rows)],
                     dtype=torch.float32)
    got = fused.argmax_rows(x)
    assert got.tolist() == [plain_argmax(r) for r in x.tolist()]
    assert torch.equal(got, x.argmax(dim=1))


def test_the_router_of_a_model_with_more_experts_than_the_c_router_takes():
    """A model with more than MAX_EXPERTS experts routes in torch (the C router would refuse it): the
    top k, best first, weights summing to 1."""
    e, k = fused.MAX_EXPERTS + 44, 6
    logits = torch.randn(5, e, generator=torch.Generator().manual_seed(0))
    ids, w, dense = fused.moe_route(logits, k)
    assert torch.equal(ids, logits.topk(k, dim=1).indices)
    assert torch.allclose(w.sum(1), torch.ones(5)) and torch.equal(dense.gather(1, ids), w)
