"""The weight formats' exact decoders (engram_serve/model/_formats.h), through the linear kernel's `decode_formats`:
every code of E2M1 (under every E8M0 scale, as MXFP4), E8M0, E4M3 and BF16, by each SIMD form this CPU has (0 the
scalar decoders, 1 AVX2, 2 AVX-512), against plain float64 decoders written here from the formats' definitions
(they share no code with the package)."""
from __future__ import annotations

import math

import pytest
import torch

from engram_serve import kernels

lin = kernels.get("linear")
pytestmark = pytest.mark.skipif(lin is None, reason="the linear kernel is not built")
LEVELS = range(lin.simd_level() + 1) if lin is not None else ()


def e2m1(code: int) -> float:
    """sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 subnormal"""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def e8m0(e: int) -> float:
    return math.nan if e == 255 else 2.0 ** (e - 127)


def e4m3(b: int) -> float:
    """sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 NaN, no infinities"""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def bf16(h: int) -> float:
    sign = -1.0 if h & 0x8000 else 1.0
    e, m = (h >> 7) & 255, h & 127
    if e == 255:
        return math.nan if m else sign * math.inf
    return sign * (m / 128 * 2.0 ** -126 if e == 0 else (1 + m / 128) * 2.0 ** (e - 127))


def decode(fmt: int, data: torch.Tensor, n: int, simd: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.empty(n)
    level = lin.decode_formats(fmt, data.data_ptr(), y.data_ptr(), n, simd,
                               scales=0 if scales is None else scales.data_ptr())
    assert level == simd  # the form asked for ran
    return y


def assert_same(got: torch.Tensor, want: list[float]) -> None:
    """bit for bit (float64 values rounded to float32: exact for every representable one), NaN where NaN"""
    w = torch.tensor(want, dtype=torch.float64).float()
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int32) != w.view(torch.int32)) & ~nan
    assert not bad.any(), f"first mismatch at {bad.nonzero()[0].item()}: {got[bad][0]} != {w[bad][0]}"


def nibbles(codes: list[int]) -> torch.Tensor:
    """codes packed two a byte, the lower nibble first"""
    c = torch.tensor(codes, dtype=torch.uint8)
    return (c[0::2] | (c[1::2] << 4)).contiguous()


@pytest.mark.parametrize("simd", LEVELS)
def test_every_e2m1_code_under_every_e8m0_scale(simd):
    codes = list(range(16)) * 2 * 256  # each block of 32 values: every code twice, under scale e
    scales = torch.arange(256, dtype=torch.uint8)
    got = decode(4, nibbles(codes), len(codes), simd, scales)
    assert_same(got, [e2m1(c) * e8m0(i // 32) for i, c in enumerate(codes)])  # (float64 product, then rounded)
    assert_same(decode(0, nibbles(codes[:32]), 32, simd), [e2m1(c) for c in codes[:32]])


@pytest.mark.parametrize("simd", LEVELS)
def test_every_e8m0_code(simd):
    assert_same(decode(1, torch.arange(256, dtype=torch.uint8), 256, simd), [e8m0(e) for e in range(256)])


@pytest.mark.parametrize("simd", LEVELS)
def test_every_e4m3_code(simd):
    assert_same(decode(2, torch.arange(256, dtype=torch.uint8), 256, simd), [e4m3(b) for b in range(256)])
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # torch agrees (NaN codes aside)
    assert_same(want, [e4m3(b) for b in range(256)])


@pytest.mark.parametrize("simd", LEVELS)
def test_every_bf16_code(simd):
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    assert_same(decode(3, h, 65536, simd), [bf16(v) for v in range(65536)])


def test_a_wrong_reference_turns_the_comparison_red():
    """Negative control: the float64 decoder with one E2M1 code wrong (3 as 1.25) fails against the kernel's."""
    codes = list(range(16)) * 2
    wrong = [1.25 if c == 3 else e2m1(c) for c in codes]
    with pytest.raises(AssertionError):
        assert_same(decode(0, nibbles(codes), 32, 0), wrong)
