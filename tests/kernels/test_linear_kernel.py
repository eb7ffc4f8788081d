"""The linear kernel (engram_serve/model/_linear_kernel.c) against its exact definition: `linear_packed` (every
SIMD level, every row count, a weight streamed from memory) against a plain loop in exact rational arithmetic,
the bfloat16 tiles against float64 within float32's bound, the FP8 panels against the float panels bit for bit.
Which product `linear` takes for a weight, and the row rules around it: tests/test_layers.py."""
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.model import exactness
from fp8_tables import fp8_weight


def _round_f32(q: Fraction) -> np.float32:
    """q rounded to the nearest float32, ties to even (q non-zero and in range)."""
    y = np.float32(float(q))  # float() rounds to float64 first: y is within one float32 step of the answer
    near = [np.nextafter(y, np.float32(-np.inf)), y, np.nextafter(y, np.float32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))


def plain_rows(x: np.ndarray, wt: np.ndarray, kc: int) -> np.ndarray:
    """y = x @ wt, the matmul kernel's definition as a plain loop in exact rational arithmetic: per output,
    fma chains (one rounding each) over blocks of kc inputs from 0, the blocks' sums added in order."""
    m, k = x.shape
    y = np.zeros((m, wt.shape[1]), np.float32)
    for i in range(m):
        for j in range(wt.shape[1]):
            total = None
            for k0 in range(0, k, kc):
                acc = np.float32(0)
                for t in range(k0, min(k, k0 + kc)):
                    acc = _round_f32(Fraction(float(x[i, t])) * Fraction(float(wt[t, j])) + Fraction(float(acc)))
                total = acc if total is None else _round_f32(Fraction(float(total)) + Fraction(float(acc)))
            y[i, j] = total
    return y


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 18), st.integers(1, 70), st.integers(1, 80), st.sampled_from([0, 1, 2]), st.data())
def test_matmul_kernel_equals_a_plain_exact_loop_whatever_its_row_count(m, k, n, simd, data):
    """The linear kernel's `linear_packed` (portable tile, AVX2, or AVX-512 panel pairs where the CPU has them)
    against its definition computed in exact arithmetic, with strided rows, partial tiles, odd and partial
    panels, and each row alone, through another tile, against the same row in the call (the kernel's
    batch invariance)."""
    kc = data.draw(st.integers(1, k))
    g = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    x = torch.randn(m, k + 3, generator=g)[:, 1:k + 1]  # rows 3 floats apart beyond k
    wt = torch.randn(k, n + 5, generator=g)[:, :n]
    panels = exactness.pack_panels(wt)
    y = exactness.matmul_kernel(x, panels, n, kc, simd)
    assert np.array_equal(y.numpy().view(np.uint32), plain_rows(x.numpy(), wt.numpy(), kc).view(np.uint32))
    for i in range(m):
        assert torch.equal(exactness.matmul_kernel(x[i:i + 1], panels, n, kc, (simd + 1) % 3), y[i:i + 1])


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_wide_matmul_tiles_give_the_exact_bits(m):
    """The wide tiles (AVX-512 where the CPU has it: 8 panels a row, 4 for two rows, one panel for all of a call of
    7 to 16 rows; AVX2: 4 panels a row, 2 for two rows) and the group remainders after them: every level of the
    kernel against the exact definition, at 9 and 13 panels."""
    g = torch.Generator().manual_seed(m)
    for n in (130, 200):
        x, wt = torch.randn(m, 37, generator=g), torch.randn(37, n, generator=g)
        want = plain_rows(x.numpy(), wt.numpy(), 16).view(np.uint32)
        for simd in (0, 1, 2):
            got = exactness.matmul_kernel(x, exactness.pack_panels(wt), n, 16, simd)
            assert np.array_equal(got.numpy().view(np.uint32), want), (n, simd)


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@pytest.mark.parametrize("m", [1, 6, 11, 16, 23])
def test_a_weight_streamed_from_memory_gets_the_same_bits(m):
    """A weight of 1 MiB or more (a routed expert's at the mid size), which AVX-512 tiles prefetch ahead and a call of
    7 to 16 rows reads in one pass: every level of the kernel gives the bits of AVX2's tiles (which
    `test_wide_matmul_tiles_give_the_exact_bits` holds to the exact definition), row by row as in the call."""
    g = torch.Generator().manual_seed(m)
    x, wt = torch.randn(m, 1100, generator=g), torch.randn(1100, 250, generator=g)  # 1.05 MiB of weights
    panels = exactness.pack_panels(wt)
    want = exactness.matmul_kernel(x, panels, 250, 384, 1)
    for simd in (0, 2):
        assert torch.equal(exactness.matmul_kernel(x, panels, 250, 384, simd), want), simd
    assert torch.equal(exactness.matmul_kernel(x[m // 2:m // 2 + 1], panels, 250, 384, 2), want[m // 2:m // 2 + 1])


TILES = kernels.loaded("linear") and exactness.amx_supported(kernels.get("linear"))


@pytest.mark.skipif(not TILES, reason="the linear kernel's bfloat16 tiles need AMX-BF16")
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 200), st.integers(1, 100), st.data())
def test_bf16_tiles_sum_exact_products_within_float32s_bound_and_a_row_alone(m, k, n, data):
    """`linear_bf16` on a weight whose values are bfloat16: against float64, within the bound of any float32 sum
    of the 3 k exact products of x's three pieces (3 k 2^-24 sum |x w|, a float32 loop's bound for 3 k terms), with
    strided rows, partial tiles (1 to 70 rows: one or two row tiles and the rest), inputs and columns beyond a tile;
    each row alone, and a window of rows, gets the bits it has in the call. A float weight gets no tiles."""
    g = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    x = torch.randn(m, k + 3, generator=g)[:, 1:k + 1]
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).float()
    tiles = exactness.pack_bf16(w.t())
    y = exactness.matmul_bf16(x, tiles, n)
    exact = x.double() @ w.double().t()
    bound = 3 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert ((y.double() - exact).abs() <= bound).all()
    for i in sorted({0, m // 2, m - 1}):
        assert torch.equal(exactness.matmul_bf16(x[i:i + 1], tiles, n), y[i:i + 1])
    a = data.draw(st.integers(0, m - 1))
    b = data.draw(st.integers(a + 1, m))
    assert torch.equal(exactness.matmul_bf16(x[a:b], tiles, n), y[a:b])
    assert exactness.pack_bf16(torch.randn(k, n, generator=g) + 1) is None


@pytest.mark.skipif(not (kernels.loaded("linear") and exactness.fp8_supported(kernels.get("linear"))),
                    reason="the linear kernel's FP8 panels need AVX-512")
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 200), st.integers(1, 150), st.sampled_from([64, 128]), st.data())
def test_fp8_panels_give_the_float_kernels_bits(m, k, n, block, data):
    """An FP8 block-scaled weight's FP8 panels (`pack_fp8`: a quarter of the bytes) rebuild its float32 weights
    exactly: `matmul_fp8` equals the float kernel and the exact definition bit for bit, with partial panels and
    scale blocks, zeros and subnormals; a float weight that is not FP8 gets no FP8 panels. (Checkpoint blocks of 64
    and 128 inputs hold each panel's block of 64 inputs whole; with blocks of 32 its two halves may have scales no
    one power of two serves, and `pack_fp8` then gives none: the float panels run.)"""
    kc = data.draw(st.integers(1, k))
    w = fp8_weight(n, k, block, m * 1000 + k * 7 + n)
    fp8 = exactness.pack_fp8(w.t())
    assert fp8 is not None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    want = exactness.matmul_kernel(x, exactness.pack_panels(w.t()), n, kc)
    assert torch.equal(exactness.matmul_fp8(x, fp8, n, kc).view(torch.int32), want.view(torch.int32))
    assert np.array_equal(want.numpy().view(np.uint32), plain_rows(x.numpy(), w.t().numpy(), kc).view(np.uint32))
    assert exactness.pack_fp8(torch.randn(k, n) + 1) is None
