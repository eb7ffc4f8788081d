"""The token kernel of DeepSeek-V4.1's CPU forward (model/_token_kernel.c through model/ops_c.py) against plain
definitions (float64 loops written from docs/deepseek_v41.md, or the torch form beside the caller), and the
property the kernel exists for: a token's bits do not depend on its batch mates, its place in a call or the
call's size. Each exactness rule has its negative control here or in the model-level tests below:
- a token alone has its bits in any batch: the checker flags torch's own sigmoid, whose vector body and
  scalar tail round differently (the reason `exactness.pointwise` pads);
- the top-k tie rule (higher first, ties to the earlier entry, a NaN above every number): a top-k that
  breaks ties the other way is flagged;
- C or torch is chosen by devices, dtypes and loaded kernels only: a choice by the token count breaks the
  model's bit-exactness across batches (the two forms compute the same formula, not the same bits).
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model import ops_c, ops_torch
from engram_serve.model.layers import layout_weights_

pytestmark = pytest.mark.skipif(not kernels.loaded("token"),
                                reason="the token kernel is not loaded (`engram-serve env` says why)")

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def alone_bits(fn, *batched: torch.Tensor, rows: int | None = None) -> list[int]:
    """The tokens t whose output of fn over the whole batch differs (in any bit) from fn over token t alone;
    every batched input has its tokens on dim 0, and fn returns a tensor or a tuple of them."""
    whole = fn(*batched)
    whole = whole if isinstance(whole, tuple) else (whole,)
    bad = []
    for t in range(rows or batched[0].shape[0]):
        one = fn(*(b[t:t + 1] for b in batched))
        one = one if isinstance(one, tuple) else (one,)
        if not all(torch.equal(o, w[t:t + 1]) for o, w in zip(one, whole)):
            bad.append(t)
    return bad


# ---- plain definitions (float64) -------------------------------------------------------------------------
def plain_mix(x: np.ndarray, mm: np.ndarray, scale, base, eps, hc_eps, iters):
    """docs/deepseek_v41.md "mHC" for one token: x [hc, D], mm [(2 + hc) hc]."""
    hc = x.shape[0]
    r = 1 / math.sqrt(float((x.reshape(-1) ** 2).mean()) + eps)
    seg = [scale[0]] * hc + [scale[1]] * hc + [scale[2]] * hc * hc
    m = [mm[j] * r * seg[j] + base[j] for j in range(len(seg))]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pre = [sig(m[i]) + hc_eps for i in range(hc)]
    post = [2 * sig(m[hc + i]) for i in range(hc)]
    c = np.array(m[2 * hc:]).reshape(hc, hc)
    c = np.exp(c - c.max(1, keepdims=True))
    c = c / c.sum(1, keepdims=True) + hc_eps
    c = c / (c.sum(0, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(1, keepdims=True) + hc_eps)
        c = c / (c.sum(0, keepdims=True) + hc_eps)
    return np.array(pre), np.array(post), c


def plain_topk(row: list[float], k: int) -> list[int]:
    """The k best of row: higher first, a NaN above every number, ties to the lower index; -1 for -inf picks
    and beyond the row (a stable sort on a key)."""
    order = sorted(range(len(row)), key=lambda j: (0 if math.isnan(row[j]) else 1, -row[j] if not math.isnan(row[j]) else 0, j))
    out = [j if not row[j] == -math.inf else -1 for j in order[:k]]
    return out + [-1] * (k - len(out))


# ---- mHC -------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 41), hc=st.sampled_from([1, 2, 4, 5]), dim=st.sampled_from([8, 16, 24]),
       iters=st.integers(0, 20), seed=st.integers(0, 2**31))
def test_mhc_mix_collapse_and_expand_match_their_definition_and_a_token_alone(n, hc, dim, iters, seed):
    """Tokens are mixed 16 at a time (lanes of one vector), then 8, and the rest one by one: a token's bits are its
    bits alone."""
    g = gen(seed)
    x, mm = torch.randn(n, hc, dim, generator=g), torch.randn(n, (2 + hc) * hc, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
    mix = lambda a, b: ops_c.hc_mix(a, b, scale, base, 1e-6, 1e-6, iters)  # noqa: E731
    pre, post, comb = mix(x, mm)
    for t in range(n):
        want = plain_mix(x[t].double().numpy(), mm[t].double().numpy(), scale.double().tolist(), base.double().tolist(),
                         1e-6, 1e-6, iters)
        for got, w in zip((pre[t], post[t], comb[t]), want):
            np.testing.assert_allclose(got.double().numpy(), w, rtol=2e-5, atol=2e-6)
    o, weights = torch.randn(n, dim, generator=g), torch.rand(n, hc, generator=g)
    np.testing.assert_allclose(ops_c.collapse(x, weights).double(), (weights.double()[:, :, None] * x.double()).sum(1),
                               rtol=1e-5, atol=1e-5)
    want = post.double()[:, :, None] * o.double()[:, None] + torch.einsum("nab,nad->nbd", comb.double(), x.double())
    np.testing.assert_allclose(ops_c.expand(o, x, post, comb).double(), want, rtol=1e-5, atol=1e-5)
    assert alone_bits(mix, x, mm) == []
    assert alone_bits(ops_c.collapse, x, weights) == []
    assert alone_bits(ops_c.expand, o, x, post, comb) == []


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 41), hc=st.sampled_from([1, 2, 3, 4, 5]), dim=st.sampled_from([8, 16, 24, 130]),
       seed=st.integers(0, 2**31))
def test_stream_mean_is_the_torch_forms_sum_in_stream_order_then_division(n, hc, dim, seed):
    """The drafter's features: the bits of the streams added in order, then divided by hc, over every float32
    exponent (a sum that rounds, overflows or falls subnormal), a token's bits its own."""
    g = gen(seed)
    x = torch.randn(n, hc, dim, generator=g) * torch.exp2(torch.randint(-149, 128, (n, hc, dim), generator=g).float())
    got = ops_c.stream_mean(x)
    want = x[:, 0].clone()
    for i in range(1, hc):
        want = want + x[:, i]
    for other in (want / hc, ops_torch.stream_mean(x)):  # (a NaN, from inf - inf, counts as equal to a NaN)
        torch.testing.assert_close(got, other, rtol=0, atol=0, equal_nan=True)
    assert alone_bits(ops_c.stream_mean, x) == []
    wide = torch.full((n, 3 * dim), 7.0)  # into the middle columns of a wider buffer: the others untouched
    ops_c.stream_mean(x, out=wide[:, dim:2 * dim])
    torch.testing.assert_close(wide[:, dim:2 * dim], got, rtol=0, atol=0, equal_nan=True)
    assert (wide[:, :dim] == 7).all() and (wide[:, 2 * dim:] == 7).all()


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([1, 7, 127, 128, 129, 300]), hc=st.sampled_from([1, 4]), dim=st.sampled_from([16, 64]),
       seed=st.integers(0, 2**31), bf16=st.booleans())
