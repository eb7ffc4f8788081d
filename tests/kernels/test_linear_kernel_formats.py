"""Products over a weight as its checkpoint stores it, read in place (the linear kernel's `linear_stored`,
exactness.py `matmul_stored`): MXFP4 (E2M1 codes, an E8M0 scale per 32 inputs), block-scaled FP8 (E4M3, an E8M0
scale per block x block tile) and BF16 give exactly the bits of the float panels (`linear_packed`) over the dequantized weight
(engram/quantized.py `dequantize_fp4`, `dequantize_blocks`, a cast), for 1 to 70 rows, several k and n (n not a multiple of
16 too), block sizes kc, at every SIMD level this CPU has (0 portable, 1 AVX2, 2 AVX-512: the same bits, each
other's too); and the MoE's one-call `moe_experts` on stored experts equals it on float panels. Negative control: a
reference dequantized with one E2M1 code decoded wrong differs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.engram.quantized import FP4_VALUES, SCALE_COLS, dequantize_blocks, dequantize_fp4
from engram_serve.model import exactness
from engram_serve.model.exactness import STORED_BF16, STORED_FP8, STORED_MXFP4, WORDS
from engram_serve.model.weights import StoredWeight

lin = kernels.get("linear")
pytestmark = pytest.mark.skipif(lin is None, reason="the linear kernel is not built")
LEVELS = list(range(lin.simd_level() + 1)) if lin is not None else []


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def mxfp4_weight(n: int, k: int, seed: int, lo: int = 112, hi: int = 140) -> tuple[torch.Tensor, torch.Tensor]:
    """random packed E2M1 [n, k / 2] and E8M0 scales [n, k / 32] (exponents lo..hi)"""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi + 1, (n, k // SCALE_COLS), generator=g, dtype=torch.uint8)
    return codes, scales


def fp8_weight(n: int, k: int, block: int, seed: int, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """random E4M3 [n, k] (no NaN code unless `nan`) and E8M0 scales per block x block tile"""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    if not nan:
        q[(q & 0x7F) == 0x7F] = 0x7E
    return q, torch.randint(100, 140, (-(-n // block), -(-k // block)), generator=g, dtype=torch.uint8)


def wide_inputs(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x's rows at every float32 exponent (each row its own, +-8 about it), with zeros, infinities and NaNs"""
    m, k = x.shape
    x = x * torch.exp2(torch.randint(-149, 128, (m, 1), generator=g).float() +
                       torch.randint(-8, 9, (m, k), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    return torch.where(torch.rand(m, k, generator=g) < 0.02, special[torch.randint(0, 5, (m, k), generator=g)], x)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """equal bits, any NaN the same (a NaN's sign and payload follow which NaN an instruction form propagates
    first)"""
    return torch.equal(bits(got.nan_to_num(nan=1.5)), bits(want.nan_to_num(nan=1.5))) and \
        torch.equal(got.isnan(), want.isnan())


def float_product(x, w, kc, simd):
    return exactness.matmul_kernel(x, exactness.pack_panels(w.t()), w.shape[0], kc, simd)


def mxfp4_float(codes, scales, lut=FP4_VALUES):
    if lut is FP4_VALUES:
        return dequantize_fp4(codes, scales.view(torch.float8_e8m0fnu))
    t = torch.tensor(lut, dtype=torch.float32)
    b = codes.long()
    v = torch.stack([t[b & 15], t[b >> 4]], -1).view(codes.shape[0], -1)
    return v * torch.exp2(scales.float() - 127).repeat_interleave(SCALE_COLS, 1)


def fp8_float(q, s, block):
    return dequantize_blocks(q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), block)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([32, 64, 96, 160, 256, 512]), n=st.integers(1, 70),
       kc=st.sampled_from([8, 16, 48, 64, 256, 4096]), seed=st.integers(0, 2**16), wide=st.booleans())
def test_stored_mxfp4_gives_the_float_panels_bits(m, k, n, kc, seed, wide):
    """`wide`: inputs of every float32 exponent, zeros, infinities and NaNs, so that the AVX-512 form's scaled
    accumulators underflow, could overflow or are proven exact, block by block"""
    codes, scales = mxfp4_weight(n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    if wide:
        x = wide_inputs(x, g)
    want = float_product(x, mxfp4_float(codes, scales), kc, LEVELS[-1])
    words = exactness.panel_words(codes, fp8=False)
    for simd in LEVELS:
        assert same_bits(float_product(x, mxfp4_float(codes, scales), kc, simd), want)
        assert same_bits(exactness.matmul_stored(x, STORED_MXFP4, codes, scales, n, kc, simd=simd), want), simd
        assert same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS, words, scales, n, kc, simd=simd), want), simd


