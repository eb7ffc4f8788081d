"""CPU graphs of the DSpark drafter (model/dspark.py): its `draft` and `write_context` calls recorded once per
shape, then replayed.

An eager draft of one row is mostly Python (~1.1 ms on an EPYC core for the built-in model's one draft layer, against
~0.2 ms of kernels), more than a whole decode step of the target (runner/cpu_graphs.py). As there, a capture runs
the call once for real and records its C kernel calls and the few torch operators that compute or write (`_Watch`,
and the operators of `_EXTRA`, replayed into their captured results); a replay makes the same calls on the same
memory.

Inputs reach a graph through static buffers (CUDA graphs' way): a draft's last tokens, positions and block tables
(`write_context`'s features, positions and slots) are copied into the graph's own tensors, and everything else is
computed from them inside the graph by recorded calls: the block's ids, its positions and rotary rows, and the
context window's slots (`plan_window` at n - 1 for each query: the slots of n - W .. n - 1, ok where a slot is not
the zero slot, which is where `context_slots` says not ok). So a replay computes what the eager call computes on
the same inputs, bit for bit (tests/test_draft_graphs.py, null blocks included).

With the greedy pick (pick None) the Markov chain is in the graph too: a replay is the whole draft. With another
pick (a sampler's, which reads its logits on the host), the graph stops at the head's logits and the chain runs
eagerly (`DSpark.markov`).

Key: the call, its inputs' shapes and dtypes, the block size, whether the pick is greedy, the state's sizes and
addresses, the rope table's address, the loaded kernels, the exactness rules and the thread count. The first call
of a key runs eagerly (plans and packed weights are made then), the second captures, later ones replay. A `Draft`
returned by a replay holds the graph's buffers: valid until the next draft of the same key (copy what must outlive
it). The drafter's and target's weights must not change while graphs exist.
"""
from __future__ import annotations

import logging

import torch

from .. import kernels
from ..errors import StaticBufferError
from ..model import capture, exactness, ops_c
from ..model.dspark import Draft, DraftStep, DSpark, DSparkState, Pick, greedy
from .cpu_graphs import CpuGraphs, Refused, _Graph, _Watch

log = logging.getLogger(__name__)
aten = torch.ops.aten

# operators replayed into their captured result o: the slot plan's and the Markov chain's `+` and `!=`, the product of
# a narrow weight (exactness.rowwise_linear's `*` and sum), a strided slice made contiguous
_EXTRA = {aten.add.Tensor: lambda a, k, o: torch.add(*a, **k, out=o),
          aten.ne.Scalar: lambda a, k, o: torch.ne(*a, out=o), aten.mul.Tensor: lambda a, k, o: torch.mul(*a, out=o),
          aten.sum.dim_IntList: lambda a, k, o: torch.sum(*a, **k, out=o),
          aten.clone.default: lambda a, k, o: o.copy_(a[0])}


class _DraftWatch(_Watch):
    """`_Watch`, with the elementwise operators of `_EXTRA` replayed too (out= their captured result)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _EXTRA or not self.guard or self.refused is not None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        self.keep.append(out)
        self.allocated[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        self.tape.append((lambda f=_EXTRA[func], a=args, k=kwargs or {}, o=out: f(a, k, o), ()))
        return out


class _Inputs:
    """A graph's input buffers, copies of the capture's input tensors; `load` copies a call's inputs into them."""

    def __init__(self, *tensors: torch.Tensor):
        self.bufs = [t.clone() for t in tensors]

    def load(self, *tensors: torch.Tensor) -> None:
        for b, t in zip(self.bufs, tensors):
            b.copy_(t)


class _Consts:
    """A draft graph's constants for R rows of k: rows [N] (each query's row), offsets [R, k] (0 .. k - 1), minus
    [R, k] (-1), the block's ids [R, k] (noise after the first), the first sublayer's stream mix [N, hc], and the
    DraftStep's block keys (`DSpark.block_keys`)."""

    def __init__(self, d: DSpark, state: DSparkState, r: int):
        k = d.block
        self.rows = torch.arange(r).repeat_interleave(k)
        self.offsets = torch.arange(k).expand(r, k).contiguous()
        self.minus = torch.full((r, k), -1, dtype=torch.int64)
        self.ids = torch.full((r, k), d.noise, dtype=torch.int64)
        self.mix = torch.zeros(r * k, d.config.hc_mult)
        self.mix[:, 0] = 1.0
        self.keys = d.block_keys(state, r, "cpu")  # (bslots, eslots, picks)