def test_hc_next_is_its_five_calls_bit_for_bit(n, hc, dim, seed, bf16):
    """The mHC between two sublayers in one call, tile by tile (tiles of 128 tokens, a partial last one): the bits of
    expand, the mix weight's product (`linear`: the float kernel, or the bfloat16 tiles for a bfloat16 weight where
    the CPU has them), hc_mix, collapse and rms_norm called one after the other."""
    g = gen(seed)
    cfg = v41.ModelConfig.from_dict(dict(v41_small(), hc_mult=hc, hidden_size=dim))
    x, o = torch.randn(n, hc, dim, generator=g), torch.randn(n, dim, generator=g)
    post, comb, mix = torch.rand(n, hc, generator=g) * 2, torch.rand(n, hc, hc, generator=g), torch.rand(n, hc, generator=g)
    fn = (torch.randn(hc * dim, (2 + hc) * hc, generator=g) * 0.2).t()  # input-major, as loaded
    if bf16:
        fn = fn.to(torch.bfloat16).float()
    base, scale = torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g) + 0.5
    norm = v41.RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=g)
    # the one call runs where the linear kernel takes the weight: where a probe on this CPU finds its product has
    # MKL's bits (on the EPYC not for hc = 1's three outputs, which take BLAS and the five calls)
    assume(v41.products.plan(fn).kc is not None)
    assert (v41.products.plan(fn).is_tiles) == (bf16 and v41.exactness.amx_supported(kernels.get("linear")))
    with torch.no_grad():
        got = ops_c.hc_next(o, x, post, comb, mix, fn, base, scale, norm.weight, norm.eps, cfg)
        xs = ops_c.expand(o, x, post, comb)
        want = xs, ops_c.hyper_mix(xs, fn, base, scale, cfg), norm(ops_c.collapse(xs, mix), ops_c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # written over the old streams (the forward's way): the same bits, the streams' memory reused
    x2 = x.clone()
    with torch.no_grad():
        over = ops_c.hc_next(o, x2, post, comb, mix, fn, base, scale, norm.weight, norm.eps, cfg, in_place=True)
    assert over[0].data_ptr() == x2.data_ptr() and torch.equal(over[0], want[0]) and torch.equal(over[2], want[2])
    assert all(torch.equal(a, b) for a, b in zip(over[1], want[1]))
    x3 = x.clone()
    assert torch.equal(ops_c.expand(o, x3, post, comb, in_place=True), xs) and torch.equal(x3, xs)


def test_the_mhc_forms_agree():
    """The C form of hyper_mix / collapse / expand and their torch form (kernels off) compute the same formula."""
    g = gen(3)
    cfg = v41.ModelConfig.from_dict(v41_small())
    hc, d = cfg.hc_mult, cfg.hidden_size
    x = torch.randn(5, hc, d, generator=g)
    fn, base = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.1, torch.randn((2 + hc) * hc, generator=g)
    scale = torch.tensor([0.7, 1.1, 0.9])
    c = ops_c.hyper_mix(x, fn, base, scale, cfg)
    with kernels.override("none"):
        t = ops_torch.hyper_mix(x, fn, base, scale, cfg)
    for a, b in zip(c, t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def v41_small() -> dict:
    from engram_serve.model.writer import SMALL_TEXT_CONFIG, with_engram_rows
    return with_engram_rows(dict(SMALL_TEXT_CONFIG, engram_layer_ids=[]))


# ---- norm, rotary, pooling, SwiGLU -----------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5), m=st.integers(1, 3), width=st.sampled_from([8, 16, 20]), half=st.sampled_from([1, 2, 4]),
       inverse=st.booleans(), seed=st.integers(0, 2**31))
def test_rms_norm_and_rope_match_their_definition_and_a_token_alone(n, m, width, half, inverse, seed):
    g = gen(seed)
    x, w = torch.randn(n, m, width, generator=g), torch.randn(width, generator=g)
    y = ops_c.rms_norm(x, 1e-6, w)
    want = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    np.testing.assert_allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    ang = torch.rand(n, half, generator=g, dtype=F64) * 6
    cos, sin = ang.cos().float(), ang.sin().float()
    r = ops_c.rope(x, cos, sin, inverse)
    d0 = width - 2 * half
    want = x.double().clone()
    s = -1 if inverse else 1
    for j in range(half):
        a, b = x.double()[..., d0 + 2 * j], x.double()[..., d0 + 2 * j + 1]
        c_, s_ = cos.double()[:, None, j], s * sin.double()[:, None, j]
        want[..., d0 + 2 * j], want[..., d0 + 2 * j + 1] = a * c_ - b * s_, a * s_ + b * c_
    np.testing.assert_allclose(r.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ops_c.rope(r, cos, sin, not inverse)[..., :d0], x[..., :d0])
    mine = x.clone()
    assert ops_c.rope(mine, cos, sin, inverse, in_place=True).data_ptr() == mine.data_ptr() and torch.equal(mine, r)
    assert alone_bits(lambda a: ops_c.rms_norm(a, 1e-6, w), x) == []
    assert alone_bits(lambda a, c, si: ops_c.rope(a, c, si, inverse), x, cos, sin) == []


def test_exp_fixed_is_accurate_and_the_same_in_any_place():
    """exp_fixed through the SwiGLU without a clamp (silu(x) * 1), in the vector body and the tail."""
    x = torch.linspace(-87.0, 88.0, 100_003)
    gu = torch.stack([x, torch.ones_like(x)], 1)
    y = ops_c.swiglu(gu, 1, 0.0).view(-1).double()
    want = x.double() / (1 + torch.exp(-x.double()))
    assert float(((y - want).abs() / want.abs().clamp(min=1e-30)).max()) < 4e-7
    for start, n in ((0, 1), (5, 17), (1000, 33), (99_990, 13)):
        assert torch.equal(ops_c.swiglu(gu[start:start + n], 1, 0.0).view(-1), y.float()[start:start + n])
    special = ops_c.swiglu(torch.tensor([[float("nan"), 1.0], [100.0, 1.0], [-100.0, 1.0]]), 1, 0.0).view(-1)
    assert math.isnan(special[0]) and special[1] == 100.0 and special[2] == 0.0


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), inter=st.sampled_from([1, 8, 19]), limit=st.sampled_from([0.0, 0.25, 1.0, 10.0]),
       seed=st.integers(0, 2**31))