@pytest.mark.skipif(not LEVELS or LEVELS[-1] < 2, reason="MXFP4's scaled accumulators are AVX-512's")
def test_mxfp4_scaled_accumulators_are_taken_only_where_proven():
    """Negative control: rows of inputs near 2^-100 round below the normal range in the scaled chain (c / (s 2^32))
    and not in the plain one; unproven blocks taken anyway (set_mx_proof(False)) give other bits"""
    n, k = 64, 256
    codes, scales = mxfp4_weight(n, k, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, k, generator=g) * 2.0 ** -100
    want = float_product(x, mxfp4_float(codes, scales), 64, 2)
    words = exactness.panel_words(codes, fp8=False)
    run = lambda: exactness.matmul_stored(x, STORED_MXFP4 | WORDS, words, scales, n, 64, simd=2)
    assert torch.equal(bits(run()), bits(want))
    was = lin.set_mx_proof(False)
    try:
        unproven = run()
    finally:
        lin.set_mx_proof(was)
    assert not torch.equal(bits(unproven), bits(want))
    assert torch.equal(bits(run()), bits(want))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([16, 36, 64, 200, 512]), n=st.integers(1, 70),
       block=st.sampled_from([16, 32, 128, 256]), kc=st.sampled_from([4, 16, 48, 64, 4096]), seed=st.integers(0, 2**16),
       wide=st.booleans())
def test_stored_fp8_gives_the_float_panels_bits(m, k, n, block, kc, seed, wide):
    """`wide`: inputs of every float32 exponent, zeros, infinities and NaNs, so that the AVX-512 form's inputs
    times the block's scale (`fp8_prescale`) overflow, fall below the normal range or stay exact, block by block"""
    q, s = fp8_weight(n, k, block, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    if wide:
        x = wide_inputs(x, g)
    want = float_product(x, fp8_float(q, s, block), kc, LEVELS[-1])
    words = exactness.panel_words(q, fp8=True)
    for simd in LEVELS:
        for got in (exactness.matmul_stored(x, STORED_FP8, q, s, n, kc, block=block, simd=simd),
                    exactness.matmul_stored(x, STORED_FP8 | WORDS, words, s, n, kc, block=block, simd=simd)):
            assert same_bits(got, want), simd


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([2, 6, 32, 200, 512]), n=st.integers(1, 70),
       kc=st.sampled_from([2, 8, 48, 4096]), seed=st.integers(0, 2**16))
def test_stored_bf16_gives_the_float_panels_bits(m, k, n, kc, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-60, 60, (n, k), generator=g).float())).bfloat16()
    x = torch.randn(m, k, generator=g)
    want = float_product(x, w.float(), kc, LEVELS[-1])
    words = exactness.panel_words(w.view(torch.uint8), fp8=False)
    for simd in LEVELS:
        assert torch.equal(bits(exactness.matmul_stored(x, STORED_BF16, w, None, n, kc, simd=simd)), bits(want)), simd
        assert torch.equal(bits(exactness.matmul_stored(x, STORED_BF16 | WORDS, words, None, n, kc, simd=simd)),
                           bits(want)), simd


