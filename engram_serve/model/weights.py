"""Weights kept in their stored format: a layer's MXFP4 routed experts, and FP8 block-scaled or BF16 linears.

An MXFP4 checkpoint stores each expert's w1, w3 [I, D] and w2 [D, I] as packed E2M1 codes [rows, cols / 2]
(the even column in the low nibble) with one E8M0 scale per row and 32 columns [rows, cols / 32]
(engram/quantized.py `dequantize_fp4`). `Mxfp4Experts` holds them as they lie in the checkpoint's memory map (no
copy: a page is read from disk when a step first needs it, and the page cache may drop it again; the experts a
step's router chose are read ahead together, `prefetch`), and the linear kernel's `moe_experts` (format
`exactness.MOE_MXFP4`) multiplies them in place with the bits of the float panels over the dequantized weights.
`dequantize(e)` / `dense()` give exactly the float32 weights the float path loads (for everything that needs
floats: the torch forms, CUDA, autograd, sharding, the writer).

An FP8 checkpoint stores a linear's weight as E4M3 [out, in] with one E8M0 scale per block x block tile, its other
matrices in BF16. `StoredWeight` holds such a weight (or several stacked by rows: one product for weights that share
their input) as it lies in the map, and
`run(x2)` multiplies it in place (`exactness.matmul_stored`) at the block size kc the float plan of its shape takes
(`exactness.stored_kc`), so with the bits of the float path; where that plan is not the float panels (AMX tiles, BLAS, padded torch), or the call is not the kernel's
(autograd, another dtype), over a float copy made once (`dense()`).

`HoldsStored`: a module whose float parameters are held so until something reads them (the torch forms, autograd,
sharding, `state_dict`, `.to`), which turns them into today's float32 Parameters once (`dense_`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engram.quantized import dequantize_blocks, dequantize_fp4
from . import exactness
from .exactness import STORED_BF16, STORED_FP8, in_major

Stored = tuple[torch.Tensor, torch.Tensor]  # (packed E2M1 codes [rows, cols / 2], E8M0 scales [rows, cols / 32])
EXPERTS_IN_RAM = 0.5  # the share of the memory under which routed experts are repacked into RAM (`experts_fit`)


def experts_fit(expert_bytes: int, memory: int | None) -> bool:
    """THE RULE of where MXFP4 routed experts are read from: repacked panel-major into RAM (`Mxfp4Experts.panel_major`,
    the faster product) where all of them take at most EXPERTS_IN_RAM of `memory` (the loader: MemAvailable at
    load; memory_plan.py: the memory it compares with), else in place from the memory map, paged in as steps touch
    them (a checkpoint larger than RAM)."""
    return memory is not None and expert_bytes <= EXPERTS_IN_RAM * memory


class Mxfp4Experts:
    """One MoE layer's routed experts as stored: `w1`, `w3` (each [I, D] per expert) and `w2` ([D, I]), lists of
    (codes, scales) uint8 views, one per expert; `shape13` = (2I, D), `shape2` = (D, I)."""

    def __init__(self, w1: list[Stored], w3: list[Stored], w2: list[Stored]):
        self.w1, self.w3, self.w2 = w1, w3, w2
        (i, half), d = w1[0][0].shape, w2[0][0].shape[0]
        self.shape13, self.shape2 = (2 * i, 2 * half), (d, i)
        self.words = None  # (w1, w3, w2): each expert's codes panel-major, once `panel_major` made them
        self.prefetch = True  # read in place (no words): a step's experts read ahead (moe_experts' prefetch); False:
        # plain paging, each page read when a product first touches it (as a benchmark compares)
        self._addresses = self._admitted = None

    def panel_major(self) -> list[torch.Tensor]:
        """Repacks every expert's codes panel-major in RAM (`exactness.panel_words`: a permutation of the bytes, the
        same products) for `moe_experts` to read with one load per 16 rows, where `exactness.repacks` them;
        returns the codes repacked (which stay the weights for `dequantize`: the loader lets their pages of the map
        go). The loader calls it where the experts fit in memory (`experts_fit`); else they are read
        in place, paged from the file."""
        if self.words is not None or not exactness.repacks(min(self.shape13[0], self.shape2[0])):
            return []
        tiled = exactness.tiled_words(exactness.STORED_MXFP4)  # (on an AMX CPU)
        words = tuple([exactness.panel_words(c, False, tiled) for c, _ in w] for w in (self.w1, self.w3, self.w2))
        if any(x is None for w in words for x in w):
            return []
        self.words, self._addresses = words, None
        return [codes for w in (self.w1, self.w3, self.w2) for codes, _ in w]

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
        `exactness.moe_experts` reads; the codes' `words` where made)."""
        if self._addresses is None:
            codes = self.words or tuple([c for c, _ in w] for w in (self.w1, self.w3, self.w2))
            self._addresses = tuple(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
                                    for w, c in zip((self.w1, self.w3, self.w2), codes)
                                    for ts in (c, [s for _, s in w]))
        return self._addresses

    def kcs(self) -> tuple[int, int] | None:
        """The block sizes at which `moe_experts` multiplies w13 and w2 as stored with the float path's bits
        (`exactness.stored_kc`), or None (then on the AMX tiles where `on_tiles`, else the MoE dequantizes once)."""
        kcs = tuple(exactness.stored_kc(exactness.STORED_MXFP4, *shape) for shape in (self.shape13, self.shape2))
        return None if None in kcs else kcs

    def on_tiles(self) -> bool:
        """Whether `moe_experts` multiplies them on the AMX tiles as stored (`exactness.tiles_admit` of every
        expert's scales, read once)."""
        if not exactness.on_tiles():
            return False
        if self._admitted is None:
            self._admitted = exactness.tiles_admit(exactness.STORED_MXFP4, min(self.shape13[0] // 2, self.shape2[0]),
                                                   [s for w in (self.w1, self.w3, self.w2) for _, s in w], True)
        return self._admitted

    def probes(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What `products.pad_rows` reads of w13 and w2: views of their shapes alone (`exactness.shape_only`) where
        they are multiplied as stored on the float panels, None on the tiles, else expert 0's float weights
        (input-major)."""
        if self.kcs() is not None:
            return exactness.shape_only(*self.shape13), exactness.shape_only(*self.shape2)
        if self.on_tiles():
            return None, None
        return tuple(in_major(w) for w in self.dequantize(0))




class StoredWeight:
    """A linear's weights as stored, stacked by rows: `fmt` exactness.STORED_FP8 (E4M3 with one E8M0 scale per
    `block` x `block` tile) or STORED_BF16; `parts` [(data [out_i, in] uint8 (BF16: bfloat16), E8M0 scales [blocks
    of rows, ceil(in / block)] uint8 (BF16: None), row0: the first row's place in its block of scales)]; `words` a
    part's rows repacked panel-major (`panel_major`), or None; `shape` (sum of out_i, in); `dtype` the one its
    products compute in."""

    dtype = torch.float32

    def __init__(self, fmt: int, parts: list[tuple[torch.Tensor, torch.Tensor | None, int]], block: int = 0,
                 words: list[torch.Tensor | None] | None = None):
        self.fmt, self.parts, self.block = fmt, parts, block
        self.words = words or [None] * len(parts)
        self.shape = torch.Size((sum(d.shape[0] for d, _, _ in parts), parts[0][0].shape[1]))
        self._dense = self._admitted = None

    def panel_major(self) -> list[torch.Tensor]:
        """Repacks each part panel-major for the kernel (`exactness.panel_words`: a permutation of its bytes, the
        same products; FP8 where no code is NaN) where `exactness.repacks` it; returns the rows
        repacked (which stay the weight for `dequantize`: the loader lets their pages of the map go)."""
        if not exactness.repacks(self.shape[0]):
            return []
        fp8, bf16 = self.fmt == STORED_FP8, self.fmt == STORED_BF16
        done, tiled = [], exactness.tiled_words(self.fmt, self.shape[1], self.block)
        for i, (data, _, _) in enumerate(self.parts):
            rows = data.view(torch.uint8)  # (BF16: two bytes an input)
            if self.words[i] is None and (words := exactness.panel_words(rows, fp8, tiled, bf16)) is not None:
                self.words[i] = words
                done.append(data)
        return done

    def rows(self, r0: int, r1: int) -> StoredWeight | None:
        """Rows [r0, r1) of a one-part weight as stored, or None where r0 is not a multiple of 16 (a panel's rows
        share their block of scales)."""
        (data, scales, row0), words, b = self.parts[0], self.words[0], self.block
        if len(self.parts) > 1 or r0 % 16:
            return None
        words = None if words is None else words[r0 // 16:-(-r1 // 16)]
        if scales is None:
            part = StoredWeight(self.fmt, [(data[r0:r1], None, 0)], words=[words])
        else:
            first = row0 + r0
            part = StoredWeight(self.fmt, [(data[r0:r1], scales[first // b:-(-(row0 + r1) // b)], first % b)], b,
                                [words])
        if exactness.on_tiles():  # (a step's slice: its scales not read again, e.g. in a CPU graph's capture)
            part._admitted = self.on_tiles()
        return part

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight: exactly `dequantize_blocks` of each FP8 part (a BF16 one cast)."""
        if self.fmt == STORED_BF16:
            return torch.cat([d.view(torch.bfloat16).float() for d, _, _ in self.parts])
        return torch.cat([dequantize_blocks(F.pad(d, (0, 0, r, 0)).view(torch.float8_e4m3fn),
                                            s.view(torch.float8_e8m0fnu), self.block)[r:] for d, s, r in self.parts])

    def dense(self) -> torch.Tensor:
        """The float32 weight input-major, as the float path lays it out (a copy, made once)."""
        if self._dense is None:
            self._dense = in_major(self.dequantize())
        return self._dense

    def kc(self) -> int | None:
        return exactness.stored_kc(self.fmt, *self.shape) if exactness.rules_on() else None

    def on_tiles(self) -> bool:
        """Whether it is multiplied on the AMX tiles as stored (`exactness.tiles_admit`; its scales read once)."""
        if not exactness.on_tiles():
            return False
        if self._admitted is None:
            scales = [s for _, s, _ in self.parts if s is not None]
            self._admitted = exactness.tiles_admit(self.fmt, self.shape[0], scales, None not in self.words)
        return self._admitted

    def probe(self) -> torch.Tensor | None:
        """What `products.pad_rows` reads of it: a view of its shape alone (`exactness.shape_only`) where it is
        multiplied as stored on the float panels, None on the tiles (any rows), else its float copy."""
        return exactness.shape_only(*self.shape) if self.kc() else None if self.on_tiles() else self.dense()

    def _call(self) -> tuple[int | None, int]:
        """(kc, format flag) of its kernel call: kc None where the kernel does not take it."""
        kc = self.kc()
        return (8, exactness.AMX) if kc is None and self.on_tiles() else (kc, 0)  # (the tiles: kc unused)

    def _multiply(self, x2: torch.Tensor, i: int, kc: int, flag: int, out: torch.Tensor, groups: int = 1) -> None:
        (data, scales, row0), words = self.parts[i], self.words[i]
        fmt, stored = (self.fmt, data) if words is None else (self.fmt | exactness.WORDS, words)
        if words is not None and flag and exactness.tiled_words(self.fmt, self.shape[1], self.block):
            fmt |= exactness.TILED
        exactness.matmul_stored(x2, fmt | flag, stored, scales, data.shape[0], kc, self.block, out=out, row0=row0,
                                groups=groups)

    def run(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [N, in] @ weight.T -> [N, out]: in place where the kernel takes it (`exactness.stored_kc` on the float
        panels, `on_tiles` on the AMX tiles), else over `dense()`."""
        kc, flag = self._call()
        if kc is None or not exactness.kernel_takes(x2, exactness.shape_only(*self.shape), kc):
            if kc is None and exactness.rules_on():  # the kernel turns this shape down: its words would stay unused
                self.words = [None] * len(self.parts)
            from . import products  # (products plans float weights; it does not know this module)
            return products.plan(self.dense()).run(x2, self.dense())
        y, at = torch.empty(x2.shape[0], self.shape[0]), 0
        for i, (data, _, _) in enumerate(self.parts):
            self._multiply(x2, i, kc, flag, y[:, at:])
            at += data.shape[0]
        return y

    def run_groups(self, x2: torch.Tensor, groups: int) -> torch.Tensor | None:
        """x2 [N, groups * in] times a block-diagonal weight (group g's out / groups rows multiply x2's inputs
        [g in, (g + 1) in)) -> [N, out], in one kernel call: the bits of `rows(...).run` a group (each output's sum is
        its own), or None where the kernel would not take a group's call that way."""
        (n, k), ol = self.shape, self.shape[0] // groups
        first = self.rows(0, ol) if n % (32 * groups) == 0 else None
        kc, flag = first._call() if first is not None else (None, 0)  # (a group's plan)
        if kc is None or not exactness.kernel_takes(x2, exactness.shape_only(n, groups * k), kc):
            return None
        y = torch.empty(x2.shape[0], n)
        self._multiply(x2, 0, kc, flag, y, groups)
        return y


class HoldsStored(nn.Module):
    """A module holding float parameters (`STORED`, names) as stored (`stored`, None once dense): they are not
    parameters until something reads them, which calls `dense_` once (`dense_params()` gives them; they require
    grad where the module's other parameters do)."""

    STORED: tuple[str, ...] = ()
    stored = None

    def dense_params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def use_stored(self, stored) -> None:
        for name in self.STORED:
            del self._parameters[name]
        self.stored = stored

    def dense_(self) -> None:
        if self.stored is not None:
            params, grad = self.dense_params(), any(p.requires_grad for p in self.parameters())
            self.stored = None
            for name, t in params.items():
                setattr(self, name, nn.Parameter(t, requires_grad=grad))

    def __getattr__(self, name: str):
        if name in self.STORED and self.__dict__.get("stored") is not None:
            self.dense_()  # a reader of the float weights
        return super().__getattr__(name)

    def _apply(self, fn, recurse=True):
        self.dense_()  # .to(), .double(), ...: of the float weights
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.dense_()
        super()._save_to_state_dict(destination, prefix, keep_vars)