def test_clamped_swiglu_and_pooling_match_their_definition(n, inter, limit, seed):
    g = gen(seed)
    gu = torch.randn(n, 2 * inter, generator=g) * 3
    a, b = gu.double()[:, :inter], gu.double()[:, inter:]
    if limit > 0:
        a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    np.testing.assert_allclose(ops_c.swiglu(gu, inter, limit).double(), a / (1 + torch.exp(-a)) * b, rtol=1e-5, atol=1e-6)
    first, second = torch.randn(n, 2 * inter, generator=g) * 4, torch.randn(n, 2 * inter, generator=g) * 4
    w = torch.softmax(torch.stack([first[:, inter:], second[:, inter:]]).double(), 0)
    want = w[0] * first.double()[:, :inter] + w[1] * second.double()[:, :inter]
    np.testing.assert_allclose(ops_c.pool_pair(first, second).double(), want, rtol=1e-5, atol=1e-6)
    assert alone_bits(lambda x: ops_c.swiglu(x, inter, limit), gu) == []
    assert alone_bits(ops_c.pool_pair, first, second) == []


def test_the_alone_checker_sees_a_batch_dependent_kernel():
    """Negative control of `alone_bits`: torch's sigmoid over a flat call rounds its vector body and its scalar
    tail differently (on the AVX2 and AVX-512 CPUs measured), so a token's bits depend on its place."""
    x = torch.randn(64, 13, generator=gen(0)) * 3
    bad = alone_bits(lambda a: torch.sigmoid(a.reshape(-1)).view(a.shape), x)
    if not bad:
        pytest.skip("torch's sigmoid rounds the same in the vector body and the tail on this CPU")
    assert alone_bits(lambda a: ops_c.swiglu(torch.cat([a, torch.ones_like(a)], 1), 13, 0.0), x) == []


