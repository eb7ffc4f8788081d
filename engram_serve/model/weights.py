"""Weights kept in their stored format: a layer's MXFP4 routed experts.

An MXFP4 checkpoint stores each expert's w1, w3 [I, D] and w2 [D, I] as packed E2M1 codes [rows, cols / 2]
(the even column in the low nibble) with one E8M0 scale per row and 32 columns [rows, cols / 32]
(engram/quantized.py `dequantize_fp4`). `Mxfp4Experts` holds them as the linear kernel's MXFP4 panels
(`exactness.pack_mxfp4`: a permutation of the stored bytes, padded to whole panels of 16 outputs), w13 = w1
then w3 by rows like the model's float `w13`, so `moe_experts(format=2)` multiplies them with the bits of
the float panels over the dequantized weights. `dequantize(e)` / `dense()` give exactly the float32 weights
the float path loads (for everything that needs floats: the torch forms, CUDA, autograd, sharding, the
writer).
"""
from __future__ import annotations

import torch

from ..engram.quantized import dequantize_fp4
from . import exactness
from .exactness import MX_BLOCK, PANEL, in_major


def unpack_mxfp4(codes: torch.Tensor, scales: torch.Tensor, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `exactness.pack_mxfp4`: MXFP4 panels -> the stored ([out, in / 2] uint8, [out, in / 32]
    uint8) bytes."""
    p, k, _ = codes.shape
    nib = torch.stack([codes & 15, codes >> 4], -1).view(p, k, PANEL).transpose(1, 2).reshape(p * PANEL, k)[:out]
    stored = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return stored, scales.transpose(1, 2).reshape(p * PANEL, k // MX_BLOCK)[:out]


class Mxfp4Experts:
    """One MoE layer's routed experts as MXFP4 panels: `codes13` [E, ceil(2I / 16), D, 8], `scales13`
    [E, ceil(2I / 16), D / 32, 16] (w1 then w3 by rows), `codes2` [E, ceil(D / 16), I, 8], `scales2`
    [E, ceil(D / 16), I / 32, 16], uint8; `shape13` = (2I, D), `shape2` = (D, I)."""

    def __init__(self, codes13: torch.Tensor, scales13: torch.Tensor, codes2: torch.Tensor, scales2: torch.Tensor,
                 shape13: tuple[int, int], shape2: tuple[int, int]):
        self.codes13, self.scales13, self.codes2, self.scales2 = codes13, scales13, codes2, scales2
        self.shape13, self.shape2 = shape13, shape2

    @classmethod
    def from_stored(cls, w1: list, w3: list, w2: list) -> Mxfp4Experts:
        """From each expert's stored (codes, scales) of w1, w3 [I, D] and w2 [D, I] (e.g. views of the
        checkpoint's memory map: only the panels are kept)."""
        def pack(parts):
            panels = [exactness.pack_mxfp4(c, s) for c, s in parts]
            return torch.stack([c for c, _ in panels]), torch.stack([s for _, s in panels])
        (i, half), n = w1[0][0].shape, len(w1)
        codes13, scales13 = pack([(torch.cat([w1[e][0], w3[e][0]]), torch.cat([w1[e][1], w3[e][1]]))
                                  for e in range(n)])
        codes2, scales2 = pack(w2)
        return cls(codes13, scales13, codes2, scales2, (2 * i, 2 * half), (2 * half, i))

    @property
    def num_experts(self) -> int:
        return self.codes13.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes13, self.scales13, self.codes2, self.scales2))

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's float32 (w13 [2I, D], w2 [D, I]): exactly `dequantize_fp4` of the stored bytes."""
        return (dequantize_fp4(*unpack_mxfp4(self.codes13[e], self.scales13[e], self.shape13[0])),
                dequantize_fp4(*unpack_mxfp4(self.codes2[e], self.scales2[e], self.shape2[0])))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' float32 (w13 [E, 2I, D], w2 [E, D, I]) as the float path loads them (input-major)."""
        parts = [self.dequantize(e) for e in range(self.num_experts)]
        return (in_major(torch.stack([a for a, _ in parts])), in_major(torch.stack([b for _, b in parts])))

    def addresses(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[E] int64 addresses of each expert's codes13, scales13, codes2, scales2 (`exactness.moe_experts`)."""
        return tuple(torch.tensor([t[e].data_ptr() for e in range(self.num_experts)], dtype=torch.int64)
                     for t in (self.codes13, self.scales13, self.codes2, self.scales2))

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
