"""Weights as stored on an AMX CPU's tiles (`matmul_stored` format | AMX, `moe_experts` stored_tiles): every block of
32 inputs decoded into the very bfloat16 tiles `pack_bf16` makes of the dequantized weight, so the bits of
`matmul_bf16` over them, for every format, row count and layout (rows as stored, their panel-major words)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.engram.quantized import FP4_VALUES
from engram_serve.model import exactness
from engram_serve.model.exactness import AMX, STORED_BF16, STORED_FP8, STORED_MXFP4, TILE_SCALES, TILED, WORDS
from engram_serve.model.weights import StoredWeight

from test_linear_kernel_formats import (bits, fp8_float, fp8_weight, mxfp4_float, mxfp4_weight, same_bits,
                                         wide_inputs)

lin = kernels.get("linear")
pytestmark = pytest.mark.skipif(not exactness.amx_supported(lin), reason="no AMX-BF16 on this CPU (or no kernel)")


def tiles_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """the float plan's product on an AMX CPU: `matmul_bf16` over `pack_bf16` of the dequantized weight"""
    tiles = exactness.pack_bf16(w.t().contiguous())
    assert tiles is not None  # every value a bfloat16
    return exactness.matmul_bf16(x, tiles, w.shape[0])


def inputs(m: int, k: int, seed: int, wide: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    return wide_inputs(x, g) if wide else x


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([32, 64, 96, 160, 512]), n=st.integers(1, 70),
       seed=st.integers(0, 2**16), wide=st.booleans())
def test_stored_mxfp4_on_the_tiles_gives_the_bfloat16_tiles_bits(m, k, n, seed, wide):
    lo, hi = TILE_SCALES[STORED_MXFP4]
    codes, scales = mxfp4_weight(n, k, seed, lo=lo if seed % 3 == 0 else 100, hi=hi if seed % 3 == 0 else 150)
    x = inputs(m, k, seed, wide)
    want = tiles_product(x, mxfp4_float(codes, scales))
    assert same_bits(exactness.matmul_stored(x, STORED_MXFP4 | AMX, codes, scales, n, 8), want)
    words = exactness.panel_words(codes, fp8=False)
    assert same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX, words, scales, n, 8), want)
    tiled = exactness.panel_words(codes, fp8=False, tiled=True)  # the model's form here
    assert same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX | TILED, tiled, scales, n, 8), want)
    if seed % 3 and codes.any():  # negative control (finite scales): the same bytes read as plain words differ
        x = inputs(m, k, seed, False)
        assert not same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX, tiled, scales, n, 8),
                             tiles_product(x, mxfp4_float(codes, scales)))


@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([16, 36, 64, 200, 512]), n=st.integers(1, 70),
       block=st.sampled_from([16, 32, 128]), seed=st.integers(0, 2**16), wide=st.booleans())
def test_stored_fp8_on_the_tiles_gives_the_bfloat16_tiles_bits(m, k, n, block, seed, wide):
    """words (the model's form: blocks of one scale take the lookup tables, of two the float decode, as does a
    last block of fewer than 32 inputs) and rows as stored (the float decode)"""
    q, s = fp8_weight(n, k, block, seed)
    if seed % 3 == 0:  # the admitted extremes
        s = torch.where(s < 120, *(torch.tensor(v, dtype=torch.uint8) for v in TILE_SCALES[STORED_FP8]))
    x = inputs(m, k, seed, wide)
    want = tiles_product(x, fp8_float(q, s, block))
    words = exactness.panel_words(q, fp8=True)
    assert same_bits(exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX, words, s, n, 8, block=block), want)
    assert same_bits(exactness.matmul_stored(x, STORED_FP8 | AMX, q, s, n, 8, block=block), want)
    if exactness.tiled_words(STORED_FP8, k, block):  # the model's form here: the words in the tiles' order
        tiled = exactness.panel_words(q, fp8=True, tiled=True)
        got = exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX | TILED, tiled, s, n, 8, block=block)
        assert same_bits(got, want)
        if seed % 3 and q.any():  # negative control (finite scales): the same bytes read as plain words differ
            x = inputs(m, k, seed, False)
            other = exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX, tiled, s, n, 8, block=block)
            assert not same_bits(other, tiles_product(x, fp8_float(q, s, block)))