@pytest.mark.parametrize("m", [1, 2, 7, 16, 40])
def test_extreme_scales_nan_codes_and_a_streamed_weight_get_the_same_bits(m):
    """every E8M0 exponent (subnormal weights, infinities where 6 x 2^127 overflows, NaN scales), every E4M3 code
    (its NaNs too), and weights of more than 1 MiB (the AVX-512 tiles' prefetch): NaN where the float product has
    NaN, else its bits"""
    k, n = 1024, 300
    codes, scales = mxfp4_weight(n, k, m, lo=0, hi=255)
    q, s = fp8_weight(n, k, 128, m, nan=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for simd in LEVELS:
        for want, got in ((float_product(x, mxfp4_float(codes, scales), 64, simd),
                           exactness.matmul_stored(x, STORED_MXFP4, codes, scales, n, 64, simd=simd)),
                          (float_product(x, fp8_float(q, s, 128), 64, simd),
                           exactness.matmul_stored(x, STORED_FP8, q, s, n, 64, block=128, simd=simd))):
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(bits(got)[~torch.isnan(got)], bits(want)[~torch.isnan(want)])


def test_a_kc_or_shape_the_stored_kernel_does_not_take_is_refused():
    codes, scales = mxfp4_weight(16, 64, 0)
    x = torch.randn(2, 64)
    assert not exactness.stored_kc_fits(STORED_MXFP4, 64, 12) and exactness.stored_kc_fits(STORED_MXFP4, 64, 16)
    with pytest.raises(ValueError, match="kc 12"):
        exactness.matmul_stored(x, STORED_MXFP4, codes, scales, 16, 12)
    with pytest.raises(ValueError, match="block 0"):
        exactness.matmul_stored(x, STORED_FP8, *fp8_weight(16, 64, 32, 0), 16, 16)


def test_a_reference_with_one_e2m1_code_wrong_differs():
    """Negative control: the float panels of a weight dequantized with code 3 as 1.25 (not 1.5) are not the stored
    product's bits, so the comparison above sees a decoder one code off."""
    codes, scales = mxfp4_weight(32, 64, 5)
    x = torch.randn(3, 64)
    wrong = tuple(1.25 if i == 3 else v for i, v in enumerate(FP4_VALUES))
    got = exactness.matmul_stored(x, STORED_MXFP4, codes, scales, 32, 64)
    assert torch.equal(bits(got), bits(float_product(x, mxfp4_float(codes, scales), 64, 2)))
    assert not torch.equal(bits(got), bits(float_product(x, mxfp4_float(codes, scales, wrong), 64, 2)))


@pytest.mark.parametrize("d,inter,experts", [(64, 32, 3), (96, 64, 4)])
def test_moe_experts_as_stored_equal_them_on_float_panels(d, inter, experts):
    g = torch.Generator().manual_seed(d + inter)
    w1, w3 = ([mxfp4_weight(inter, d, 10 * e + j) for e in range(experts)] for j in (0, 2))
    w2 = [mxfp4_weight(d, inter, 10 * e + 1) for e in range(experts)]
    counts = torch.tensor([5, 0, 17, 1][:experts], dtype=torch.int64)
    xs = torch.randn(int(counts.sum()), d, generator=g)
    float13 = [exactness.pack_panels(torch.cat([mxfp4_float(*a), mxfp4_float(*b)]).t()) for a, b in zip(w1, w3)]
    float2 = [exactness.pack_panels(mxfp4_float(*w).t()) for w in w2]
    addr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    want = exactness.moe_experts(xs, counts, addr(float13), 32, addr(float2), 48, inter, 7.0)
    stored = (addr([s for _, s in w1]), addr([c for c, _ in w3]), addr([s for _, s in w3]), addr([s for _, s in w2]))
    got = exactness.moe_experts(xs, counts, addr([c for c, _ in w1]), 32, addr([c for c, _ in w2]), 48, inter, 7.0,
                                stored=stored)
    assert torch.equal(bits(got), bits(want))
    words = [[exactness.panel_words(c, fp8=False) for c, _ in w] for w in (w1, w3, w2)]
    stored = (stored[0], addr(words[1]), stored[2], stored[3])
    got = exactness.moe_experts(xs, counts, addr(words[0]), 32, addr(words[2]), 48, inter, 7.0, stored=stored,
                                words=True)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("r0,r1", [(16, 48), (32, 70), (48, 53), (0, 5)])
def test_rows_of_a_stored_fp8_weight_give_their_bits(r0, r1):
    """rows r0.. of a weight as stored (model/weights.py `StoredWeight.rows`: a group of a block-diagonal weight): its
    scales from block row r0 // block, `row0` = r0 % block; from the rows as stored and from their panel-major words"""
    q, s = fp8_weight(70, 64, 32, 3)
    part = StoredWeight(STORED_FP8, [(q, s, 0)], 32, [exactness.panel_words(q, fp8=True)]).rows(r0, r1)
    ((d, sc, row0),), (words,) = part.parts, part.words
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(r0))
    want = float_product(x, fp8_float(q, s, 32)[r0:r1], 16, LEVELS[-1])
    for simd in LEVELS:
        for fmt, data in ((STORED_FP8, d), (STORED_FP8 | WORDS, words)):
            got = exactness.matmul_stored(x, fmt, data, sc, r1 - r0, 16, block=32, simd=simd, row0=row0)
            assert torch.equal(bits(got), bits(want)), (simd, fmt)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 70), k=st.sampled_from([4, 8, 36, 200]), seed=st.integers(0, 2**16))
def test_fp8_words_are_the_rows_bytes_panel_major(n, k, seed):
    """`panel_words`: word w of row 16 p + r at [p][w][r], zero rows beyond n: a permutation of the bytes; None where
    a code is NaN"""
    q, _ = fp8_weight(n, k, 16, seed)
    words = exactness.panel_words(q, fp8=True)
    padded = torch.cat([q, torch.zeros(words.shape[0] * 16 - n, k, dtype=torch.uint8)])
    assert torch.equal(words, padded.view(-1, 16, k // 4, 4).transpose(1, 2))
    q[seed % n, seed % k] = 0x7F | (seed & 0x80)
    assert exactness.panel_words(q, fp8=True) is None


def test_fp8_words_in_another_order_give_other_bits():
    """Negative control: the kernel reads words as laid out; two rows of a panel swapped give other outputs"""
    q, s = fp8_weight(32, 64, 32, 9)
    words = exactness.panel_words(q, fp8=True)
    x = torch.randn(3, 64)
    want = exactness.matmul_stored(x, STORED_FP8, q, s, 32, 16, block=32)
    assert torch.equal(bits(exactness.matmul_stored(x, STORED_FP8 | WORDS, words, s, 32, 16, block=32)), bits(want))
    swapped = words.clone()
    swapped[0, :, [1, 2]] = words[0, :, [2, 1]]
    assert not torch.equal(bits(exactness.matmul_stored(x, STORED_FP8 | WORDS, swapped, s, 32, 16, block=32)), bits(want))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 70), groups=st.integers(1, 4), out=st.sampled_from([32, 64]), k=st.sampled_from([32, 96, 128]),
       bf16=st.booleans(), words=st.booleans(), seed=st.integers(0, 2**16))
