"""Products over a weight as stored: the linear kernel's MXFP4 panels (`linear_mxfp4`, exactness.py `pack_mxfp4`)
give exactly the bits of its float panels (`linear_packed`) over the dequantized weight (engram/quantized.py
`dequantize_fp4`), for 1 to 70 rows, several k and n (n not a multiple of 16 too), any block size kc, at every
SIMD level this CPU has (0 portable, 1 AVX2, 2 AVX-512: the same bits, each other's too); and the MoE's one-call
`moe_experts` on MXFP4 panels equals it on float panels. Negative control: a reference dequantized with one E2M1
code decoded wrong differs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.engram.quantized import FP4_VALUES, SCALE_COLS, dequantize_fp4
from engram_serve.model import exactness

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


def float_product(x, codes, scales, kc, simd, lut=FP4_VALUES):
    w = dequantize_table(codes, scales, lut)  # [n, k]
    return exactness.matmul_kernel(x, exactness.pack_panels(w.t()), w.shape[0], kc, simd)


def dequantize_table(codes, scales, lut):
    if lut is FP4_VALUES:
        return dequantize_fp4(codes, scales.view(torch.float8_e8m0fnu))
    t = torch.tensor(lut, dtype=torch.float32)
    b = codes.long()
    v = torch.stack([t[b & 15], t[b >> 4]], -1).view(codes.shape[0], -1)
    return v * torch.exp2(scales.float() - 127).repeat_interleave(SCALE_COLS, 1)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([32, 64, 96, 160, 256, 512]), n=st.integers(1, 70),
       kc=st.sampled_from([1, 16, 48, 64, 256, 4096]), seed=st.integers(0, 2**16))
def test_mxfp4_panels_give_the_float_panels_bits(m, k, n, kc, seed):
    codes, scales = mxfp4_weight(n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    mx = exactness.pack_mxfp4(codes, scales)
    assert mx[0].shape == (-(-n // 16), k, 8) and mx[1].shape == (-(-n // 16), k // 32, 16)
    want = float_product(x, codes, scales, kc, LEVELS[-1])
    for simd in LEVELS:
        assert torch.equal(bits(float_product(x, codes, scales, kc, simd)), bits(want))  # (the float panels agree)
        assert torch.equal(bits(exactness.matmul_mxfp4(x, mx, n, kc, simd)), bits(want)), simd


@pytest.mark.parametrize("m", [1, 2, 7, 16, 40])
def test_extreme_scales_and_a_streamed_weight_get_the_same_bits(m):
    """every E8M0 exponent but NaN's (subnormal weights, and infinities where 6 x 2^127 overflows), and a weight of
    more than 1 MiB of panels (the AVX-512 tiles' prefetch)"""
    k, n = 1024, 300
    codes, scales = mxfp4_weight(n, k, m, lo=0, hi=254)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    mx = exactness.pack_mxfp4(codes, scales)
    for simd in LEVELS:
        want, got = float_product(x, codes, scales, 64, simd), exactness.matmul_mxfp4(x, mx, n, 64, simd)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(bits(got)[~torch.isnan(got)], bits(want)[~torch.isnan(want)])


def test_the_panels_hold_the_stored_bytes_within_ten_percent():
    for n, k in ((512, 1024), (1024, 256), (200, 96)):
        codes, scales = mxfp4_weight(n, k, 0)
        mx = exactness.pack_mxfp4(codes, scales)
        stored = codes.numel() + scales.numel()
        assert stored <= mx[0].numel() + mx[1].numel() <= 1.1 * stored


def test_a_reference_with_one_e2m1_code_wrong_differs():
    """Negative control: the float panels of a weight dequantized with code 3 as 1.25 (not 1.5) are not the MXFP4
    panels' bits, so the comparison above sees a decoder one code off."""
    codes, scales = mxfp4_weight(32, 64, 5)
    x = torch.randn(3, 64)
    mx = exactness.pack_mxfp4(codes, scales)
    wrong = tuple(1.25 if i == 3 else v for i, v in enumerate(FP4_VALUES))
    got = exactness.matmul_mxfp4(x, mx, 32, 64)
    assert torch.equal(bits(got), bits(float_product(x, codes, scales, 64, 2)))
    assert not torch.equal(bits(got), bits(float_product(x, codes, scales, 64, 2, lut=wrong)))


@pytest.mark.parametrize("d,inter,experts", [(64, 32, 3), (96, 64, 4)])
def test_moe_experts_on_mxfp4_panels_equal_them_on_float_panels(d, inter, experts):
    g = torch.Generator().manual_seed(d + inter)
    w13 = [mxfp4_weight(2 * inter, d, 10 * e) for e in range(experts)]
    w2 = [mxfp4_weight(d, inter, 10 * e + 1) for e in range(experts)]
    counts = torch.tensor([5, 0, 17, 1][:experts], dtype=torch.int64)
    xs = torch.randn(int(counts.sum()), d, generator=g)
    float13 = [exactness.pack_panels(dequantize_fp4(c, s.view(torch.float8_e8m0fnu)).t()) for c, s in w13]
    float2 = [exactness.pack_panels(dequantize_fp4(c, s.view(torch.float8_e8m0fnu)).t()) for c, s in w2]
    mx13 = [exactness.pack_mxfp4(c, s) for c, s in w13]
    mx2 = [exactness.pack_mxfp4(c, s) for c, s in w2]
    addr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    want = exactness.moe_experts(xs, counts, addr(float13), 32, addr(float2), 48, inter, 7.0)
    got = exactness.moe_experts(xs, counts, addr([c for c, _ in mx13]), 32, addr([c for c, _ in mx2]), 48, inter, 7.0,
                                scales13=addr([s for _, s in mx13]), scales2=addr([s for _, s in mx2]))
    assert torch.equal(bits(got), bits(want))
