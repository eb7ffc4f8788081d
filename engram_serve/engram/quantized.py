"""FP8 Engram tables and FP8 block-scaled weights, in the DeepSeek-V4.1 checkpoint format (docs/contract.md §11).

Table rows are F8_E4M3 `weight [rows, head_dim]` with F8_E8M0 `scale [rows, head_dim / 32]`: one
power of two per 32 consecutive columns, value = e4m3(w) * 2^(code - 127). A table stays in this
stored form (memory-mapped from the checkpoint, 1 + 1/32 bytes per value); only the rows a step
needs are fetched and dequantized, straight into the staging buffer. A table is never dequantized
whole.

Weights such as the Engram `wkv` projection are F8_E4M3 `[out, in]` with an F8_E8M0 scale per
square block (`[ceil(out/b), ceil(in/b)]`, b = 32 for `wkv`); `dequantize_blocks` expands them
(the loader does this once, at load, into the model's compute dtype, so the batch-invariant
`Linear` runs on float weights).

Exactness: an E4M3 value has 4 significant bits, so e4m3 * 2^k is exact in float32 wherever the
result is a normal float32; in the subnormal range and on overflow the float32 product is the
correctly rounded exact value. The dequantized rows are therefore bit for bit the plain definition
(tests/test_checkpoint_official.py checks them against a hand-written bit decoder).
"""
from __future__ import annotations

import ctypes
import sys

import torch

SCALE_COLS = 32  # columns per E8M0 scale of a table row
E4M3_MAX = 448.0
E8M0_BIAS = 127
FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def advise_random(t: torch.Tensor) -> None:
    """madvise(MADV_RANDOM) over a memory-mapped tensor's pages: no read-ahead, so a row read from a
    table larger than RAM faults in one page, not a 128 KiB window (resident memory then grows with
    the rows touched). A no-op where unsupported or for memory that is not a mapping."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return
    start = t.data_ptr() & ~4095
    length = t.data_ptr() + t.numel() * t.element_size() - start
    try:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 1)  # 1 = MADV_RANDOM
    except (OSError, AttributeError):
        pass


_E4M3_IN_BF16_MASK = 0x87F0 - 2**16  # sign bit + E4M3's 4 exponent and 3 mantissa bits, placed in a bfloat16


def e4m3_scaled_bf16(w: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes [...] (uint8 or float8_e4m3fn) -> bfloat16 [...] holding e4m3 * 2^-120 EXACTLY (NaN codes aside).

    The bit trick: the byte's exponent and mantissa bits (b & 0x7f) placed at bfloat16 bits 4..10 and
    its sign at bit 15 form the bfloat16 2^(e-127) * (1 + m/8) = e4m3 * 2^-120 for a normal E4M3
    (e = 1..15), and the subnormal (m/8) * 2^-126 = e4m3 * 2^-120 for a subnormal one (e = 0).
    Sign extension of the int8 view puts the sign at bit 15; the mask clears what it smeared into
    bits 11..14. Three int16 passes: torch's own float8 -> float32 cast is ~5x slower on CPU (scalar
    code), and so are comparisons, which is why NaN bytes (0x7f, 0xff) are detected by a max."""
    x = w.view(torch.int8).to(torch.int16)  # sign-extended
    return ((x << 4) & _E4M3_IN_BF16_MASK).view(torch.bfloat16)


