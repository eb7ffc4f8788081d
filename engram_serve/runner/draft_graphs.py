"""CPU graphs of the DSpark drafter (model/dspark.py): a `draft` call recorded once per row count, then replayed.

An eager draft of one row is mostly Python (~1.1 ms on an EPYC core for the built-in model's one draft layer, against
~0.1 ms of kernels), more than a whole decode step of the target (runner/cpu_graphs.py). As there, a capture runs
the draft once for real and records its C kernel calls and the few torch operators that compute or write (`_Watch`,
plus the few operators of `_EXTRA`, replayed into their captured results); a
replay makes the same calls on the same memory.

Inputs reach the graph through static buffers (CUDA graphs' way): the rows' last tokens, positions and block tables
are copied into the graph's own tensors, and everything else is computed from them inside the graph, by recorded
calls: the block's ids, its positions and rotary rows, and the context window's slots (`plan_window` at n - 1 for
each query: slots of n - W .. n - 1, a slot ok where it is not the zero slot, which is where `context_slots` gives
ok = False). So a replay computes what the eager `DSpark.draft` computes on the same inputs, bit for bit (the
tests compare them, null blocks included).

With the greedy pick (pick None) the Markov chain is in the graph too: a replay is the whole draft. With another
pick (a sampler's, which reads its logits on the host), the graph stops at the head's logits and the chain runs
eagerly (`DSpark.markov`).

Key: the row count, the block tables' width, the block size, whether the pick is greedy, the state's sizes and
addresses, the rope table's address, the loaded kernels, the exactness rules and the thread count. The first draft
of a key runs eagerly (plans and packed weights are made then), the second captures, later ones replay. A `Draft`
returned by a replay holds the graph's buffers: valid until the next draft of the same key (copy what must outlive it). The
drafter's and target's weights must not change while graphs exist.
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


class _Static:
    """One graph's input buffers: last [R] int64, positions [R] int64, tables [R, B] int64; and its constants:
    rows [N] (each query's row), offsets [R, k] (0 .. k - 1), minus [R, k] (-1 .. k - 2), noise ids [N], the
    first sublayer's stream mix [N, hc], bslots [N], eslots [N, k], picks [N, k] (DraftStep)."""

    def __init__(self, d: DSpark, state: DSparkState, r: int, width: int):
        k = d.block
        self.last, self.positions = torch.zeros(r, dtype=torch.int64), torch.zeros(r, dtype=torch.int64)
        self.tables = torch.full((r, width), -1, dtype=torch.int64)
        self.rows = torch.arange(r).repeat_interleave(k)
        self.offsets = torch.arange(k).expand(r, k).contiguous()
        self.minus = self.offsets - self.offsets - 1
        self.ids = torch.full((r, k), d.noise, dtype=torch.int64)
        self.mix = torch.zeros(r * k, d.config.hc_mult)
        self.mix[:, 0] = 1.0
        self.bslots = state.scratch + torch.arange(r * k)
        self.eslots = self.bslots.view(r, k).repeat_interleave(k, 0)
        self.picks = torch.arange(k).expand(r * k, k).contiguous()

    def load(self, last: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> None:
        self.last.copy_(last)
        self.positions.copy_(positions)
        self.tables.copy_(tables)


class DraftGraphs:
    """`draft` as `DSpark.draft` (same arguments but the target, given here; same bits), replayed from CPU graphs
    (module docstring). Falls back to the eager draft where the kernels a graph needs are not loaded, or a capture
    was refused."""

    CAPACITY = 32  # graphs kept, at most (the oldest go)
    reload = True  # a protection a test subclass turns off (negative control): replays read the capture's inputs

    def __init__(self, drafter: DSpark, target):
        self.drafter, self.target = drafter, target
        self._graphs: dict[tuple, tuple[_Graph, _Static]] = {}
        self._seen: set[tuple] = set()
        self._refused: set[tuple] = set()
        self.replays = self.captures = 0

    def key(self, state: DSparkState, r: int, tables: torch.Tensor, block_size: int, greedy_pick: bool) -> tuple:
        rope = self.drafter.rope
        return (r, tables.shape[1], block_size, greedy_pick, state.num_slots, state.max_rows,
                tuple(w.data_ptr() for w in state.window),
                rope.cos.data_ptr(), id(self.target), kernels.get("linear"), kernels.get("token"),
                exactness.rules_on(), torch.get_num_threads())

    def draft(self, state: DSparkState, last_tokens: torch.Tensor, positions: torch.Tensor,
              block_tables: torch.Tensor, block_size: int, pick: Pick | None = None) -> Draft:
        d, r = self.drafter, last_tokens.shape[0]
        if r > state.max_rows:
            raise StaticBufferError(f"DSparkState holds the block keys of {state.max_rows} rows; the draft has {r}")
        if not CpuGraphs.available() or torch.is_grad_enabled() or not r:
            return d.draft(self.target, state, last_tokens, positions, block_tables, block_size, pick)
        d.rope.ensure(int(positions.max()) + d.block)  # (the graph reads the table in place: its address is keyed)
        key = self.key(state, r, block_tables, block_size, pick is None)
        hit = self._graphs.get(key)
        if hit is None:
            if key in self._refused or key not in self._seen:
                self._seen.add(key)
                return d.draft(self.target, state, last_tokens, positions, block_tables, block_size, pick)
            return self._capture(key, state, last_tokens, positions, block_tables, block_size, pick)
        graph, static = hit
        self.replays += 1
        if self.reload:
            static.load(last_tokens, positions, block_tables)
        out = graph.replay({}, rebind=False)
        return out if pick is None else self._markov(out, static, pick)

    def _markov(self, out: tuple[torch.Tensor, torch.Tensor], static: _Static, pick: Pick) -> Draft:
        u, h = out
        return self.drafter.markov(u, h, static.last, ops_c, pick)

    def _body(self, state: DSparkState, s: _Static, block_size: int, greedy_pick: bool):
        """The recorded draft: the step planned from the static inputs, the block, the chain if greedy."""
        d, k = self.drafter, self.drafter.block
        s.ids[:, 0].copy_(s.last)
        pos = s.positions[:, None] + s.offsets  # [R, k]
        last_ctx = s.positions[:, None] + s.minus  # [R, k]: n - 1 for every query
        wslots, _, _ = ops_c.plan_window(last_ctx.view(-1), s.rows, s.tables, block_size, state.zero_slot, d.window)
        cos = ops_c.gather_rows(d.rope.cos, pos.view(-1))[:, 0]
        sin = ops_c.gather_rows(d.rope.sin, pos.view(-1))[:, 0]
        step = DraftStep(ops_c, cos, sin, wslots, wslots != state.zero_slot, s.bslots, s.eslots, s.picks, state)
        u, h = d.forward_block(self.target, step, s.ids.view(-1), s.mix)
        return d.markov(u, h, s.last, ops_c, greedy(ops_c)) if greedy_pick else (u, h)

    def _capture(self, key: tuple, state, last_tokens, positions, block_tables, block_size, pick) -> Draft:
        static = _Static(self.drafter, state, last_tokens.shape[0], block_tables.shape[1])
        static.load(last_tokens, positions, block_tables)
        tape: list = []
        watch = _DraftWatch(tape, {})
        with capture.recording(tape), watch:
            out = self._body(state, static, block_size, pick is None)
        try:
            if watch.refused is not None:
                raise Refused(watch.refused)
            graph = _Graph(tape, {}, out, [*watch.keep, static], sum(watch.allocated.values()))
        except Refused as why:
            self._refused.add(key)
            log.info("draft graph: %d rows draft eagerly (%s)", last_tokens.shape[0], why)
            return out if pick is None else self._markov(out, static, pick)
        self._graphs[key] = (graph, static)
        self.captures += 1
        while len(self._graphs) > self.CAPACITY:
            self._graphs.pop(next(iter(self._graphs)))
        return out if pick is None else self._markov(out, static, pick)