class DraftGraphs:
    """`draft` and `write_context` as the drafter's (same arguments, the target given here; same bits), replayed
    from CPU graphs (module docstring). Eager where the kernels a graph needs are not loaded, under autograd, or
    where a capture was refused."""

    CAPACITY = 64  # graphs kept, at most (the oldest go)
    reload = True  # a protection a test subclass turns off (negative control): replays read the capture's inputs

    def __init__(self, drafter: DSpark, target):
        self.drafter, self.target = drafter, target
        self._graphs: dict[tuple, tuple[_Graph, _Inputs, object]] = {}
        self._seen: set[tuple] = set()
        self._refused: set[tuple] = set()
        self.replays = self.captures = 0

    def _key(self, state: DSparkState, tensors: tuple, *extra) -> tuple:
        return (*extra, tuple((tuple(t.shape), t.dtype) for t in tensors), state.num_slots, state.max_rows,
                tuple(w.data_ptr() for w in state.window), self.drafter.rope.cos.data_ptr(), id(self.target),
                kernels.get("linear"), kernels.get("token"), exactness.rules_on(), torch.get_num_threads())

    def _eager(self) -> bool:
        return not CpuGraphs.available() or torch.is_grad_enabled()

    def draft(self, state: DSparkState, last_tokens: torch.Tensor, positions: torch.Tensor,
              block_tables: torch.Tensor, block_size: int, pick: Pick | None = None) -> Draft:
        d, r = self.drafter, last_tokens.shape[0]
        if r > state.max_rows:
            raise StaticBufferError(f"DSparkState holds the block keys of {state.max_rows} rows; the draft has {r}")
        if self._eager() or not r:
            return d.draft(self.target, state, last_tokens, positions, block_tables, block_size, pick)
        d.rope.ensure(int(positions.max()) + d.block)  # (the graph reads the table in place: its address is keyed)
        inputs = (last_tokens, positions, block_tables)
        key = self._key(state, inputs, "draft", block_size, pick is None)
        out, inputs = self._run(key, inputs, lambda: _Consts(d, state, r),
                                lambda i, c: self._draft_body(state, i, c, block_size, pick is None),
                                lambda: d.draft(self.target, state, last_tokens, positions, block_tables, block_size,
                                                pick))
        if inputs is None or pick is None:
            return out
        u, h = out
        return d.markov(u, h, inputs.bufs[0], ops_c, pick)

    def write_context(self, state: DSparkState, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> None:
        d, t = self.drafter, features.shape[0]
        if self._eager() or not t:
            return d.write_context(state, features, positions, slots)
        d.rope.ensure(int(positions.max()) + 1)
        key = self._key(state, (features, positions, slots), "context")
        top = d.rope.cos.shape[0]
        self._run(key, (features, positions, slots), lambda: None,
                  lambda i, c: d.write_context(state, *i.bufs, top=top),
                  lambda: d.write_context(state, features, positions, slots))

    def _draft_body(self, state: DSparkState, i: _Inputs, c: _Consts, block_size: int, greedy_pick: bool):
        """The recorded draft: the step planned from the input buffers, the block, the chain if greedy."""
        d = self.drafter
        last, positions, tables = i.bufs
        c.ids[:, 0].copy_(last)
        pos = positions[:, None] + c.offsets  # [R, k]
        wslots, _, _ = ops_c.plan_window((positions[:, None] + c.minus).view(-1), c.rows, tables, block_size,
                                         state.zero_slot, d.window)  # at n - 1 for every query: n - W .. n - 1
        cos = ops_c.gather_rows(d.rope.cos, pos.view(-1))[:, 0]
        sin = ops_c.gather_rows(d.rope.sin, pos.view(-1))[:, 0]
        step = DraftStep(ops_c, cos, sin, wslots, wslots != state.zero_slot, *c.keys, state)
        u, h = d.forward_block(self.target, step, c.ids.view(-1), c.mix)
        return d.markov(u, h, last, ops_c, greedy(ops_c)) if greedy_pick else (u, h)

    def _run(self, key: tuple, tensors: tuple, consts, body, eager):
        """(the output, the graph's inputs or None where it ran eagerly): replayed, captured (the second time a key
        is seen: `body(inputs, consts())` recorded) or `eager()`."""
        hit = self._graphs.get(key)
        if hit is not None:
            graph, inputs, _ = hit
            self.replays += 1
            if self.reload:
                inputs.load(*tensors)
            return graph.replay({}, rebind=False), inputs
        if key in self._refused or key not in self._seen:
            self._seen.add(key)
            return eager(), None
        inputs, c = _Inputs(*tensors), consts()
        tape: list = []
        watch = _DraftWatch(tape, {})
        with capture.recording(tape), watch:
            out = body(inputs, c)
        try:
            if watch.refused is not None:
                raise Refused(watch.refused)
            graph = _Graph(tape, {}, out, watch.keep, sum(watch.allocated.values()))
        except Refused as why:
            self._refused.add(key)
            log.info("draft graph: %s runs eagerly (%s)", key[:2], why)
            return out, inputs
        self._graphs[key] = (graph, inputs, c)
        self.captures += 1
        while len(self._graphs) > self.CAPACITY:
            self._graphs.pop(next(iter(self._graphs)))
        return out, inputs