def dequantize_rows(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows w [n, hd] E4M3 with scales s [n, hd/32] E8M0 (float8 dtypes or their raw uint8 bytes) into out
    [n, hd] (float32 or bfloat16, on w's device), in place; returns out.

    value = (e4m3 * 2^-120) * 2^(code - 7): one correctly rounded float32 multiply of two exact
    values, so the result is the exact value rounded once (the plain definition). Where a code > 134
    would make 2^(code - 7) overflow, 2^120 and 2^(code - 127) are applied in turn (the first
    multiply is exact). NaN bytes, and the NaN scale code 255, give NaN."""
    n, hd = w.shape
    g = hd // SCALE_COLS
    if n == 0:
        return out
    v = e4m3_scaled_bf16(w).view(n, g, SCALE_COLS)  # [n, G, 32] e4m3 * 2^-120, exact in bfloat16
    codes = s.view(torch.uint8)
    dst = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(out.shape, dtype=torch.float32,
                                                                                     device=out.device)
    if int(codes.max()) <= 134:
        scales = (s.view(E8M0).to(torch.float32) * 2.0 ** 120).view(n, g, 1)  # 2^(code-7), exact
        torch.mul(v, scales, out=dst.view(n, g, SCALE_COLS))  # computed in float32
    else:
        scales = s.view(E8M0).to(torch.float32).view(n, g, 1)  # 2^(code-127), NaN for 255
        torch.mul(v.to(torch.float32) * 2.0 ** 120, scales, out=dst.view(n, g, SCALE_COLS))
    if int((w.view(torch.uint8) & 0x7F).max()) == 0x7F:  # a NaN byte: not in a valid checkpoint
        dst.masked_fill_((w.view(torch.uint8) & 0x7F) == 0x7F, float("nan"))
    if dst is not out:
        out.copy_(dst)
    return out


def dequantize_blocks(w: torch.Tensor, s: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [O, I] float8_e4m3fn with one E8M0 scale per block x block tile (s [ceil(O/b), ceil(I/b)]) -> [O, I] dtype."""
    o, i = w.shape
    scales = s.to(torch.float32).repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]  # [O, I]
    return (w.to(torch.float32) * scales).to(dtype)


def block_size_of(weight_shape: tuple[int, int], scale_shape: tuple[int, int]) -> int | None:
    """The square block size b in (32, 64, 128, 256) with scale_shape == (ceil(O/b), ceil(I/b)), else None.
    (For powers of two, two sizes giving the same counts partition the matrix identically.)"""
    o, i = weight_shape
    for b in (32, 64, 128, 256):
        if tuple(scale_shape) == (-(-o // b), -(-i // b)):
            return b
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, hd] float -> (w [rows, hd] float8_e4m3fn, s [rows, hd/32] float8_e8m0fnu): per 32 columns the
    smallest power of two 2^k with max|x| / 2^k <= 448 (k = 0 for an all-zero group), then e4m3 rounding."""
    rows, hd = x.shape
    if hd % SCALE_COLS:
        raise ValueError(f"quantize_rows: head_dim {hd} is not a multiple of {SCALE_COLS}")
    g = x.float().view(rows, hd // SCALE_COLS, SCALE_COLS)
    amax = g.abs().amax(-1, keepdim=True)  # [rows, G, 1]
    k = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.zeros_like(amax))
    k = k.clamp(-E8M0_BIAS, E8M0_BIAS)
    w = (g / torch.exp2(k)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(rows, hd)
    codes = (k + E8M0_BIAS).to(torch.uint8).view(rows, -1)
    return w, codes.view(E8M0)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [O, I] -> (w [O, I] float8_e4m3fn, s [ceil(O/b), ceil(I/b)] float8_e8m0fnu), one power of two per tile."""
    o, i = x.shape
    po, pi = -(-o // block) * block, -(-i // block) * block
    xp = torch.zeros(po, pi, dtype=torch.float32)
    xp[:o, :i] = x.float()
    tiles = xp.view(po // block, block, pi // block, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    k = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
    w = (tiles / torch.exp2(k)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(po, pi)[:o, :i].contiguous()
    return w, (k + E8M0_BIAS).to(torch.uint8).view(po // block, pi // block).view(E8M0)


class Fp8Table:
    """One Engram table in its stored FP8 form.

    Invariants: weight [rows, hd] float8_e4m3fn, scale [rows, hd/32] float8_e8m0fnu, hd % 32 == 0;
    both stay as given (typically memory-mapped views of a checkpoint file) and are only read."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        if weight.dtype != FP8 or scale.dtype != E8M0:
            raise ValueError(f"Fp8Table: weight {weight.dtype} / scale {scale.dtype}; expected {FP8} / {E8M0}")
        if weight.ndim != 2 or weight.shape[1] % SCALE_COLS or tuple(scale.shape) != (
                weight.shape[0], weight.shape[1] // SCALE_COLS):
            raise ValueError(f"Fp8Table: weight {list(weight.shape)} and scale {list(scale.shape)} do not fit "
                             f"(scale must be [rows, head_dim / {SCALE_COLS}])")
        self.weight, self.scale = weight, scale

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def ndim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel()

    @property
    def row_bytes(self) -> int:
        return self.weight.shape[1] + self.scale.shape[1]

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored bytes of rows `ids` [n] int64: (E4M3 [n, hd] uint8, E8M0 [n, hd/32] uint8), copied out.
        (Raw bytes: torch has no index_put for the float8 dtypes, and the hot-row cache needs it.)"""
        return self.weight.view(torch.uint8).index_select(0, ids), self.scale.view(torch.uint8).index_select(0, ids)

    def pin_memory(self) -> "Fp8Table":
        return Fp8Table(self.weight.pin_memory(), self.scale.pin_memory())

    def is_pinned(self) -> bool:
        return self.weight.is_pinned()

    @classmethod
    def from_float(cls, x: torch.Tensor) -> "Fp8Table":
        return cls(*quantize_rows(x))

    def dequantize(self) -> torch.Tensor:
        """The whole table as float32 [rows, hd]. For tests and conversions of small tables only: serving
        never calls this (it dequantizes the rows a step needs)."""
        return dequantize_rows(self.weight, self.scale, torch.empty(self.shape, dtype=torch.float32))


# MXFP4 (the routed experts of a V4.1 checkpoint, quantization_config.expert_dtype = "fp4"): int8 [O, I/2],
# two E2M1 values a byte (the even column in the low nibble), with one E8M0 scale per row and 32 columns.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0


def dequantize_fp4(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [O, I/2] int8/uint8 packed E2M1 with s [O, I/32] E8M0 -> [O, I] dtype (exact: a 3-bit E2M1 value
    times a power of two is a float32)."""
    o, half = w.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = w.view(torch.uint8).long()
    v = torch.stack([lut[b & 15], lut[b >> 4]], -1).view(o, 2 * half)  # even column from the low nibble
    scales = s.view(E8M0).to(torch.float32).repeat_interleave(SCALE_COLS, 1)[:, : 2 * half]
    return (v * scales).to(dtype)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [O, I] (I a multiple of 32) -> (w [O, I/2] int8 packed E2M1, s [O, I/32] E8M0): per 32 columns the
    smallest power of two 2^k with max|x| / 2^k <= 6, then the nearest E2M1 value (ties to the even code)."""
    o, i = x.shape
    if i % SCALE_COLS:
        raise ValueError(f"quantize_fp4: {i} columns is not a multiple of {SCALE_COLS}")
    g = x.float().view(o, i // SCALE_COLS, SCALE_COLS)
    amax = g.abs().amax(-1, keepdim=True)
    k = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP4_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
    y = (g / torch.exp2(k)).view(o, i)
    mags = torch.tensor(FP4_VALUES[:8])
    dist = (y.abs()[..., None] - mags).abs()  # [O, I, 8]
    best = dist.min(-1, keepdim=True).values
    code = torch.where(dist == best, torch.arange(8), 99).amin(-1)  # nearest; a tie between two: the even code
    odd_tie = ((dist == best).sum(-1) > 1) & (code % 2 == 1)
    code = code + odd_tie.long()
    code = code + 8 * (y < 0).long()
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (k + E8M0_BIAS).to(torch.uint8).view(o, -1).view(E8M0)