@pytest.mark.parametrize("fp8", [True, False])
def test_tiled_words_put_each_code_where_the_tiles_decode_it(fp8):
    """the layout `WF_TILED` names, written out. In each panel's block of 32 inputs, tile row v pairs inputs v and
    v + 16: its element e is column e // 2's input v (e even) or v + 16 (e odd). FP8: 64-byte load q holds tile
    rows 2q and 2q + 1, byte p of it element 8 (p // 16) + p % 8 of row 2q + p % 16 // 8. MXFP4: 32-byte load q holds
    in byte e row 2q's code of element e (the lower nibble) and row 2q + 1's."""
    n, k = 40, 96
    q = torch.randint(0, 127, (n, k if fp8 else k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    size = 64 if fp8 else 32
    tiled = exactness.panel_words(q, fp8=fp8, tiled=True).view(-1, k // 32, 8, size)
    words = exactness.panel_words(q, fp8=fp8)
    assert torch.equal(tiled.view(-1).sort().values, words.view(-1).sort().values)  # a permutation
    code = (lambda c, t: int(q[c, t])) if fp8 else (lambda c, t: int(q[c, t // 2]) >> 4 * (t % 2) & 15)
    for p in range(tiled.shape[0]):
        for b in range(k // 32):
            for load in range(8):
                for byte in range(size):
                    rows = [2 * load + byte % 16 // 8] if fp8 else [2 * load, 2 * load + 1]
                    e = 8 * (byte // 16) + byte % 8 if fp8 else byte
                    col, ts = 16 * p + e // 2, [32 * b + row + 16 * (e % 2) for row in rows]
                    want = sum(code(col, t) << 4 * i for i, t in enumerate(ts)) if col < n else 0
                    assert tiled[p, b, load, byte] == want


def test_tiled_words_are_refused_where_a_block_of_the_tiles_is_not_whole_or_one_scale():
    q, s = fp8_weight(32, 64, 16, 0)
    tiled = exactness.panel_words(q, fp8=True, tiled=True)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="32: tiled words"):
        exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX | TILED, tiled, s, 32, 8, block=16)
    with pytest.raises(ValueError, match="tiled"):
        exactness.panel_words(torch.zeros(16, 48, dtype=torch.uint8), fp8=True, tiled=True)
    with pytest.raises(ValueError, match="tiled"):
        exactness.panel_words(torch.zeros(16, 24, dtype=torch.uint8), fp8=False, tiled=True)
    with pytest.raises(ValueError, match="tiled"):  # BF16: 16 inputs a row
        exactness.panel_words(torch.zeros(16, 32, dtype=torch.uint8), fp8=False, tiled=True, bf16=True)
    with pytest.raises(ValueError, match="32: tiled words"):
        exactness.matmul_stored(torch.randn(1, 48), STORED_BF16 | WORDS | AMX | TILED,
                                torch.zeros(1, 24, 16, 4, dtype=torch.uint8), None, 16, 8)


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-60, 60, (n, k), generator=g).float())).bfloat16()


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([2, 6, 32, 200, 512]), n=st.integers(1, 70),
       seed=st.integers(0, 2**16))
def test_stored_bf16_on_the_tiles_gives_the_bfloat16_tiles_bits(m, k, n, seed):
    """rows as stored, their words, and (k a multiple of 32: the model's form here) the words in the tiles' order,
    whose blocks the tile loads read in place"""
    w = bf16_weight(n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    want = tiles_product(x, w.float())
    assert same_bits(exactness.matmul_stored(x, STORED_BF16 | AMX, w, None, n, 8), want)
    words = exactness.panel_words(w.view(torch.uint8), fp8=False)
    assert same_bits(exactness.matmul_stored(x, STORED_BF16 | WORDS | AMX, words, None, n, 8), want)
    assert exactness.tiled_words(STORED_BF16, k) == (k % 32 == 0)
    if k % 32 == 0:
        tiled = exactness.panel_words(w.view(torch.uint8), fp8=False, tiled=True, bf16=True)
        assert same_bits(exactness.matmul_stored(x, STORED_BF16 | WORDS | AMX | TILED, tiled, None, n, 8), want)
        if w.float().abs().sum() > 0:  # negative control: the same bytes read as plain words differ
            assert not same_bits(exactness.matmul_stored(x, STORED_BF16 | WORDS | AMX, tiled, None, n, 8), want)


def test_bf16_tiled_words_are_the_tiles_themselves():
    """BF16's `WF_TILED` layout written out: each panel's block of 32 inputs is its bfloat16 tile, row v pairing
    inputs v and v + 16 (element e: column e // 2's input v + 16 (e % 2)), as `pack_bf16` lays out a pair's panel"""
    n, k = 40, 96
    w = bf16_weight(n, k, 0)
    tiled = exactness.panel_words(w.view(torch.uint8), fp8=False, tiled=True, bf16=True)
    got = tiled.view(torch.int16).view(-1, k // 32, 16, 32)
    rows = torch.nn.functional.pad(w.view(torch.int16), (0, 0, 0, got.shape[0] * 16 - n))  # zero rows beyond n
    v, e = torch.arange(16)[:, None], torch.arange(32)[None, :]
    for p in range(got.shape[0]):
        for b in range(k // 32):
            assert torch.equal(got[p, b], rows[16 * p + e // 2, 32 * b + v + 16 * (e % 2)])
    packed = exactness.pack_bf16(w.float().t().contiguous()).view(-1, k // 32, 16, 32)
    assert torch.equal(got, packed[:got.shape[0]])


@pytest.mark.parametrize("m,k", [(33, 4096), (100, 4096), (300, 512)])
def test_rows_split_a_group_at_a_time_give_the_bfloat16_tiles_bits(m, k):
    """More rows than one L2 group of split rows (a group: 32 rows at 4,096 inputs, 256 at 512): each column pair
    decoded once a group, every group's products the same bits"""
    q, s = fp8_weight(40, k, 128, m)
    codes, scales = mxfp4_weight(40, k, m)
    x = inputs(m, k, m, wide=True)
    b = bf16_weight(40, k, m)
    for fmt, data, sc, w in ((STORED_FP8, q, s, fp8_float(q, s, 128)),
                             (STORED_MXFP4, codes, scales, mxfp4_float(codes, scales)),
                             (STORED_BF16, b.view(torch.uint8), None, b.float())):
        for tiled in (False, True):
            words = exactness.panel_words(data, fp8=fmt == STORED_FP8, tiled=tiled, bf16=fmt == STORED_BF16)
            got = exactness.matmul_stored(x, fmt | WORDS | AMX | (TILED if tiled else 0), words, sc, 40, 8, block=128)
            assert same_bits(got, tiles_product(x, w))


@pytest.mark.parametrize("r0,r1", [(16, 48), (32, 70), (48, 53)])
def test_rows_of_a_stored_fp8_weight_on_the_tiles_give_their_bits(r0, r1):
    q, s = fp8_weight(70, 64, 32, 3)
    part = StoredWeight(STORED_FP8, [(q, s, 0)], 32, [exactness.panel_words(q, fp8=True)]).rows(r0, r1)
    ((_, sc, row0),), (words,) = part.parts, part.words
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(r0))
    got = exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX, words, sc, r1 - r0, 8, block=32, row0=row0)
    want = tiles_product(x, fp8_float(q, s, 32)[r0:r1])
    assert torch.equal(bits(got), bits(want))
    tiled = StoredWeight(STORED_FP8, [(q, s, 0)], 32, [exactness.panel_words(q, fp8=True, tiled=True)]).rows(r0, r1)
    got = exactness.matmul_stored(x, STORED_FP8 | WORDS | AMX | TILED, tiled.words[0], sc, r1 - r0, 8, block=32,
                                  row0=row0)
    assert torch.equal(bits(got), bits(want))
    w = bf16_weight(70, 64, r0)  # BF16 tiled words: each panel's tiles whole, any pair of them read in place
    words = exactness.panel_words(w.view(torch.uint8), fp8=False, tiled=True, bf16=True)
    part = StoredWeight(STORED_BF16, [(w, None, 0)], words=[words]).rows(r0, r1)
    got = exactness.matmul_stored(x, STORED_BF16 | WORDS | AMX | TILED, part.words[0], None, r1 - r0, 8)
    assert torch.equal(bits(got), bits(tiles_product(x, w.float()[r0:r1])))


@pytest.mark.parametrize("d,inter,experts,words,tiled", [(64, 32, 3, False, False), (96, 64, 4, True, False),
                                                         (96, 64, 4, True, True)])
def test_moe_experts_as_stored_on_the_tiles_equal_them_on_bfloat16_tiles(d, inter, experts, words, tiled):
    g = torch.Generator().manual_seed(d + inter)
    w1, w3 = ([mxfp4_weight(inter, d, 10 * e + j) for e in range(experts)] for j in (0, 2))
    w2 = [mxfp4_weight(d, inter, 10 * e + 1) for e in range(experts)]
    counts = torch.tensor([5, 0, 17, 1][:experts], dtype=torch.int64)
    xs = torch.randn(int(counts.sum()), d, generator=g)
    tiles13 = [exactness.pack_bf16(torch.cat([mxfp4_float(*a), mxfp4_float(*b)]).t().contiguous())
               for a, b in zip(w1, w3)]
    tiles2 = [exactness.pack_bf16(mxfp4_float(*w).t().contiguous()) for w in w2]
    addr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    want = exactness.moe_experts(xs, counts, addr(tiles13), 1, addr(tiles2), 1, inter, 7.0, tiles=True)
    codes = [[exactness.panel_words(c, fp8=False, tiled=tiled) if words else c for c, _ in w] for w in (w1, w3, w2)]
    stored = (addr([s for _, s in w1]), addr(codes[1]), addr([s for _, s in w3]), addr([s for _, s in w2]))
    got = exactness.moe_experts(xs, counts, addr(codes[0]), 8, addr(codes[2]), 8, inter, 7.0, stored=stored,
                                words=words, stored_tiles=True, tiled=tiled)
    assert torch.equal(bits(got), bits(want))


def test_the_admitted_scales_are_the_ones_the_decode_keeps_exact():
    """Negative control of `tiles_admit`: a scale below TILE_SCALES (E8M0 0, 2^-127: 0.5 of it a subnormal) is
    added to the exponent field by the decode all the same, which wraps around (-infinity's bits), and the products
    differ; the admission turns such a weight down. (The panel-major words' decode: the rows as stored take the
    float decode, exact for every scale.)"""
    codes, scales = mxfp4_weight(32, 64, 7)
    words = exactness.panel_words(codes, fp8=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    scales[:, 0] = TILE_SCALES[STORED_MXFP4][0]
    assert exactness.tiles_admit(STORED_MXFP4, 32, [scales], True)
    assert same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX, words, scales, 32, 8),
                     tiles_product(x, mxfp4_float(codes, scales)))
    scales[:, 0] = 0
    assert not exactness.tiles_admit(STORED_MXFP4, 32, [scales], True)
    assert not same_bits(exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX, words, scales, 32, 8),
                         tiles_product(x, mxfp4_float(codes, scales)))


def test_a_reference_with_one_e2m1_code_wrong_differs_on_the_tiles():
    """Negative control of the comparison above: the tiles of a weight dequantized with code 3 as 1.25 (not 1.5)
    are not the stored product's bits."""
    codes, scales = mxfp4_weight(32, 64, 5)
    x = torch.randn(3, 64)
    wrong = tuple(1.25 if i == 3 else v for i, v in enumerate(FP4_VALUES))
    words = exactness.panel_words(codes, fp8=False)
    got = exactness.matmul_stored(x, STORED_MXFP4 | WORDS | AMX, words, scales, 32, 8)
    assert torch.equal(bits(got), bits(tiles_product(x, mxfp4_float(codes, scales))))
    assert not torch.equal(bits(got), bits(tiles_product(x, mxfp4_float(codes, scales, wrong))))