def test_a_block_diagonal_weight_in_one_call_gives_each_groups_bits(m, groups, out, k, bf16, words, seed):
    """`linear_stored` with `groups` (V4.1's grouped wo_a, `StoredWeight.run_groups`): output group g reads x's inputs
    [g k, (g + 1) k) in one call, one job for the pool, and every output gets the bits of a call a group (a group's
    rows, `rows`), at every SIMD level of the float panels and on the AMX tiles where the CPU has them"""
    g = torch.Generator().manual_seed(seed)
    n = groups * out
    if bf16:
        data, scales, fmt = torch.randn(n, k, generator=g).bfloat16(), None, STORED_BF16
    else:
        (data, scales), fmt = fp8_weight(n, k, 32, seed), STORED_FP8
    w = StoredWeight(fmt, [(data, scales, 0)], 0 if bf16 else 32,
                     [exactness.panel_words(data.view(torch.uint8), not bf16)] if words else None)
    x = torch.randn(m, groups * k, generator=g)
    parts = [w.rows(i * out, (i + 1) * out) for i in range(groups)]
    flags = [0] + ([exactness.AMX] if exactness.on_tiles() else [])
    for flag in flags:
        for simd in LEVELS if not flag else [2]:
            want = torch.cat([exactness.matmul_stored(x[:, i * k:(i + 1) * k].contiguous(),
                                                      fmt | (WORDS if words else 0) | flag,
                                                      p.words[0] if words else p.parts[0][0], p.parts[0][1], out, 16,
                                                      p.block, simd, row0=p.parts[0][2]) for i, p in enumerate(parts)], 1)
            got = exactness.matmul_stored(x, fmt | (WORDS if words else 0) | flag, w.words[0] if words else data, scales,
                                          n, 16, w.block, simd, groups=groups)
            assert torch.equal(bits(got), bits(want)), (flag, simd)
    run = w.run_groups(x, groups)  # None exactly where a group's `run` is not the kernel's (it runs a float copy)
    assert (run is None) == (parts[0]._call()[0] is None)
    if run is not None:
        assert torch.equal(bits(run), bits(torch.cat([p.run(x[:, i * k:(i + 1) * k]) for i, p in enumerate(parts)], 1)))


@pytest.mark.parametrize("m,groups", [(1, 4), (7, 2), (40, 3)])
def test_mxfp4_groups_in_one_call_give_each_groups_bits(m, groups):
    """the same for MXFP4 rows (as stored and panel-major), whose scales are a row's own"""
    k, out = 64, 32
    codes, scales = mxfp4_weight(groups * out, k, m)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m))
    for flag in [0] + ([exactness.AMX] if exactness.on_tiles() else []):
        for words in (False, True):
            fmt = STORED_MXFP4 | (WORDS if words else 0) | flag
            data = lambda c: exactness.panel_words(c, fp8=False) if words else c  # noqa: E731
            for simd in LEVELS if not flag else [2]:
                want = torch.cat([exactness.matmul_stored(x[:, i * k:(i + 1) * k].contiguous(), fmt,
                                                          data(codes[i * out:(i + 1) * out].contiguous()),
                                                          scales[i * out:(i + 1) * out], out, 16, simd=simd)
                                  for i in range(groups)], 1)
                got = exactness.matmul_stored(x, fmt, data(codes), scales, groups * out, 16, simd=simd, groups=groups)
                assert torch.equal(bits(got), bits(want)), (flag, words, simd)


def test_groups_that_do_not_split_the_outputs_in_32s_are_refused():
    q, s = fp8_weight(96, 32, 32, 1)
    with pytest.raises(ValueError, match="groups"):
        exactness.matmul_stored(torch.randn(2, 64), STORED_FP8, q, s, 96, 16, 32, groups=2)
    assert StoredWeight(STORED_FP8, [(q, s, 0)], 32).run_groups(torch.randn(2, 96), 3) is None