# ---- attention ------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 4), h=st.integers(1, 6), w=st.integers(0, 12), k=st.integers(0, 6),
       hd=st.sampled_from([8, 16, 24, 32, 64]), seed=st.integers(0, 2**31))
def test_attend_paged_is_softmax_with_a_sink_over_the_keys_a_token_reads(n, h, w, k, hd, seed):
    """Each token's keys (its window slots with ok, then the entries its picks name) read in place in the pools,
    against the float64 textbook over the same keys gathered; a row that is masked or not named is never read
    (NaN planted there), and a token's bits do not depend on its batch mates. Sizes cover both forms of the
    score (four heads interleaved, hd a multiple of 16, and the rest) and of the weighted sum (hd a multiple
    of 64 or of 32 in registers, and the rest)."""
    g = gen(seed)
    rows, es = 64, 8
    window, entries = torch.randn(rows, hd, generator=g), torch.randn(rows, hd, generator=g)
    perm = torch.randperm(rows, generator=g)
    wslots = perm[:n * w].view(n, w)  # distinct slots: a masked one is no ok one's
    wok = torch.rand(n, w, generator=g) < 0.7
    eslots = perm[n * w:n * w + n * es].view(n, es) if n * (w + es) <= rows else torch.randint(0, rows, (n, es), generator=g)
    topk = torch.randint(-1, es + 2, (n, k), generator=g)  # -1 and >= es: no pick
    picked = (topk >= 0) & (topk < es)
    q, sink = torch.randn(n, h, hd, generator=g), torch.randn(h, generator=g)
    read = set(wslots[wok].tolist())
    planted_w = window.clone()
    planted_w[[r for r in range(rows) if r not in read]] = float("nan")
    ent_read = {int(eslots[t, topk[t, i]]) for t in range(n) for i in range(k) if picked[t, i]}
    planted_e = entries.clone()
    planted_e[[r for r in range(rows) if r not in ent_read]] = float("nan")

    def run(q, wslots, wok, eslots, topk):
        return ops_c.attend_paged(q, planted_w, wslots, wok, planted_e, eslots if k else None, topk if k else None,
                                  rows - 1, sink, hd ** -0.5)
    out = run(q, wslots, wok, eslots, topk)
    for t in range(n):
        keys = [window[s] for s, o in zip(wslots[t].tolist(), wok[t].tolist()) if o]
        keys += [entries[eslots[t, topk[t, i]]] for i in range(k) if picked[t, i]]
        keys = torch.stack(keys).double() if keys else torch.zeros(0, hd, dtype=torch.float64)
        z = q[t].double() @ keys.T * hd ** -0.5  # [h, keys]
        m = torch.maximum(z.amax(-1) if keys.shape[0] else torch.full((h,), -math.inf, dtype=torch.float64),
                          sink.double())
        e = torch.exp(z - m[:, None])
        want = (e @ keys) / (e.sum(-1) + torch.exp(sink.double() - m))[:, None]
        np.testing.assert_allclose(out[t].double(), want, rtol=1e-5, atol=1e-6)
    assert alone_bits(run, q, wslots, wok, eslots, topk) == []



@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3), groups=st.integers(1, 2), w=st.integers(0, 20), k=st.integers(0, 6),
       hd=st.sampled_from([16, 48, 64, 128]), seed=st.integers(0, 2**31))
def test_attend_paged_gives_four_heads_at_once_the_bits_of_each_head_alone(n, groups, w, k, hd, seed):
    """Where heads come in fours and hd is a multiple of 16 (AVX-512), the scores of four heads against four keys
    run at once and their 16 lane sums reduce together: each head must get exactly the bits of the one-head
    form (dot's lanes and tree, the weighted sums in key order), masked keys and picks dropped or not."""
    g = gen(seed)
    rows, es, h = 96, 8, 4 * groups
    window, entries = torch.randn(rows, hd, generator=g), torch.randn(rows, hd, generator=g)
    wslots, eslots = torch.randint(0, rows, (n, w), generator=g), torch.randint(0, rows, (n, es), generator=g)
    wok, topk = torch.rand(n, w, generator=g) < 0.7, torch.randint(-1, es + 2, (n, k), generator=g)
    q, sink = torch.randn(n, h, hd, generator=g) * 2, torch.randn(h, generator=g)

    def run(q, sink):
        return ops_c.attend_paged(q, window, wslots, wok, entries, eslots if k else None, topk if k else None,
                                  rows - 1, sink, hd ** -0.5)
    together = run(q, sink)
    alone = torch.stack([run(q[:, i:i + 1].contiguous(), sink[i:i + 1]) for i in range(h)], 1)[:, :, 0]
    assert torch.equal(together, alone)

