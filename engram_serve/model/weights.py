"""Weights kept in their stored format: a layer's MXFP4 routed experts.

An MXFP4 checkpoint stores each expert's w1, w3 [I, D] and w2 [D, I] as packed E2M1 codes [rows, cols / 2]
(the even column in the low nibble) with one E8M0 scale per row and 32 columns [rows, cols / 32]
(engram/quantized.py `dequantize_fp4`). `Mxfp4Experts` holds them as they lie in the checkpoint's memory map (no
copy: a page is read from disk when a step first touches it, and the page cache may drop it again), and the linear
kernel's `moe_experts` (format `exactness.MOE_MXFP4`) multiplies them in place with the bits of the float panels
over the dequantized weights. `dequantize(e)` / `dense()` give exactly the float32 weights the float path loads
(for everything that needs floats: the torch forms, CUDA, autograd, sharding, the writer).
"""
from __future__ import annotations

import torch

from ..engram.quantized import dequantize_fp4
from .exactness import in_major

Stored = tuple[torch.Tensor, torch.Tensor]  # (packed E2M1 codes [rows, cols / 2], E8M0 scales [rows, cols / 32])


class Mxfp4Experts:
    """One MoE layer's routed experts as stored: `w1`, `w3` (each [I, D] per expert) and `w2` ([D, I]), lists of
    (codes, scales) uint8 views, one per expert; `shape13` = (2I, D), `shape2` = (D, I)."""

    def __init__(self, w1: list[Stored], w3: list[Stored], w2: list[Stored]):
        self.w1, self.w3, self.w2 = w1, w3, w2
        (i, half), d = w1[0][0].shape, w2[0][0].shape[0]
        self.shape13, self.shape2 = (2 * i, 2 * half), (d, i)
        self._addresses = None

    @property
    def num_experts(self) -> int:
        return len(self.w1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in (self.w1, self.w3, self.w2) for pair in w for t in pair)

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's float32 (w13 [2I, D], w2 [D, I]): exactly `dequantize_fp4` of the stored bytes."""
        return (torch.cat([dequantize_fp4(*self.w1[e]), dequantize_fp4(*self.w3[e])]), dequantize_fp4(*self.w2[e]))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' float32 (w13 [E, 2I, D], w2 [E, D, I]) as the float path loads them (input-major)."""
        parts = [self.dequantize(e) for e in range(self.num_experts)]
        return (in_major(torch.stack([a for a, _ in parts])), in_major(torch.stack([b for _, b in parts])))

    def addresses(self) -> tuple[torch.Tensor, ...]:
        """[E] int64 addresses of each expert's w1 codes, w1 scales, w3 codes, w3 scales, w2 codes, w2 scales (what
        `exactness.moe_experts` reads)."""
        if self._addresses is None:
            self._addresses = tuple(torch.tensor([pair[j].data_ptr() for pair in w], dtype=torch.int64)
                                    for w in (self.w1, self.w3, self.w2) for j in (0, 1))
        return self._addresses

    def probes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert 0's float32 w13 and w2, input-major, one per shape in the process: the weights whose
        `products.plan` says how the float path would multiply every expert of that shape (the plan's kind and
        kc depend on the shape, the CPU and the threads; its bfloat16 check on the values, and every MXFP4 value
        is a bfloat16)."""
        key = (self.shape13, self.shape2)
        if key not in _probes:
            _probes[key] = tuple(in_major(w) for w in self.dequantize(0))
        return _probes[key]


_probes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
