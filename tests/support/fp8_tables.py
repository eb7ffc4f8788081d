"""E4M3 / E8M0 bytes decoded by hand, one value at a time: the plain reference that the Engram
table tests (tests/test_checkpoint_tables.py, tests/kernels/test_gather_kernel.py) hold the loader and the
staging gather against."""
from __future__ import annotations

import math

import numpy as np
import torch

from engram_serve.engram.quantized import Fp8Table, dequantize_blocks, quantize_blocks


# ---- plain reference: bits decoded by hand, one value at a time ----

def e4m3(b: int) -> float:
    sign, exp, man = b >> 7, (b >> 3) & 0xF, b & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    v = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -v if sign else v


def e8m0(code: int) -> float:
    return math.nan if code == 255 else 2.0 ** (code - 127)


def reference_rows(w: np.ndarray, s: np.ndarray, ids: list[int]) -> np.ndarray:
    """w [rows, hd] uint8, s [rows, hd/32] uint8 -> [len(ids), hd] float32, a plain loop."""
    hd = w.shape[1]
    out = np.zeros((len(ids), hd), dtype=np.float32)
    for i, r in enumerate(ids):
        for c in range(hd):
            out[i, c] = np.float32(e4m3(int(w[r, c])) * e8m0(int(s[r, c // 32])))
    return out


def same_bits(a, b) -> bool:
    """Bit for bit, except that any NaN equals any NaN (E4M3 0x7f/0xff and E8M0 0xff decode to NaN; its
    sign and payload are not part of the format)."""
    a, b = np.array(a, np.float32), np.array(b, np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    a[np.isnan(a)] = b[np.isnan(b)] = 0
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def table_from_bytes(w: np.ndarray, s: np.ndarray) -> Fp8Table:
    return Fp8Table(torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))


def fp8_weight(out_f: int, in_f: int, block: int, seed: int) -> torch.Tensor:
    """An FP8 block-scaled weight as a checkpoint's loader gives it: E4M3 values times one power of two per tile."""
    x = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 3e-6])[:x.numel()]  # zeros and (scaled) an E4M3 subnormal
    return dequantize_blocks(*quantize_blocks(x, block), block)