def test_attend_paged_refuses_a_slot_outside_the_pool():
    window, entries = torch.randn(10, 8, generator=gen(1)), torch.randn(10, 8, generator=gen(2))
    q, sink = torch.randn(1, 2, 8, generator=gen(3)), torch.zeros(2)
    wok, eslots, topk = torch.tensor([[True, True, True]]), torch.tensor([[4, 6, 9]]), torch.tensor([[1, -1, 0]])
    ops_c.attend_paged(q, window, torch.tensor([[9, 2, 3]]), wok, entries, eslots, topk, 0, sink, 0.5)
    with pytest.raises(ValueError, match="attend_paged"):
        ops_c.attend_paged(q, window, torch.tensor([[10, 2, 3]]), wok, entries, eslots, topk, 0, sink, 0.5)
    with pytest.raises(ValueError, match="attend_paged"):
        ops_c.attend_paged(q, window, torch.tensor([[9, 2, 3]]), wok, entries, torch.tensor([[4, 11, 9]]), topk, 0, sink, 0.5)


def test_store_rows_writes_complete_entries_and_refuses_a_slot_outside_the_pool():
    pool = torch.zeros(10, 4)
    slots, vals = torch.tensor([3, -1, 5, 7]), torch.arange(16.0).view(4, 4)
    ops_c.store_rows(pool, slots, vals, 8, torch.tensor([1, 2, 4, 5]), 2)  # ratio 2: positions 1 and 5 complete
    assert torch.equal(pool[3], vals[0]) and torch.equal(pool[7], vals[3]) and pool[5].eq(0).all()
    assert torch.equal(pool[8], vals[2])  # the trash slot took the rest (the last write wins)
    with pytest.raises(ValueError, match="store_rows: slot 12"):
        ops_c.store_rows(pool, torch.tensor([1, 12]), vals[:2], 8)
    assert pool[1].eq(0).all()  # nothing written


# ---- the indexer, top-k, candidate blocks ----------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), v=st.one_of(st.integers(0, 40), st.integers(85, 140), st.integers(240, 270)),
       k=st.one_of(st.integers(1, 20), st.integers(56, 72)), data=st.data())
def test_topk_rows_is_the_written_tie_rule(rows, v, k, data):
    """every form the kernel takes: rows ranked whole (up to 96 values, or up to 4 k) and insertions into the
    picks (more values)"""
    special = st.sampled_from([0.0, 1.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 2.5])
    x = torch.tensor([[data.draw(special | st.floats(-3, 3, width=32)) for _ in range(v)] for _ in range(rows)],
                     dtype=torch.float32).view(rows, v)
    got = ops_c.topk(x, k)
    assert got.tolist() == [plain_topk(r, k) for r in x.tolist()]
    with kernels.override("none"):
        assert torch.equal(ops_torch.topk(x, k), got)  # the torch form: the same rule


def test_the_tie_rule_checker_sees_a_later_entry_winning():
    """Negative control: a top-k that lets the later of two equal scores win is told apart."""
    row = [1.0, 3.0, 3.0, 0.5]
    later_wins = sorted(range(4), key=lambda j: (-row[j], -j))[:2]
    assert later_wins == [2, 1] != plain_topk(row, 2) == ops_c.topk(torch.tensor([row]), 2)[0].tolist() == [1, 2]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 4), nh=st.integers(1, 4), ihd=st.sampled_from([8, 16]), block=st.sampled_from([1, 2, 4]),
       restrict=st.booleans(), seed=st.integers(0, 2**31))
