"""One product strategy per weight: how layers.py `linear` multiplies by a weight view, chosen once by the rules
and probes of model/exactness.py (the weight's bfloat16 tiles, its float or FP8 panels, a row-wise product, torch's
sgemm called directly, or F.linear padded to min_rows rows) and memoised by the weight's address, layout and
version. The linear kernel's one-call forms (the MoE's experts, the mHC's `hc_next`) read a strategy's named
`kernel_weight`, `kc` and `is_tiles`."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from .. import kernels
from . import exactness


class Product:
    """How `linear` multiplies by one weight view (`plan`): a strategy made once per weight (and version), whose
    `run(x2, weight)` computes x2 [N, in] @ weight.T -> [N, out]. What the linear kernel's one-call forms (the MoE's
    experts, the mHC's `hc_next`) read: `kernel_weight` (the packed panels or bfloat16 tiles; None where the
    kernel does not take the weight), `kc` (the probed block size, None where none matches) and `is_tiles`.
    A cached strategy keeps its weight alive, so its address cannot be reused by another tensor while cached.
    `run(x2, weight)` takes the caller's weight view too: a view made again at the same address (a slice, under
    autograd a concatenation) carries its own autograd history and `requires_grad`, which the torch forms and the
    kernel's autograd check must read, never the cached view's."""

    kernel_weight: torch.Tensor | None = None
    kc: int | None = None
    is_tiles = False

    def __init__(self, weight: torch.Tensor):
        self.weight, self.version = weight, weight._version

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Plain(Product):
    """The rules off (`batch_invariant(False)`): torch's F.linear as is."""

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x2, weight)


class Padded(Product):
    """torch's F.linear, a call of fewer than `min_rows` rows zero-padded with one `F.pad` (host-side shape checks,
    no device sync)."""

    def __init__(self, weight: torch.Tensor, min_rows: int):
        super().__init__(weight)
        self.min_rows = min_rows

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, m = x2.shape[0], self.min_rows
        if n >= m:
            return self.full(x2, weight)
        return F.linear(F.pad(x2, (0, 0, 0, m - n)), weight)[:n]

    def full(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x2, weight)


class Blas(Padded):
    """`Padded`, a call of enough rows by torch's sgemm called directly where `blas_takes` the rows (`blas_matches`
    probed the weight: torch's bits, a recordable kernel call)."""

    def full(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exactness.blas_linear(x2, weight) if exactness.blas_takes(x2, weight) else F.linear(x2, weight)


class Rowwise(Product):
    """`rowwise_linear`: for a weight MKL gives a row other bits at another place of its call (`position_dependent`)."""

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exactness.rowwise_linear(x2, weight)


class Panels(Product):
    """The linear kernel over the weight's packed float panels at block size `kc` (`small_call_kc`), rows the kernel
    takes (`kernel_takes`); other rows (autograd, another dtype or device) by `fallback`."""

    def __init__(self, weight: torch.Tensor, kc: int, panels: torch.Tensor, fallback: Product):
        super().__init__(weight)
        self.kc, self.kernel_weight, self.fallback = kc, panels, fallback

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not exactness.kernel_takes(x2, weight, self.kc):
            return self.fallback.run(x2, weight)
        return exactness.matmul_kernel(x2, self.kernel_weight, weight.shape[0], self.kc)


class Fp8Panels(Panels):
    """`Panels`, a call of at most FP8_ROWS rows from the weight's FP8 panels (`pack_fp8`): the same bits, a quarter
    of the bytes read."""

    def __init__(self, weight: torch.Tensor, kc: int, panels: torch.Tensor, fp8: tuple, fallback: Product):
        super().__init__(weight, kc, panels, fallback)
        self.fp8 = fp8

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if exactness.kernel_takes(x2, weight, self.kc) and x2.shape[0] <= exactness.FP8_ROWS:
            return exactness.matmul_fp8(x2, self.fp8, weight.shape[0], self.kc)
        return super().run(x2, weight)


class Tiles(Product):
    """The linear kernel's `linear_bf16` over the weight's bfloat16 tiles (`pack_bf16`, on an AMX CPU) for every
    call it takes, whatever its rows; other rows by `fallback`. `kc`: the probed block size, if any (unused)."""

    is_tiles = True

    def __init__(self, weight: torch.Tensor, kc: int | None, tiles: torch.Tensor, fallback: Product):
        super().__init__(weight)
        self.kc, self.kernel_weight, self.fallback = kc, tiles, fallback

    def run(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not exactness.kernel_takes(x2, weight, self.kernel_weight):
            return self.fallback.run(x2, weight)
        return exactness.matmul_bf16(x2, self.kernel_weight, weight.shape[0])


_plans: dict[tuple, Product] = {}


def plan(weight: torch.Tensor) -> Product:
    """The `Product` of this weight view: `Plain` with the rules off; else made once and memoised by address and
    layout (~1 us a call instead of ~12 us for measuring keys each time). The panels and tiles are a copy (the
    weight's memory once more), made again when the weight was modified in place (its version counter)."""
    if not exactness.rules_on():
        return Plain(weight)
    key = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype, weight.is_cuda, torch.get_num_threads(),
           kernels.get("linear"))
    p = _plans.get(key)
    if p is None or p.version != weight._version:
        if len(_plans) >= 4096:  # weights replaced many times over (tests): start again
            _plans.clear()
        p = _plans[key] = _make_plan(weight)
    return p


def _make_plan(weight: torch.Tensor) -> Product:
    kc = exactness.small_call_kc(weight)
    positional = kc is None and exactness.position_dependent(weight)
    bf16 = exactness.pack_bf16(weight.detach().t()) if weight.dtype == torch.float32 and weight.dim() == 2 and \
        weight.device.type == "cpu" and exactness.amx_supported(kernels.get("linear")) else None
    panels = kc and bf16 is None
    fp8 = exactness.pack_fp8(weight.detach().t()) if panels and exactness.fp8_supported(kernels.get("linear")) else None
    packed = exactness.pack_panels(weight.detach().t()) if panels else None
    m = exactness.min_rows(weight)
    if positional:
        fallback = Rowwise(weight)
    elif kc is None and exactness.blas_matches(weight):
        fallback = Blas(weight, m)
    else:
        fallback = Padded(weight, m)
    if bf16 is not None:
        return Tiles(weight, kc, bf16, fallback)
    if fp8 is not None:
        return Fp8Panels(weight, kc, packed, fp8, fallback)
    if panels:
        return Panels(weight, kc, packed, fallback)
    return fallback


def pad_rows(weights: Iterable[torch.Tensor | None]) -> int:
    """The token count a microbatch is padded to so that no matmul by these weights (layers.py
    `matmul_weights` of a model; None: a weight as stored on the AMX tiles, which take any rows) pads its call."""
    return max((1 if w is None or exactness.small_call_kc(w) or (exactness.rules_on() and plan(w).is_tiles)
                else exactness.min_rows(w) for w in weights), default=exactness.MIN_ROWS)
