"""CPU graphs: a decode microbatch's DeepSeek-V4.1 layers recorded once as their kernel calls, then replayed.

On the CPU a decode forward is mostly Python (modules, checks, plans, tensor wrappers): ~8 ms at batch 1
around ~1.5 ms of kernels for the built-in model. Like a CUDA graph, a capture runs the layers once for real
and records what they run: every C kernel call (model/capture.py) and the few torch operators that compute
or write (a TorchDispatchMode sees every operator). A replay makes the same calls in the same order on the
same memory, except for the step's inputs: a kernel argument that is an address inside one of the
capture's per-step tensors (the `StepBatch` fields, and the microbatch's rows and block tables, which
`plan_rows` makes eagerly every step) is rebound to the same offset in this step's tensor. The slot plan
and the rotary lookups are made from them inside the graph, by the recorded calls of `DeepseekV41.prepare`.
So a replay computes what an eager forward on this step's inputs computes, bit for bit, provided the
forward's path depends only on the key (below) and its data reaches the kernels as arguments only.

The capture watches for what would break that and then keeps nothing (the key runs eagerly from then on,
named once in the log): an operator outside the few it can replay, one that reads or writes a per-step
tensor (its result would be the capture's), a host read of a tensor (`.item()`; code that reads on the
host in a way torch does not see says so through `capture.refuse`, as the MoE's per-expert loop does
where its one-call form cannot run), a kernel address inside two per-step tensors.

Key: the microbatch, the shape, strides and dtype of every per-step tensor the forward reads, the block
size, the bound (below), the addresses of the microbatch's persistent buffers, of the cache's pools and
of the rope tables, the loaded kernels and the exactness rules. The width of a step's entry plan grows
with its longest request, so the runner gives the forward a static bound (`bound`: the longest position
rounded up to a power of two; the block tables are as wide as the bound's blocks): the same key for every
step of a decode until a request crosses the bound. The first use of a key runs eagerly (plans and packed
weights are made then, outside a capture); the second captures; later ones replay. A captured graph keeps its
activations (its own memory, reused by each replay) and the model's packed weights alive; at most
CAPACITY graphs are kept (least recently used go). The weights must not change while graphs exist, as for
CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import kernels
from ..model import capture, exactness
from ..model.context import ForwardContext
from ..model.deepseek_v41 import plan_rows, run_stages

log = logging.getLogger(__name__)
aten = torch.ops.aten

_ALLOC = {aten.empty.memory_format, aten.empty_strided.default}
_ZEROS = {aten.zeros.default}  # replayed as a zero_ of the captured result
_PURE = {aten.mm.default: torch.mm, aten.addmm.default: torch.addmm}  # replayed into the captured result (out=)
_INPLACE = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar}  # replayed as they are
MIN_BOUND = 64


class Refused(Exception):
    pass


def bound(max_position: int, limit: int) -> int:
    """A static bound on the positions a step reaches: max_position + 1 rounded up to a power of two (at least
    MIN_BOUND), at most `limit`."""
    b = MIN_BOUND
    while b < max_position + 1:
        b *= 2
    return max(min(b, limit), max_position + 1)


FORWARD_FIELDS = ("input_ids", "dead", "positions", "slot_mapping")  # the batch fields the forward reads


def step_inputs(ctx: ForwardContext, rows: torch.Tensor, tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every per-step tensor of a microbatch forward, by name: its batch fields and its rows and tables
    (`plan_rows`). The forward reads the FORWARD_FIELDS, the rows and the tables (`read_by_forward`); a capture
    whose calls point into another one is refused."""
    out = {"rows": rows, "tables": tables}
    out.update({f"batch.{k}": t for k, t in ctx.batch.fields().items() if isinstance(t, torch.Tensor)})
    return out


def read_by_forward(name: str) -> bool:
    return not name.startswith("batch.") or name.removeprefix("batch.") in FORWARD_FIELDS