def test_index_scores_and_candidate_blocks_match_the_torch_form(n, nh, ihd, block, restrict, seed):
    g = gen(seed)
    rows = 40
    pool = torch.randn(rows, ihd, generator=g)
    e = int(torch.randint(1, 20, (1,), generator=g))
    slots = torch.randint(0, rows, (n, e), generator=g)
    count = torch.randint(0, e + 1, (n,), generator=g)
    width = -(-max(e, 1) // (ops_torch.KEY_CHUNK * block)) * ops_torch.KEY_CHUNK * block
    q, w = torch.randn(n, nh, ihd, generator=g), torch.randn(n, nh, generator=g)
    cands = torch.randint(-1, width // block, (n, 3), generator=g) if restrict else None
    got = ops_c.index_scores(q, w, 0.3, pool, slots, count, width, 0, cands, block)
    keys = pool[torch.nn.functional.pad(slots, (0, width - e), value=0)].double()
    want = (torch.relu(torch.einsum("nhd,ned->nhe", q.double(), keys)) * (w.double() * 0.3)[..., None]).sum(1)
    vis = torch.arange(width)[None] < count[:, None]
    if restrict:
        chosen = torch.zeros(n, width // block + 1, dtype=torch.bool).scatter_(1, torch.where(cands < 0, width // block, cands), True)
        vis &= chosen[:, :-1].repeat_interleave(block, 1)
    assert torch.equal(torch.isinf(got), ~vis)
    np.testing.assert_allclose(got.double()[vis], want[vis], rtol=1e-5, atol=1e-5)
    assert alone_bits(lambda a, b, s_, c_, *cd: ops_c.index_scores(a, b, 0.3, pool, s_, c_, width, 0, cd[0] if cd else None, block),
                      q, w, slots, count, *([cands] if restrict else [])) == []
    blocks = ops_c.candidate_blocks(got, count, block, 3)
    with kernels.override("none"):
        assert torch.equal(ops_torch.candidate_blocks(got, count, block, 3), blocks)


def dot_bits(a: np.ndarray, b: np.ndarray) -> np.float32:
    """The kernels' dot in plain float32 steps: 16 lanes (index mod 16, each a product then a sum, in order),
    then the tree: lane l + 8 onto l, then l + 4, l + 2, l + 1."""
    lanes = [np.float32(0)] * 16
    for i in range(len(a)):
        lanes[i % 16] = np.float32(lanes[i % 16] + np.float32(a[i] * b[i]))
    for w in (8, 4, 2, 1):
        lanes = [np.float32(lanes[l] + lanes[l + w]) for l in range(w)]
    return lanes[0]


@settings(max_examples=15, deadline=None)
@given(nh=st.sampled_from([1, 4, 8]), ihd=st.sampled_from([16, 32, 48]), e=st.integers(1, 14),
       seed=st.integers(0, 2**31))
def test_index_scores_have_the_bits_of_the_plain_float32_loop(nh, ihd, e, seed):
    """Each visible entry's score, bit for bit, against float32 steps written out: the kernel's dot per head, the
    heads summed in order (0 + w_h * 0.3 * relu(dot)). Where heads come in fours (AVX-512) four entries' dots run
    at once and reduce together; they must still get each dot's own bits."""
    g = gen(seed)
    pool = torch.randn(30, ihd, generator=g) * 2
    slots, count = torch.randint(0, 30, (2, e), generator=g), torch.randint(0, e + 1, (2,), generator=g)
    q, w = torch.randn(2, nh, ihd, generator=g), torch.randn(2, nh, generator=g)
    got = ops_c.index_scores(q, w, 0.3, pool, slots, count, e, 0, None, 1).numpy()
    for t in range(2):
        for x in range(int(count[t])):
            acc = np.float32(0)
            for h in range(nh):
                d = dot_bits(q[t, h].numpy(), pool[slots[t, x]].numpy())
                acc = np.float32(acc + np.float32(np.float32(w[t, h] * np.float32(0.3)) * max(d, np.float32(0))))
            assert got[t, x].tobytes() == acc.tobytes(), (t, x)


# ---- MoE ---------------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 7), e=st.integers(1, 9), data=st.data(), norm=st.booleans(), seed=st.integers(0, 2**31))
def test_router_grouping_and_combine_match_their_definition(n, e, data, norm, seed):
    k = data.draw(st.integers(1, e))
    g = gen(seed)
    z, bias = torch.randn(n, e, generator=g) * 3, torch.randn(e, generator=g) * 0.1
    ids, w = ops_c.moe_route(z, bias, k, norm, 1.5)
    score = torch.sqrt(torch.nn.functional.softplus(z.double()))
    for t in range(n):
        assert ids[t].tolist() == plain_topk((score[t] + bias.double()).tolist(), k)
        want = score[t, ids[t]]
        want = want / want.sum() if norm and k > 1 else want
        np.testing.assert_allclose(w[t].double(), want * 1.5, rtol=1e-5)
    order, counts, tok = ops_c.moe_group(ids, e)
    flat = ids.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(counts, torch.bincount(flat, minlength=e)) and torch.equal(tok, order // k)
    ys, shared = torch.randn(n * k, 5, generator=g), torch.randn(n, 5, generator=g)
    want = torch.zeros(n, 5).index_add_(0, tok, ys * w.reshape(-1)[order][:, None]) + shared
    assert torch.equal(ops_c.moe_combine(ys, order, w, lambda: shared), want)  # the torch form's very operations
    assert alone_bits(lambda a: ops_c.moe_route(a, bias, k, norm, 1.5), z) == []
    with pytest.raises(ValueError, match="moe_group: expert id"):
        ops_c.moe_group(torch.tensor([[0, e]]), e)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 6), dim=st.sampled_from([1, 5, 64, 130]), drop=st.integers(0, 3),
       seed=st.integers(0, 2**31))
def test_combine_adds_each_tokens_pairs_in_their_order(n, k, dim, drop, seed):
    """A token's outputs: 0 plus w y of its pairs in the order they are listed (some (token, pick) without one),
    then the shared expert's; a pair listed twice is refused."""
    g = gen(seed)
    order = torch.randperm(n * k, generator=g)[:max(n * k - drop, 0)]
    ys, w = torch.randn(len(order), dim, generator=g), torch.rand(n, k, generator=g)
    shared = torch.randn(n, dim, generator=g)
    want = torch.zeros(n, dim)
    for p, q in enumerate(order.tolist()):
        want[q // k] = want[q // k] + ys[p] * w.reshape(-1)[q]
    assert torch.equal(ops_c.moe_combine(ys, order, w, lambda: shared), want + shared)
    if len(order) > 1:
        with pytest.raises(ValueError, match="listed twice"):
            ops_c.moe_combine(ys, torch.cat([order[:-1], order[:1]]), w, None)


# ---- Engram, embedding, sampling ------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), hc=st.sampled_from([1, 2, 4]), dim=st.sampled_from([16, 40, 2048, 4096]),
       seed=st.integers(0, 2**31))
def test_engram_gate_matches_the_plain_loop_and_a_row_alone(n, hc, dim, seed):
    """(dims past 1024: the published models' widths, e.g. V4.1-Flash's 4096)"""
    g = gen(seed)
    h, kv = torch.randn(n, hc, dim, generator=g), torch.randn(n, (hc + 1) * dim, generator=g)
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    dead = torch.rand(n, generator=g) < 0.3
    gated = ops_c.engram_gate(h, kv, qw, kw, dead, 1e-6)

    def rms(a):
        return a / math.sqrt(sum(float(x) ** 2 for x in a) / dim + 1e-6)
    for t in range(n):
        for i in range(hc):
            dot = float((rms(h[t, i].double()) * qw[i].double() * rms(kv[t, i * dim:(i + 1) * dim].double())
                         * kw[i].double()).sum()) / math.sqrt(dim)
            gate = 0.0 if dead[t] else 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            np.testing.assert_allclose(gated[t, i].double(), h[t, i].double() + gate * kv[t, hc * dim:].double(),
                                       rtol=1e-5, atol=1e-5)
    assert alone_bits(lambda a, b, c: ops_c.engram_gate(a, b, qw, kw, c, 1e-6), h, kv, dead) == []


def test_the_form_taken_does_not_depend_on_the_layout():
    """A column slice of one row is contiguous, of several rows not (tensor parallelism's summed Engram
    projections, a fused matmul's halves are such slices): the C form runs for both, or a token's bits would
    depend on its batch. (Choosing the form by contiguity once broke TP=2 across cuts.)"""
    g = gen(0)
    hc, dim = 2, 16
    h = torch.randn(3, hc, dim, generator=g)
    kv = torch.randn(3, 2 * (hc + 1) * dim, generator=g)[:, :(hc + 1) * dim]
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    assert not kv.is_contiguous() and kv[1:2].is_contiguous()
    assert alone_bits(lambda a, b: ops_c.engram_gate(a, b, qw, kw, None, 1e-6), h, kv) == []
    gu = torch.randn(3, 4 * 8, generator=g)[:, :2 * 8]
    assert alone_bits(lambda a: ops_c.swiglu(a, 8, 1.0), gu) == []
    x = torch.randn(3, 2 * dim, generator=g)[:, :dim]
    assert alone_bits(lambda a: ops_c.rms_norm(a, 1e-6, None), x) == []


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
    """`ops_c.argmax_finite` (the sampler's argmax and finite flags) against a plain loop and torch.argmax, on
    rows with ties, +-0, +-inf and NaN, in the vector body and the tail."""
    special = st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 3.5])
    x = torch.tensor([[data.draw(special | st.floats(-4, 4, width=32)) for _ in range(v)] for _ in range(rows)],
                     dtype=torch.float32)
    got, finite = ops_c.argmax_finite(x)
    assert got.tolist() == [plain_argmax(r) for r in x.tolist()]
    assert torch.equal(got, x.argmax(dim=1)) and torch.equal(ops_c.argmax_rows(x), got)
    assert finite.tolist() == [all(math.isfinite(a) for a in r) for r in x.tolist()]


