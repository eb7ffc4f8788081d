"""Row invariance of the forward's matmuls and elementwise ops (docs/contract.md §9): the rules, their probes, and
the switch that turns them off. docs/exactness.md lists every exactness rule of the project, with the
test that proves it and its negative control; the other rules live beside their kernels.

Matmuls. On CPU, torch's float32 matmul (MKL sgemm) computes a call of few rows with small-matrix
kernels and a bigger call with its blocked kernel, and they round differently, so a row's bits would
depend on how many rows share its call. Where the switch lies depends on the CPU and on the weight's
memory layout: with the usual [out, in] row-major weight it is 4 rows on an AVX2 machine and 6 to 16
rows (growing with `in`) on an AVX-512 one; with the weight laid out input-major (`in_major`: W.T
contiguous, so MKL reads it untransposed) only a 1-row call differs there. The model's matmul weights
are laid out input-major (layers.py `layout_weights_`, once at load), and every matmul of the forward
goes through layers.py `linear`, which runs the product model/products.py `plan` makes from these
rules. Where a probe shows that the C kernel (the
linear kernel of engram_serve/kernels.py) gives MKL's bits for this shape (`small_call_kc`: it computes
the blocked kernel's accumulation order, fma chains over blocks of `kc` inputs, the blocks then
added), every call goes to it: it computes each row by the same operations whatever the call's size,
so no call pads. Elsewhere (another BLAS, the kernel not loaded, autograd) a call of fewer than
`min_rows(weight)` rows is padded with zero rows. Both are measured once per shape and layout in the
process (`first_invariant_rows`: the smallest row count from which every probed call gives each row
the bits of a PROBE_REF-row call). Padding keeps a row's place in its call, so it cannot help where MKL
gives a row other bits at another place (`position_dependent`: seen for input-major weights of 5 to 7 and
9 to 11 outputs on an AVX2 CPU, whose every fourth row is summed in another order): such a weight is
multiplied by `rowwise_linear`, which computes every row by the same operations wherever it sits. Any
other weight the kernel does not serve (few outputs: a 4-expert router) goes, in calls of at least
min_rows rows, to torch's own sgemm called directly (`blas_linear`, where `blas_matches` probes that it
gives torch's bits): the same numbers as F.linear, as a kernel call a CPU graph can replay. The
attention and indexer's torch forms use fixed per-item shapes (`KEY_CHUNK` keys a bmm item). The runner
pads a small microbatch once to the row count the model's matmuls still need (model/products.py `pad_rows`: 1 where the
kernel serves every weight), so that within a step only the sampled rows' logits call may still pad.
tests/test_layers.py sweeps the rule.

Elementwise ops. torch's CPU loops run the vectorised form of an op over whole vectors and a scalar
form over the tail of the call, and for sigmoid and silu the two differ in the last bit. Rule:
`pointwise` pads the flat input to a multiple of VEC_PAD elements, so every element takes the
vectorised path whatever the call's size (with one intra-op thread; see the runner). The C forms
(model/ops_c.py) have no tail: they compute each token alone.

bfloat16 weights. On a CPU with AMX-BF16, a weight whose every value is a bfloat16 (`pack_bf16`: FP8 block-scaled
weights rebuilt, a BF16 checkpoint's matrices) is multiplied by the linear kernel's `linear_bf16` in every call,
whatever its rows: each input split exactly in three bfloat16 pieces, the tile unit's products exact, the sums in
float32, each row of a tile computed alone. Not MKL's bits, but the same for a row in any call.

`batch_invariant(False)` turns these rules off (min_rows, the C matmul, VEC_PAD): the fastest
non-exact configuration for benchmarks, and the negative control of the bit-exactness tests.
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .. import kernels
from . import capture

MIN_ROWS = 4  # the rule off the CPU (not measured there)
PROBE_REF, PROBE_MAX = 512, 96
PANEL = 16  # columns per packed panel of the linear kernel
FP8_BLOCK = 64  # input rows per scale of an FP8 panel (the kernel's SB)
AMX_K = 32  # inputs per bfloat16 tile row of the linear kernel (`pack_bf16`)
FP8_ROWS = 1  # calls of at most this many rows read a weight's FP8 panels where it has them
fp8_check = True  # a protection a test turns off (negative control): FP8 panels only for weights they give exactly
bf16_check = True  # the same for bfloat16 tiles (`pack_bf16`)
VEC_PAD = 64
_exact = True  # the rules of this module are on; `batch_invariant(False)` turns them off
_min_rows: dict[tuple, int] = {}


@contextmanager
def batch_invariant(enabled: bool):
    """Run the block with the batch-invariance rules (min_rows, the C matmul, VEC_PAD) on or off."""
    global _exact
    before, _exact = _exact, enabled
    try:
        yield
    finally:
        _exact = before


def rules_on() -> bool:
    """Whether the rules of this module are on (see `batch_invariant`)."""
    return _exact


def in_major(t: torch.Tensor, n_in: int = 1) -> torch.Tensor:
    """t, same shape and values, laid out with its last `n_in` (input) dims outermost in memory: as a
    matrix [out, in] its transpose is contiguous. A copy unless t is laid out so already."""
    d = t.dim()
    order = [*range(d - n_in, d), *range(d - n_in)]
    p = t.permute(order)
    return t if p.is_contiguous() else p.contiguous().permute([order.index(i) for i in range(d)])


def first_invariant_rows(fn, rows: torch.Tensor) -> int:
    """The smallest row count m such that fn over the first n rows, for every probed n >= m (1..PROBE_MAX,
    and a few up to PROBE_REF), gives each row the bits of fn over all PROBE_REF `rows`."""
    with torch.no_grad():
        full = fn(rows)
        sizes = [*range(1, PROBE_MAX + 1), 127, 128, 129, 255, 256, 257, PROBE_REF - 1]
        bad = [n for n in sizes if not torch.equal(fn(rows[:n]), full[:n])]
    return bad[-1] + 1 if bad else 1


def _probe(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def min_rows(weight: torch.Tensor) -> int:
    """Rows a call of `linear` with this weight is padded to (rule above), measured once per shape and
    layout (kernel choice depends on shapes, layout and threads, not on values)."""
    if weight.device.type != "cpu":
        return MIN_ROWS
    out_f, in_f = weight.shape
    input_major = weight.stride(0) == 1 and out_f > 1
    key = ("linear", in_f, out_f, weight.dtype, input_major, torch.get_num_threads())
    if key not in _min_rows:
        w = _probe(out_f, in_f, dtype=weight.dtype)
        w = in_major(w) if input_major else w
        _min_rows[key] = first_invariant_rows(lambda x: F.linear(x, w), _probe(PROBE_REF, in_f, dtype=weight.dtype, seed=1))
    return _min_rows[key]


POSITION_SHIFTS, POSITION_SIZES = (1, 2, 3, 5, 7, 13), (128, 129, 255)


def position_dependent(weight: torch.Tensor) -> bool:
    """Whether `F.linear` with this weight's shape and layout gives a row other bits when the row sits at
    another place of its call: windows rows[s:s + n] of a probe (row i of the full call at place i - s)
    against the full call, all bigger than any call the row rule pads (so only the place differs).
    Measured once per shape and layout, like `min_rows`."""
    if weight.device.type != "cpu":
        return False
    out_f, in_f = weight.shape
    input_major = weight.stride(0) == 1 and out_f > 1
    key = ("position", in_f, out_f, weight.dtype, input_major, torch.get_num_threads())
    if key not in _min_rows:
        w = _probe(out_f, in_f, dtype=weight.dtype)
        w = in_major(w) if input_major else w
        x = _probe(PROBE_REF, in_f, dtype=weight.dtype, seed=1)
        with torch.no_grad():
            full = F.linear(x, w)
            _min_rows[key] = any(not torch.equal(F.linear(x[s:s + n], w), full[s:s + n])
                                 for s in POSITION_SHIFTS for n in POSITION_SIZES)
    return _min_rows[key]


def rowwise_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 [N, in] @ weight.T as products summed over `in`: each row by the same operations wherever it sits
    in the call (the reduction of one output depends on `in` alone). [N, out, in] of memory: for the narrow
    weights of `position_dependent`."""
    return (x2[:, None, :] * weight[None, :, :]).sum(-1)


