"""CPU graphs: a microbatch's DeepSeek-V4.1 layers recorded once as their kernel calls, then replayed.

What replays (`takes`): decode steps (one token a row), and a step of one row of at most MAX_PROMPT_TOKENS
tokens run whole (a lone prompt, or a chunk of one). Other steps vary too much from one to the next to
replay often. A decode step's graph ends with the head (`forward(..., logits=r)`): its logits are the graph's.

On the CPU a decode forward is mostly Python (modules, checks, plans, tensor wrappers): ~8 ms at batch 1
around ~1.5 ms of kernels for the built-in model. Like a CUDA graph, a capture runs the layers once for real
and records what they run: every C kernel call (model/capture.py) and the few torch operators that compute
or write (a TorchDispatchMode sees every operator). A replay makes the same calls in the same order on the
same memory, except for the step's inputs: a kernel argument that is an address inside one of the
capture's per-step tensors (the `StepBatch` fields, and the microbatch's rows and block tables, which
`plan_rows` makes eagerly every step, or inputs/decode.py writes in place) is rebound to the same offset in
this step's tensor (a decode step's inputs keep their addresses, so its calls are bound once and kept); the
calls run in one C loop (the token kernel's `call_all`), those of kernels with a raw entry from
their argument structs packed once as 64-bit slots, one a named field (`_Graph`; model/capture.py records a
call made with keyword arguments in field order). The slot plan and the rotary lookups are made from
them inside the graph, by the recorded calls of `DeepseekV41.prepare`.
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
CAPACITY graphs and MAX_BYTES of activations are kept (least recently used go). The weights must not change
while graphs exist, as for CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import logging
import struct
from collections import OrderedDict

import numpy as np
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
    return name in _READ


_READ = {"rows", "tables", *(f"batch.{k}" for k in FORWARD_FIELDS)}
_FORWARD_NAMES = tuple((f"batch.{k}", k) for k in FORWARD_FIELDS)


def forward_inputs(ctx: ForwardContext, rows: torch.Tensor, tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-step tensors of `step_inputs` that the forward reads (`read_by_forward`): what a key and a replay
    look at."""
    out = {"rows": rows, "tables": tables}
    for name, k in _FORWARD_NAMES:
        t = getattr(ctx.batch, k)
        if isinstance(t, torch.Tensor):
            out[name] = t
    return out


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
        self.allocated: dict[int, int] = {}  # storage address -> bytes, of every tensor an operator made

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
        if isinstance(out, torch.Tensor) and not func.is_view and func not in _INPLACE:
            self.allocated[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
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


def _raw_entries() -> dict:
    """{kernel function: kernels.RawKernel (its fields ((name, kind), ...) in order, its raw entry address)} of the
    loaded kernels' raw entries (`kernels.raw_kernels`): the calls a replay makes from their argument structs, one
    64-bit slot a field, without the interpreter."""
    out = {}
    for name in ("token", "linear"):
        out.update({getattr(kernels.get(name), fn): raw for fn, raw in kernels.raw_kernels(name).items()})
    return out


def _slots(fields: tuple, args: tuple) -> list[int]:
    """args (in field order, as model/capture.py records them) as the kernel's argument struct, one 64-bit slot a
    field: an address or size as an integer (two's complement), a flag as 0 or 1, a real as a double's bits."""
    return [struct.unpack("<Q", struct.pack("<d", a))[0] if kind == "real" else
            int(bool(a)) if kind == "flag" else int(a) & _U64 for (_, kind), a in zip(fields, args)]


_U64 = (1 << 64) - 1


class _Graph:
    """One captured forward: its calls, where to rebind per-step addresses, its output (hidden, the features buffer
    or None), what it keeps alive.
    A call of a kernel with a raw entry replays from its argument struct (64-bit slots, one a field) (one array for the graph, its
    per-step addresses rewritten in place); the others through their Python form."""

    def __init__(self, tape: list, spans: dict[str, tuple[int, int]], out: torch.Tensor, keep: list, nbytes: int):
        self.out, self.keep = out, keep
        self.nbytes = nbytes  # the memory its capture allocated, which it keeps alive
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
        raw, slots, at = _raw_entries(), [], []  # at: per call, its first slot (or None)
        for fn, args, _ in self.calls:
            entry = raw.get(fn)
            at.append(len(slots) if entry is not None and len(entry.fields) == len(args) else None)
            if at[-1] is not None:
                slots += _slots(entry.fields, args)
        self.slots = np.array(slots, dtype=np.uint64)
        base = self.slots.ctypes.data
        self._raw = [None if k is None else (fn, raw[fn].entry, base + 8 * k) for (fn, _, _), k in zip(self.calls, at)]
        idx = [(at[c] + i, self.names.index(name), off) for c, (_, _, ps) in enumerate(self.calls) if at[c] is not None
               for i, name, off in ps]
        self._slot_at, self._slot_name, self._slot_off = (np.array(v, dtype=np.int64) for v in zip(*idx)) if idx \
            else (np.zeros(0, np.int64),) * 3
        self._captured = self.slots[self._slot_at]  # (a copy)
        self._bound: tuple[tuple | None, list] = (None, [])  # (the addresses, the calls with them) of the last replay

    def replay(self, tensors: dict[str, torch.Tensor], rebind: bool = True) -> torch.Tensor:
        ptrs = tuple(tensors[name].data_ptr() for name in self.names) if rebind else None
        if ptrs != self._bound[0] or not self._bound[1]:  # (a decode step's inputs keep their addresses)
            at = dict(zip(self.names, ptrs or ()))
            if len(self._slot_at):  # (without rebinding: the capture's addresses)
                self.slots[self._slot_at] = self._captured if not rebind else \
                    (np.array(ptrs, dtype=np.int64)[self._slot_name] + self._slot_off).astype(np.uint64)
            calls = []
            for (fn, args, patches), raw in zip(self.calls, self._raw):
                if raw is not None:
                    calls.append(raw)
                    continue
                if patches and rebind:
                    args = list(args)
                    for i, name, off in patches:
                        args[i] = at[name] + off
                    args = tuple(args)
                calls.append((fn, args))
            self._bound = (ptrs, calls)
        kernels.get("token").call_all(self._bound[1])  # fn(*args) or raw(slots) for each, in order
        return self.out


class CpuGraphs:
    CAPACITY = 64  # graphs kept, at most
    MAX_BYTES = 256 << 20  # activations kept by all graphs, at most (a 256-token prompt's graph keeps ~45 MiB)
    MAX_PROMPT_TOKENS = 256  # a step of one row replays up to this many tokens; a decode step, any number
    rebind = True  # a protection a test subclass turns off (negative control): replays read the capture's inputs
    watch = _Watch

    def __len__(self) -> int:
        """The graphs kept (`nbytes`: the memory their captures allocated)."""
        return len(self._graphs)

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
        self.replays = self.captures = self.nbytes = 0
        self._owners, self._static = None, ()  # what `_addresses` last worked out, and from which objects
        self._last_inputs: tuple = ((), ())  # what `_layout` last worked out, and from which tensors
        # A capture's TorchDispatchMode imports torch._dynamo at its first use, ~1 s: here, as the engine starts,
        # not inside the first request's steps (docs/benchmarks.md, "the first request").
        import torch._dynamo  # noqa: F401

    def takes(self, batch, microbatches: int) -> bool:
        """Whether a step cut into `microbatches` runs through graphs: a decode step (one token a row), or one
        row (a prompt or a chunk of one) of at most MAX_PROMPT_TOKENS tokens run whole (a cut one interleaves its
        microbatches, which replays would not). Other steps vary too much to replay often."""
        lone = microbatches == 1 and batch.num_rows == 1 and batch.qsl_host[1] <= self.MAX_PROMPT_TOKENS
        return lone or batch.decode_only

    def key(self, ctx: ForwardContext, tensors: dict[str, torch.Tensor]) -> tuple:
        b, bufs, m = ctx.batch, ctx.bufs, self.model
        return (bufs.microbatch, b.block_size, ctx.max_seq_len, ctx.capture_features, self._layout(tensors),
                self._addresses(bufs, ctx.kv), id(m), kernels.get("linear"), kernels.get("token"), exactness.rules_on(), torch.get_num_threads())

    def _layout(self, tensors: dict[str, torch.Tensor]) -> tuple:
        """(name, shape, strides, dtype) of every per-step tensor the forward reads; worked out again only when
        one of them is another tensor object (kept alive here, so that its id is not reused) than last time."""
        ts = tuple(tensors.items())
        if len(ts) != len(self._last_inputs[0]) or any(
                a is not b or n != m for (n, a), (m, b) in zip(ts, self._last_inputs[0])):
            layout = tuple((name, tuple(t.shape), t.stride(), t.dtype) for name, t in ts if read_by_forward(name))
            self._last_inputs = (ts, layout)
        return self._last_inputs[1]

    def _addresses(self, bufs, kv) -> tuple[int, ...]:
        """The addresses of the microbatch's persistent buffers, the cache's pools and the rope tables; worked
        out again only when one of these objects is another one (a tensor keeps its address while it lives)."""
        m = self.model
        owners = (bufs, kv, m.rope_plain.cos, m.rope_comp.cos)
        if self._owners is None or any(a is not b for a, b in zip(owners, self._owners)):
            pools = [*kv.window, *kv.entries.values(), *kv.index_keys.values(), *kv.open.values()]
            static = [bufs.staging, bufs.topk_idx, bufs.candidates, *pools, *owners[2:]]
            self._owners, self._static = owners, tuple(t.data_ptr() for t in static)
        return self._static

    def forward(self, ctx: ForwardContext, planned: tuple[torch.Tensor, torch.Tensor] | None = None,
                logits: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of one microbatch `takes` (its staged rows in place): replayed, captured
        (the second time a key is seen) or run eagerly. With `ctx.capture_features`, the drafter's features
        [T, nL D] go to `ctx.features` (a replay's: the graph's own buffer, an output beside the hidden). The
        step's slot plan and rotary lookups are made by kernel calls inside the graph, from its rows and tables.
        `planned`: `plan_rows(ctx)` where the caller made it, with ctx.max_seq_len the `bound` of its positions.
        `logits` = r: the logits [r, vocab] of the first r tokens instead (the model's `compute_logits`, its
        kernel call inside the graph; a replay's: the graph's own buffer, valid until its next replay)."""
        outer = ctx  # (which gets the features)
        if planned is None:
            b = ctx.batch
            ctx = dataclasses.replace(ctx, max_seq_len=bound(int(b.positions.max()) if b.num_tokens else 0,
                                                             self.limit))
            planned = plan_rows(ctx)
        rows, tables = planned
        tensors = forward_inputs(ctx, rows, tables)
        key = (self.key(ctx, tensors), logits)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            hidden, features = graph.replay(tensors, self.rebind)
        else:
            layers = self._layers(ctx, rows, tables, logits)
            if key in self._refused or key not in self._seen:
                self._seen.add(key)
                hidden, features = run_stages(layers)
            else:
                hidden, features = self._capture(key, layers, step_inputs(ctx, rows, tables))
        if ctx.capture_features:
            outer.features = features  # (the graph's own buffer: valid until the next replay)
        return hidden

    def _layers(self, ctx: ForwardContext, rows: torch.Tensor, tables: torch.Tensor, logits: int | None):
        """The forward as stages -> (hidden or the first `logits` tokens' logits, the features [T, nL D] or None);
        `prepare` runs when they start, so that a capture records its kernel calls."""
        step = self.model.prepare(ctx, (rows, tables))
        if ctx.capture_features:
            step.capture = tuple(self.model.config.dspark.dspark_target_layer_ids)
        hidden = yield from self.model.forward_stages(ctx.batch.input_ids, ctx.batch.dead, step, ctx.engram_rows)
        return (hidden if logits is None else self.model.compute_logits(hidden[:logits])), step.features

    def _capture(self, key: tuple, layers, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        tape: list = []
        spans = _spans(tensors)
        watch = self.watch(tape, spans)
        with capture.recording(tape), watch:
            out = run_stages(layers)
        try:
            if watch.refused is not None:
                raise Refused(watch.refused)
            graph = _Graph(tape, spans, out, watch.keep, sum(watch.allocated.values()))
        except Refused as why:
            self._refused.add(key)
            log.info("CPU graph: a microbatch of %d tokens runs eagerly (%s)", out[0].shape[0], why)
            return out
        self._graphs[key] = graph
        self.captures += 1
        self.nbytes += graph.nbytes
        while len(self._graphs) > self.CAPACITY or (self.nbytes > self.MAX_BYTES and len(self._graphs) > 1):
            self.nbytes -= self._graphs.popitem(last=False)[1].nbytes
        return out