def test_gather_rows_refuses_an_id_outside_the_table():
    src = torch.randn(5, 3)
    assert torch.equal(ops_c.gather_rows(src, torch.tensor([4, 0]), 2), src[[4, 0]][:, None].expand(2, 2, 3))
    with pytest.raises(ValueError, match="index 5 at entry 1"):
        ops_c.gather_rows(src, torch.tensor([0, 5]))


# ---- the model: both forms, the serving layout, the choice rule ------------------------------------------
@pytest.fixture(scope="module")
def exact():
    import test_v41_exact
    return test_v41_exact


def test_the_c_and_torch_forms_compute_the_same_model(exact):
    """The whole forward with the C forms and with the torch forms (kernels off): the same formula, so logits
    agree to float32 rounding (not bit for bit: each form is exact against itself)."""
    m = exact.make_model()
    seq = torch.randint(0, 4096, (23,), generator=gen(5))
    c = exact.alone(m, seq)
    with kernels.override("none"):
        t = exact.alone(m, seq)
    assert not torch.equal(c, t)  # two forms indeed
    torch.testing.assert_close(torch.log_softmax(c.double(), -1), torch.log_softmax(t.double(), -1), rtol=0, atol=2e-5)


def test_the_serving_layout_is_exact_across_batches_and_chunks(exact):
    """The model as load_model lays it out (input-major matmul weights: the C matmul serves them) gives a
    request the bits of its run alone, beside other requests and in chunks."""
    m = layout_weights_(exact.make_model(seed=1))
    rng = random.Random(0)
    seqs = [torch.randint(0, 4096, (n,), generator=gen(10 + n)) for n in (9, 17, 4)]
    got = exact.run_schedule(m, seqs, exact.random_schedule([len(s) for s in seqs], rng))
    for r, s in enumerate(seqs):
        assert torch.equal(got[r], exact.alone(m, s)), r