def _spans(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """[start, end) of every non-empty per-step tensor's memory; a tensor sharing another's memory exactly is
    named once (the plan's positions are the batch's)."""
    spans, seen = {}, set()
    for name, t in tensors.items():
        if not t.numel():
            continue
        span = (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        if span not in seen:
            seen.add(span)
            spans[name] = span
    return spans


class _Watch(TorchDispatchMode):
    """Every torch operator of the layers: allocations and views kept alive, mm-like operators and in-place
    writes appended to the tape, anything else (or anything touching a per-step tensor) refused."""

    guard = True  # a protection a test subclass turns off (negative control): every operator passes unrecorded

    def __init__(self, tape: list, spans: dict[str, tuple[int, int]]):
        super().__init__()
        self.tape, self.spans, self.keep, self.refused = tape, spans, [], None

    def _touches_step(self, tensors) -> str | None:
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
        if func in _ZEROS:
            self.tape.append((lambda o=out: o.zero_(), ()))
            return out
        if func not in _PURE and func not in _INPLACE:
            self.refused = f"operator {func}"
            return out
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        name = self._touches_step(tensors)
        if name is not None:
            self.refused = f"operator {func} on the per-step tensor {name!r}"
        elif func in _PURE:
            self.tape.append((lambda f=_PURE[func], a=args, k=kwargs, o=out: f(*a, **k, out=o), ()))
        else:
            self.tape.append((lambda f=func, a=args, k=kwargs: f(*a, **k), ()))
        return out


class _Graph:
    """One captured forward: its calls, where to rebind per-step addresses, its output, what it keeps alive."""

    def __init__(self, tape: list, spans: dict[str, tuple[int, int]], out: torch.Tensor, keep: list):
        self.out, self.keep = out, keep
        self.calls = []  # (fn, args, [(arg index, tensor name, offset)])
        for fn, args in tape:
            if fn is None:
                raise Refused(args)  # capture.refuse
            patches = []
            for i, a in enumerate(args):
                if type(a) is int and a >= 4096:  # an address, possibly inside a per-step tensor
                    inside = [(name, a - lo) for name, (lo, hi) in spans.items() if lo <= a < hi]
                    if len(inside) > 1:
                        raise Refused(f"a kernel address lies inside per-step tensors {[n for n, _ in inside]}")
                    if inside and not read_by_forward(inside[0][0]):
                        raise Refused(f"a kernel reads {inside[0][0]}, which the key does not cover")
                    patches += [(i, *inside[0])] if inside else []
            self.calls.append((fn, args, patches))
        self.names = sorted({p[1] for _, _, ps in self.calls for p in ps})

    def replay(self, tensors: dict[str, torch.Tensor], rebind: bool = True) -> torch.Tensor:
        ptrs = {name: tensors[name].data_ptr() for name in self.names}
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
        """Whether the C kernels a decode forward needs are loaded: without them it runs torch's operators,
        which a capture cannot replay."""
        return kernels.loaded(*kernels.CPU_GRAPHS_NEED)

    def __init__(self, model, max_model_len: int):
        self.model, self.limit = model, max_model_len
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self._refused: set[tuple] = set()
        self.replays = self.captures = 0

    def key(self, ctx: ForwardContext, tensors: dict[str, torch.Tensor]) -> tuple:
        b, bufs, kv, m = ctx.batch, ctx.bufs, ctx.kv, self.model
        layout = tuple((name, tuple(t.shape), t.stride(), t.dtype) for name, t in tensors.items()
                       if read_by_forward(name))
        pools = [*kv.window, *kv.entries.values(), *kv.index_keys.values(), *kv.open.values()]
        static = [bufs.staging, bufs.topk_idx, bufs.candidates, *pools, m.rope_plain.cos, m.rope_comp.cos]
        return (bufs.microbatch, b.block_size, ctx.max_seq_len, layout, tuple(t.data_ptr() for t in static),
                id(m), kernels.get("linear"), kernels.get("token"), exactness.rules_on(), torch.get_num_threads())

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] of one decode microbatch (its staged rows in place): replayed, captured
        (the second time a key is seen) or run eagerly. The step's slot plan and rotary lookups are made by
        kernel calls inside the graph, from its rows and tables."""
        b = ctx.batch
        ctx = dataclasses.replace(ctx, max_seq_len=bound(int(b.positions.max()) if b.num_tokens else 0, self.limit))
        rows, tables = plan_rows(ctx)
        tensors = step_inputs(ctx, rows, tables)
        key = self.key(ctx, tensors)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return graph.replay(tensors, self.rebind)
        layers = self._layers(ctx, rows, tables)
        if key in self._refused or key not in self._seen:
            self._seen.add(key)
            return run_stages(layers)
        return self._capture(key, layers, tensors)

    def _layers(self, ctx: ForwardContext, rows: torch.Tensor, tables: torch.Tensor):
        """The forward as stages; `prepare` runs when they start, so that a capture records its kernel calls."""
        step = self.model.prepare(ctx, (rows, tables))
        return (yield from self.model.forward_stages(ctx.batch.input_ids, ctx.batch.dead, step, ctx.engram_rows))

    def _capture(self, key: tuple, layers, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        tape: list = []
        spans = _spans(tensors)
        watch = self.watch(tape, spans)
        with capture.recording(tape), watch:
            out = run_stages(layers)
        try:
            if watch.refused is not None:
                raise Refused(watch.refused)
            graph = _Graph(tape, spans, out, watch.keep)
        except Refused as why:
            self._refused.add(key)
            log.info("CPU graph: a decode microbatch of %d tokens runs eagerly (%s)", out.shape[0], why)
            return out
        self._graphs[key] = graph
        self.captures += 1
        while len(self._graphs) > self.CAPACITY:
            self._graphs.popitem(last=False)
        return out