def small_call_kc(weight: torch.Tensor) -> int | None:
    """The block size kc for which the linear kernel gives every call of this weight the bits of a batch
    (rule above), or None: the kernel not loaded (engram_serve/kernels.py), not a float32 CPU weight laid
    out input-major, or no probed kc matches (the inputs in 1 to 4 equal blocks, or blocks of any multiple
    of 16: MKL on an AVX-512 Xeon splits 512 inputs in two halves, on an AMD EPYC into blocks of 192).
    Measured once per shape, like `min_rows`."""
    if not kernels.loaded("linear") or weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or weight.stride(0) != 1 or weight.shape[0] < 2:
        return None
    out_f, in_f = weight.shape
    key = ("kc", in_f, out_f, torch.get_num_threads())
    if key not in _min_rows:
        w, x = in_major(_probe(out_f, in_f)), _probe(PROBE_REF, in_f, seed=1)
        m = min(min_rows(weight), PROBE_MAX)
        with torch.no_grad():
            full = F.linear(x, w)
        panels = pack_panels(w.t())
        candidates = dict.fromkeys([*(-(-in_f // b) for b in range(1, 5)), *range(16, in_f, 16)])
        kc = next((kc for kc in candidates if torch.equal(matmul_kernel(x[:m], panels, out_f, kc), full[:m])), None)
        _min_rows[key] = kc if kc is not None and torch.equal(matmul_kernel(x, panels, out_f, kc), full) else None
    return _min_rows[key]


@functools.cache
def sgemm_address() -> int | None:
    """The address of the BLAS `sgemm_` that torch's CPU matmul calls (MKL, linked into libtorch_cpu), or None
    where that library or symbol is not found (another build): `blas_linear` then never runs. Once a process."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def blas_matches(weight: torch.Tensor) -> bool:
    """Whether `blas_linear` gives `F.linear`'s bits for this weight's shape (float32, its transpose contiguous): the
    linear kernel loaded, torch's sgemm found, and equal bits on probes of 1 to PROBE_REF rows. Where no fixed-order
    kernel reproduces MKL (`small_call_kc` None: a weight of few outputs), calling the same sgemm with the same
    arguments as torch gives torch's bits without its dispatch (~8 us a call at one row, against ~1 us).
    Measured once per shape, like `min_rows`."""
    if not kernels.loaded("linear") or sgemm_address() is None or weight.device.type != "cpu" \
            or weight.dtype != torch.float32 or weight.shape[0] < 2 or weight.stride() != (1, weight.shape[0]):
        return False  # (the call reads weight.T as one contiguous [in, out] matrix)
    out_f, in_f = weight.shape
    key = ("blas", in_f, out_f, torch.get_num_threads())
    if key not in _min_rows:
        w, x = in_major(_probe(out_f, in_f)), _probe(PROBE_REF, in_f, seed=1)
        with torch.no_grad():
            _min_rows[key] = all(torch.equal(blas_linear(x[:n], w), F.linear(x[:n], w))
                                 for n in (1, 2, 3, 4, 5, 8, 13, 64, 129, PROBE_REF))
    return _min_rows[key]


def blas_takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `blas_linear` computes x2 [N, in] @ weight.T: contiguous float32 CPU rows, at least one, outside
    autograd (`blas_matches` checked the weight)."""
    return (x2.is_cpu and x2.dtype == torch.float32 and x2.shape[0] > 0 and x2.is_contiguous()
            and not (torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad)))


def blas_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 [m, in] @ weight.T by torch's sgemm, called directly (the linear kernel's `blas_mm`): a recordable kernel
    call. The caller checked `blas_matches` and `blas_takes`."""
    m, k = x2.shape
    y = torch.empty(m, weight.shape[0])
    capture.call(kernels.get("linear").blas_mm, sgemm=sgemm_address(), x=x2.data_ptr(), wt=weight.data_ptr(),
                 y=y.data_ptr(), m=m, k=k, n=weight.shape[0])
    return y


def pack_panels(wt: torch.Tensor) -> torch.Tensor:
    """wt [in, out] as the linear kernel's panels: [ceil(out / 16), in, 16] float32, zero beyond out."""
    k, n = wt.shape
    p = -(-n // PANEL)
    return F.pad(wt.float(), (0, p * PANEL - n)).view(k, p, PANEL).permute(1, 0, 2).contiguous()


def pack_fp8(wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """wt [in, out] as FP8 panels, where every weight is an E4M3 value times one power of two per panel and block
    of FP8_BLOCK inputs (what an FP8 block-scaled checkpoint's weights are): (E4M3 bytes [ceil(out / 16), in,
    16] uint8, scales [ceil(out / 16), ceil(in / FP8_BLOCK)] float32, each 2^(s + 8) for the kernel), from
    which the linear kernel's `linear_fp8` rebuilds the float32 weights exactly. None for any other weight (the
    check is bit for bit)."""
    panels = pack_panels(wt)  # [P, k, 16]
    p, k, _ = panels.shape
    blocks = -(-k // FP8_BLOCK)
    tiles = F.pad(panels, (0, 0, 0, blocks * FP8_BLOCK - k)).view(p, blocks, FP8_BLOCK, PANEL)
    amax = tiles.abs().amax(dim=(2, 3)).double()
    if not torch.isfinite(amax).all():
        return None
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448)), torch.zeros_like(amax))
    e = e + (amax / torch.exp2(e) > 448)  # the smallest power of two that brings the block within E4M3's range
    if e.min() < -134 or e.max() > 119:  # 2^(s + 8) must be a normal float32
        return None
    scale = torch.exp2(e).float()[:, :, None, None]
    q = (tiles / scale).to(torch.float8_e4m3fn)
    if fp8_check and not torch.equal((q.float() * scale).view(torch.int32), tiles.view(torch.int32)):
        return None
    q = q.view(torch.uint8).reshape(p, blocks * FP8_BLOCK, PANEL)[:, :k].contiguous()
    return q, torch.exp2(e + 8).float().contiguous()


MX_BLOCK = 32  # inputs per E8M0 scale of an MXFP4 weight
STORED_MXFP4, STORED_FP8, STORED_BF16 = 2, 4, 5  # the linear kernel's `linear_stored` formats (moe_experts': MXFP4)
WORDS = 8  # the flag of a stored format whose rows are repacked panel-major (`panel_words`)
AMX = 16  # the flag of a stored format multiplied on the AMX tiles (`tiles_admit`)
TILED = 32  # the flag of FP8, MXFP4 or BF16 words whose blocks of 32 inputs are in the tiles' order (`tiled_words`)
# the E8M0 scales (inclusive) that keep every nonzero value of a format times its scale a normal, finite bfloat16
TILE_SCALES = {STORED_MXFP4: (2, 252), STORED_FP8: (10, 246)}


def tiles_admit(fmt: int, outputs: int, scales: Iterable[torch.Tensor], words: bool) -> bool:
    """Whether a stored weight is multiplied on an AMX CPU's bfloat16 tiles as stored (`matmul_stored` format | AMX):
    the kernel decodes each block of 32 inputs of 32 outputs into the very tiles `pack_bf16` makes of the dequantized
    weight (so the same bits as the float plan there, the bfloat16 tiles), adding each E8M0 scale to the values'
    exponent field. So every scale must keep the values normal and finite (`TILE_SCALES`; BF16 has none), an FP8
    weight comes from its words (no NaN code), and, as with the float panels, it has at least a panel's 16 outputs.
    The caller asks where `amx_supported` and the rules are on."""
    if outputs < PANEL or (fmt == STORED_FP8 and not words):
        return False
    if fmt == STORED_BF16:
        return True
    lo, hi = TILE_SCALES[fmt]
    return all(s.numel() == 0 or (lo <= int((u := s.view(torch.uint8)).min()) and int(u.max()) <= hi)
               for s in scales)


def on_tiles() -> bool:
    """Whether stored weights go to the AMX tiles here (`tiles_admit`): an AMX CPU, the rules on."""
    return rules_on() and amx_supported(kernels.get("linear"))


def repacks(outputs: int) -> bool:
    """Whether the loader repacks a stored weight of `outputs` rows (`panel_words`): where the linear kernel would
    multiply it as stored by its shape alone (the float panels, or an AMX CPU's tiles; at least a panel's 16
    outputs), as memory_plan.py counts it, without the probes of `stored_kc` or the scales of `tiles_admit` (which
    decide; a weight they turn down keeps its words unused)."""
    return kernels.get("linear") is not None and outputs >= PANEL


def tiled_words(fmt: int, k: int = 0, block: int = 0) -> bool:
    """Whether a stored weight's words are repacked in the tiles' order (`panel_words(..., tiled=True)`, multiplied
    as `matmul_stored` format | WORDS | AMX | TILED, `moe_experts` tiled): on an AMX CPU, an MXFP4 weight, an FP8
    one whose k and scales' block are multiples of 32 (every block of the tiles has one scale), or a BF16 one whose
    k is. Its blocks' codes then reach the tiles without a permutation (one row: ~1.4x on FP8, ~1.3x on MXFP4), and
    BF16's blocks are the tiles, loaded where they lie."""
    fits = fmt == STORED_MXFP4 or k % AMX_K == 0 and (fmt == STORED_BF16 or fmt == STORED_FP8 and block % AMX_K == 0)
    return fits and amx_supported(kernels.get("linear"))


def panel_words(data: torch.Tensor, fp8: bool, tiled: bool = False, bf16: bool = False) -> torch.Tensor | None:
    """Stored rows [n, k] (uint8, contiguous: FP8 codes, MXFP4's packed E2M1, BF16's bytes) repacked panel-major for
    the kernel's WORDS formats (`matmul_stored` fmt | WORDS, `moe_experts` words=True): [ceil(n / 16), k / 4, 16, 4]
    uint8, each row's 4-byte words intact and a panel's 16 rows side by side, zero rows beyond n. A permutation of
    the bytes (so the same products, bit for bit) from which the kernel reads the 16 rows' word at an input with one
    load instead of a transpose. None where k is not a multiple of 4, `fp8` and a code is NaN (that format's decode
    leaves the NaN test out), or the kernel is not built. One pass in C. `tiled` (`tiled_words`): each block of 32
    inputs of a panel further permuted into the tiles' order of FP8 (`fp8`), BF16 (`bf16`: two bytes an input) or
    MXFP4."""
    lin, (n, k) = kernels.get("linear"), data.shape
    if lin is None or k % 4 or not data.is_contiguous():
        return None
    words = torch.empty(-(-n // PANEL), k // 4, PANEL, 4, dtype=torch.uint8)
    done = lin.panel_words(data=data.data_ptr(), words=words.data_ptr(), n=n, k=k, fp8=fp8, tiled=tiled, bf16=bf16)
    return words if done else None


def stored_kc_fits(fmt: int, k: int, kc: int) -> bool:
    """Whether `linear_stored` takes a weight of k inputs of this format at block size kc (MXFP4: k a multiple of
    32, kc of 8; FP8: both of 4; BF16: both even)."""
    fmt &= ~WORDS  # (the rows panel-major: the same)
    if fmt == STORED_MXFP4:
        return k % MX_BLOCK == 0 and kc % 8 == 0
    return k % 4 == 0 and kc % 4 == 0 if fmt == STORED_FP8 else k % 2 == 0 and kc % 2 == 0


def shape_only(out: int, k: int) -> torch.Tensor:
    """A float32 CPU view of shape [out, k] laid out input-major over `out` floats (every input alike): what the
    probes of `small_call_kc` and `min_rows` read of a weight (its shape, layout and dtype, never its values)."""
    view = _shape_views.get((out, k))
    if view is None:  # (made once: a CPU graph would otherwise record a zeros per product)
        view = _shape_views[(out, k)] = torch.zeros(out).as_strided((out, k), (1, 0))
    return view


_shape_views: dict[tuple[int, int], torch.Tensor] = {}


def stored_kc(fmt: int, out: int, k: int) -> int | None:
    """The block size at which `linear_stored` multiplies a weight of this shape as stored with the float path's
    bits, or None: the float plan's kc (`small_call_kc`) where that plan is the float panels (on an AMX CPU it is the
    bfloat16 tiles, every FP8 and MXFP4 value being a bfloat16) and `stored_kc_fits`."""
    if amx_supported(kernels.get("linear")):
        return None
    kc = small_call_kc(shape_only(out, k))
    return kc if kc is not None and stored_kc_fits(fmt, k, kc) else None


def matmul_stored(x: torch.Tensor, fmt: int, data: torch.Tensor, scales: torch.Tensor, n: int, kc: int,
                  block: int = 0, simd: int = 2, out: torch.Tensor | None = None, row0: int = 0,
                  groups: int = 1) -> torch.Tensor:
    """`matmul_kernel(x, panels, n, kc, simd)` from the weight as its checkpoint stores it (`fmt` STORED_MXFP4: codes
    [n, k / 2], E8M0 scales [n, k / 32]; STORED_FP8: E4M3 [n, k], E8M0 scales per block x block tile;
    STORED_BF16: [n, k], scales None; any of them | WORDS: its rows as `panel_words`, the scales as stored), read in
    place: the same bits as the float panels of the dequantized weight (`stored_kc_fits` and the same caller
    guarantees as `matmul_kernel`); | AMX: as `matmul_bf16` over its `pack_bf16` tiles (`tiles_admit`; kc unused).
    `out`: written instead of a new [m, n] (its first n columns; rows with unit stride). row0: FP8 rows r0.. of a
    weight (data from row r0, scales from block row r0 // block), r0 % block. groups: a block-diagonal weight, its
    n outputs in `groups` groups (n / groups a multiple of 32), group g's reading x's inputs [g k, (g + 1) k) (x
    [m, groups k]): one call, the bits of a call a group."""
    m, width = x.shape
    y = torch.empty(m, n) if out is None else out
    capture.call(kernels.get("linear").linear_stored, x=x.data_ptr(), ldx=x.stride(0) if m > 1 else width,
                 format=fmt, data=data.data_ptr(), scales=0 if scales is None else scales.data_ptr(), y=y.data_ptr(),
                 ldy=y.stride(0) if m > 1 else n, m=m, k=width // groups, n=n, kc=kc, simd=simd, block=block,
                 row0=row0, groups=groups)
    return y


def pack_bf16(wt: torch.Tensor) -> torch.Tensor | None:
    """wt [in, out] as the linear kernel's bfloat16 tiles where every weight is a bfloat16 value (an FP8 block-scaled
    weight rebuilt, a BF16 checkpoint's): [ceil(out / 32) * 2, ceil(in / 32) * 16, 16, 2] bfloat16 bits as int16
    (pairs of inputs j and j + 16 of each block of 32, 16 columns a panel, zero beyond in and out), from which
    `linear_bf16` reads them exactly. None for any other weight (the check is bit for bit)."""
    k, n = wt.shape
    b = wt.to(torch.bfloat16)
    if bf16_check and not torch.equal(b.float().view(torch.int32), wt.float().view(torch.int32)):
        return None
    kp, np_ = -(-k // AMX_K) * AMX_K, -(-n // (2 * PANEL)) * 2 * PANEL
    b = F.pad(b.view(torch.int16), (0, np_ - n, 0, kp - k))  # [kp, np]
    half = AMX_K // 2  # pair j of a block of AMX_K inputs: inputs j and j + half (the kernel's split)
    return b.view(kp // AMX_K, 2, half, np_ // PANEL, PANEL).permute(3, 0, 2, 4, 1).reshape(
        np_ // PANEL, kp // 2, PANEL, 2).contiguous()


def matmul_bf16(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [m, in] @ the weight of `pack_bf16` tiles -> [m, n] on the CPU's tile unit (`amx_supported`; the caller
    checked as for `matmul_kernel`)."""
    m, k = x.shape
    y = torch.empty(m, n)
    capture.call(kernels.get("linear").linear_bf16, x=x.data_ptr(), ldx=x.stride(0) if m > 1 else k,
                 w=tiles.data_ptr(), y=y.data_ptr(), m=m, k=k, n=n)
    return y


@functools.cache
def amx_supported(linear_kernel) -> bool:
    return linear_kernel is not None and linear_kernel.amx_supported()


def matmul_fp8(x: torch.Tensor, fp8: tuple[torch.Tensor, torch.Tensor], n: int, kc: int) -> torch.Tensor:
    """`matmul_kernel(x, panels, n, kc)` from the weight's FP8 panels (`pack_fp8`): the same bits, a quarter of the
    weight's bytes read (the same caller guarantees; `fp8_supported()` checked)."""
    m, k = x.shape
    y = torch.empty(m, n)
    capture.call(kernels.get("linear").linear_fp8, x=x.data_ptr(), ldx=x.stride(0) if m > 1 else k,
                 fp8=fp8[0].data_ptr(), scales=fp8[1].data_ptr(), y=y.data_ptr(), m=m, k=k, n=n, kc=kc)
    return y


@functools.cache
def fp8_supported(linear_kernel) -> bool:
    return linear_kernel is not None and linear_kernel.fp8_supported()


def matmul_kernel(x: torch.Tensor, panels: torch.Tensor, n: int, kc: int, simd: int = 2) -> torch.Tensor:
    """x [m, in] @ the packed weight -> [m, n] through the linear kernel (loaded: the caller checked),
    which takes addresses: the caller guarantees float32 CPU tensors, x's rows contiguous (stride 1 in
    the last dim), panels from `pack_panels` of an [x.shape[1], n] weight. simd: 0 the portable tile, 1 AVX2 at
    most, 2 AVX-512 where the CPU has it (the same bits)."""
    m, k = x.shape
    y = torch.empty(m, n)
    capture.call(kernels.get("linear").linear_packed, x=x.data_ptr(), ldx=x.stride(0) if m > 1 else k,
                 panels=panels.data_ptr(), y=y.data_ptr(), m=m, k=k, n=n, kc=kc, simd=simd)
    return y


MOE_FLOAT, MOE_TILES, MOE_MXFP4 = 0, 1, STORED_MXFP4  # the linear kernel's moe_experts `format`


def moe_experts(xs: torch.Tensor, counts: torch.Tensor, panels13: torch.Tensor, kc13: int, panels2: torch.Tensor,
                kc2: int, inter: int, limit: float, tiles: bool = False, stored: tuple | None = None,
                words: bool = False, stored_tiles: bool = False, tiled: bool = False,
                prefetch: bool = False) -> torch.Tensor:
    """V4.1's routed experts in one linear-kernel call (loaded: the caller checked): xs [P, D] the pairs grouped
    by expert, counts [E] int64 their rows per expert, panels13 / panels2 [E] int64 the addresses of each
    expert's packed w13 [2I, D] / w2 [D, I] (kc13, kc2 their probed block sizes) -> ys [P, D], the rows of
    `linear(swiglu(linear(rows, w13[e]), inter, limit), w2[e])` per expert: the same products and SwiGLU, so
    the same bits as those calls, without a host read of the counts. tiles: the addresses are of `pack_bf16` tiles,
    multiplied by `linear_bf16` (kc13 and kc2 unused). stored: the experts as their checkpoint stores them in MXFP4,
    [E] int64 addresses (scales13, w3, scales3, scales2), panels13 / panels2 those of the w1 / w2 codes: decoded
    exactly where they lie (the same bits as the float panels of the dequantized weights); `words`: the codes'
    addresses are of their `panel_words` (the same bits); `stored_tiles`: those multiplied on the AMX tiles
    (`tiles_admit`: the bits of `tiles` over the dequantized weights; kc13 and kc2 unused), `tiled` (with both):
    words in the tiles' order (`tiled_words`). prefetch (stored, not words): the codes and scales of every expert
    with rows read ahead before the products (madvise WILLNEED: a file's pages read together; the same bits)."""
    p, d = xs.shape
    h, g, ys = torch.empty(p, 2 * inter), torch.empty(p, inter), torch.empty(p, d)
    s13, w3, s3, s2 = (t.data_ptr() for t in stored) if stored is not None else (0, 0, 0, 0)
    capture.call(kernels.get("linear").moe_experts, xs=xs.data_ptr(), rows=p, counts=counts.data_ptr(),
                 e=counts.shape[0], d=d, inter=inter, panels13=panels13.data_ptr(), kc13=kc13,
                 panels2=panels2.data_ptr(), kc2=kc2, limit=limit, h=h.data_ptr(), g=g.data_ptr(), ys=ys.data_ptr(),
                 simd=2, format=MOE_TILES if tiles else MOE_FLOAT if stored is None
                 else MOE_MXFP4 | (WORDS if words else 0) | (AMX if stored_tiles else 0) | (TILED if tiled else 0),
                 scales13=s13, scales2=s2, w3=w3, scales3=s3, prefetch=prefetch)
    return ys


def kernel_takes(x2: torch.Tensor, weight: torch.Tensor, packed) -> bool:
    """Whether the linear kernel computes x2 [N, in] @ weight.T with the plan's `packed` form of the weight (a
    probed kc, or its bfloat16 tiles; None: none): float32 CPU rows with unit stride, outside autograd."""
    return (packed is not None and x2.is_cpu and x2.dtype == torch.float32 and x2.stride(-1) == 1
            and x2.shape[1] == weight.shape[1] and (x2.shape[0] == 1 or x2.stride(0) >= x2.shape[1])
            and not (torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad)))


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed on the vectorised path for every element (rule above). An
    input whose contiguous innermost dim is a multiple of VEC_PAD (a column slice of a fused matmul's
    output) is already all whole vectors: torch loops over its rows."""
    n = x.numel()
    if not _exact or (n % VEC_PAD == 0 and x.is_contiguous()) or (x.stride(-1) == 1 and x.shape[-1] % VEC_PAD == 0):
        return fn(x)
    return fn(F.pad(x.reshape(-1), (0, (-n) % VEC_PAD)))[:n].view(x.shape)