def test_negative_control_the_form_chosen_by_the_token_count(exact, monkeypatch):
    """Choosing C or torch by the number of tokens (C for a one-token call) gives a request in a batch other
    bits than alone: the choice must depend on devices, dtypes and kernels only."""
    m = exact.make_model()
    seqs = [torch.randint(0, 4096, (6,), generator=gen(s)) for s in (1, 2)]
    want = [exact.alone(m, s) for s in seqs]
    real = v41.DeepseekV41.forward_stages

    def by_count(self, ids, *args, **kw):  # C for a forward of at most 2 tokens, torch for more
        monkeypatch.setattr(v41, "choose", lambda *ts: ops_c if ids.shape[0] <= 2 else ops_torch)
        return real(self, ids, *args, **kw)
    monkeypatch.setattr(v41.DeepseekV41, "forward_stages", by_count)
    got = exact.run_schedule(m, seqs, [[(0, 1), (1, 1)], [(0, 5), (1, 5)]])
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), rows=st.integers(1, 3), blocks=st.integers(1, 5), bs=st.sampled_from([1, 4, 5]),
       window=st.integers(1, 9), bound=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_the_slot_plan_in_c_is_the_torch_plan(n, rows, blocks, bs, window, bound, seed):
    """SlotPlan.build's C form (plan_window, plan_entries) against its torch form, with null blocks, positions
    past the block table, padding rows and a static bound."""
    from engram_serve.model.paged_state import SlotPlan
    g = gen(seed)
    tables = torch.randint(-1, 30, (rows, blocks), generator=g)
    positions = torch.randint(0, blocks * bs + 3, (n,), generator=g)
    row = torch.randint(0, rows, (n,), generator=g)
    slots = torch.randint(-1, 30, (n,), generator=g)
    top = int(positions.max()) + bound
    build = lambda: SlotPlan.build(positions, row, tables, bs, slots, 99, window, (0, 1, 2, 2), top)  # noqa: E731
    c = build()
    with kernels.override("none"):
        t = build()
    for f in ("window", "window_ok", "prev_slots"):
        assert torch.equal(getattr(c, f), getattr(t, f)), f
    assert c.entry_count.keys() == t.entry_count.keys() == {1, 2}
    for r in (1, 2):
        assert torch.equal(c.entry_count[r], t.entry_count[r]) and torch.equal(c.entry_slots[r], t.entry_slots[r])
    with pytest.raises(ValueError, match="plan_window: row 3"):  # rows <= 3: row 3 is past the table
        SlotPlan.build(positions, torch.full((n,), 3), tables, bs, slots, 99, window, (1,), top)


@pytest.mark.parametrize("spec", ["all", "none"])
def test_the_attention_of_a_long_prefill_in_token_chunks_has_the_same_bits(exact, monkeypatch, spec):
    """A prefill's keys are gathered ATTN_TOKENS tokens at a time: chunks of 3 give the bits of one chunk."""
    m = exact.make_model()
    seq = torch.randint(0, 4096, (20,), generator=gen(8))
    with kernels.override(spec):
        whole = exact.alone(m, seq)
        monkeypatch.setattr(ops_torch, "ATTN_TOKENS", 3)
        assert torch.equal(exact.alone(m, seq), whole)
