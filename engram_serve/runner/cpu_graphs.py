"""CPU graphs: a decode microbatch's forward recorded once as its kernel calls, then replayed as a loop.

On the CPU a decode forward is mostly Python (modules, shape checks, plans): ~2 ms at batch 1 around
~0.2 ms of kernels. Like a CUDA graph, a capture runs the forward once for real and records what it
runs: every C kernel call (model/capture.py), and the few torch operators that compute or write
(a TorchDispatchMode sees every operator). A replay makes the same calls in the same order on the same
memory, except for the step's inputs: a kernel argument that is an address inside one of the
capture's input tensors (`StepBatch` fields) is rebound to the same offset in this step's tensor. So a
replay computes what an eager forward on this step's inputs computes, bit for bit, provided the
forward's path depends only on the key (below) and its data reaches the kernels as arguments only.

The capture watches for what would break that and then keeps nothing (the key runs eagerly from then
on, named once in the log): an operator outside the few it can replay, one that reads or writes an
input tensor (its result would be the capture's), a host read of a tensor (`.item()`, control flow on
data), a kernel address inside two inputs. Host reads that bypass torch's dispatcher (numpy views,
`.tolist()` on CPU) cannot be seen: the serving forward has none on a decode step of the C path, and
the tests compare replays with eager forwards over random steps.

Key: the microbatch, the shape, strides and dtype of every input field, the block size, and the
addresses of the microbatch's persistent buffers, KV pools and rotary tables. The first use of a key
runs eagerly (lazy plans and packed weights are made then, outside a capture); the second captures;
later ones replay. A captured forward keeps its activations (its own memory, reused by each replay) and the
model's weights and packed panels alive; at most CAPACITY graphs are kept (least recently used go).
The weights must not change while graphs exist, as for CUDA graphs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import kernels
from ..model import capture, exactness
from ..model.context import ForwardContext

log = logging.getLogger(__name__)
aten = torch.ops.aten

_ALLOC = {aten.empty.memory_format, aten.empty_strided.default}
_PURE = {aten.mm.default, aten.addmm.default, aten.bmm.default}  # replayed into the captured result
_INPLACE = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar}  # replayed as they are


class Refused(Exception):
    pass


def _spans(ctx: ForwardContext) -> dict[str, tuple[int, int]]:
    """[start, end) addresses of every non-empty input tensor of the microbatch."""
    return {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for name, t in ctx.batch.fields().items() if isinstance(t, torch.Tensor) and t.numel()}


class _Watch(TorchDispatchMode):
    """Every torch operator of the forward: allocations and views kept alive, mm-like operators and
    in-place writes appended to the tape, anything else (or anything touching an input) refused."""

    guard = True  # a protection a test subclass turns off (negative control): every operator passes unrecorded

    def __init__(self, tape: list, spans: dict[str, tuple[int, int]]):
        super().__init__()
        self.tape, self.spans, self.keep, self.refused = tape, spans, [], None

    def _touches_input(self, tensors) -> str | None:
        for t in tensors:
            s = t.untyped_storage()
            lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
            for name, (a, b) in self.spans.items():
                if lo < b and a < hi:
                    return name
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.keep.append(out)
        if self.refused is not None or not self.guard or func in _ALLOC or func.is_view:
            return out
        if func not in _PURE and func not in _INPLACE:
            self.refused = f"operator {func}"
            return out
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        name = self._touches_input(tensors)
        if name is not None:
            self.refused = f"operator {func} on input {name!r}"
        elif func in _PURE:
            self.tape.append((lambda f=func, a=args, k=kwargs, o=out: o.copy_(f(*a, **k)), ()))
        else:
            self.tape.append((lambda f=func, a=args, k=kwargs: f(*a, **k), ()))
        return out


class _Graph:
    """One captured forward: its tape, where to rebind inputs, its output, and what it keeps alive."""

    def __init__(self, tape: list, spans: dict[str, tuple[int, int]], out: torch.Tensor, keep: list):
        self.out, self.keep = out, keep
        self.calls = []  # (fn, args, [(arg index, field name, offset)])
        for fn, args in tape:
            patches = []
            for i, a in enumerate(args):
                if type(a) is int and a >= 4096:  # an address, possibly inside an input tensor
                    inside = [(name, a - lo) for name, (lo, hi) in spans.items() if lo <= a < hi]
                    if len(inside) > 1:
                        raise Refused(f"a kernel address lies inside inputs {[n for n, _ in inside]}")
                    patches += [(i, *inside[0])] if inside else []
            self.calls.append((fn, args, patches))
        self.names = sorted({p[1] for _, _, ps in self.calls for p in ps})

    def replay(self, ctx: ForwardContext, rebind: bool = True) -> torch.Tensor:
        fields = ctx.batch.fields()
        ptrs = {name: fields[name].data_ptr() for name in self.names}
        for fn, args, patches in self.calls:
            if patches and rebind:
                args = list(args)
                for i, name, off in patches:
                    args[i] = ptrs[name] + off
            fn(*args)
        return self.out


class CpuGraphs:
    CAPACITY = 64
    rebind = True  # a protection a test subclass turns off (negative control): replays read the capture's inputs
    watch = _Watch

    @staticmethod
    def available() -> bool:
        """Whether the forward's C kernels are loaded (engram_serve/kernels.py): without them it runs torch's
        operators (and the attention plan reads the batch on the host), which a capture cannot replay."""
        return kernels.loaded(*kernels.CPU_GRAPHS_NEED)

    def __init__(self, model):
        self.model = model
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self._refused: set[tuple] = set()
        self.replays = 0

    def key(self, ctx: ForwardContext) -> tuple:
        b, bufs, rotary = ctx.batch, ctx.bufs, self.model.rotary
        layout = tuple((name, (tuple(t.shape), t.stride(), t.dtype)) for name, t in b.fields().items()
                       if isinstance(t, torch.Tensor)) + tuple(name for name, t in b.fields().items() if t is None)
        static = [bufs.staging, bufs.hash_ids, bufs.topk_idx, *bufs.scratch.values(), *ctx.kv.layer(0), rotary.cos,
                  rotary.sin]
        return (bufs.microbatch, b.block_size, layout, tuple(0 if t is None else t.data_ptr() for t in static))

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] of one decode microbatch (its staged rows in place): replayed,
        captured, or run eagerly (see the module docstring)."""
        key = self.key(ctx)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return graph.replay(ctx, self.rebind)
        if key in self._refused or key not in self._seen:
            self._seen.add(key)
            return self.model.forward_step(ctx)
        return self._capture(key, ctx)

    def _capture(self, key: tuple, ctx: ForwardContext) -> torch.Tensor:
        spans, tape = _spans(ctx), []
        watch = self.watch(tape, spans)
        with capture.recording(tape), watch:
            out = self.model.forward_step(ctx)
        try:
            if watch.refused is not None:
                raise Refused(watch.refused)
            pins = [exactness.live_plans(), list(self.model.parameters()), ctx.batch.fields()]
            graph = _Graph(tape, spans, out, watch.keep + pins)
        except Refused as e:
            self._refused.add(key)
            log.info("decode forward of microbatch %d with %d tokens runs eagerly: %s", ctx.bufs.microbatch,
                     ctx.batch.num_tokens, e)
            return out
        self._graphs[key] = graph
        if len(self._graphs) > self.CAPACITY:
            self._graphs.popitem(last=False)
        return out
