"""CUDA graphs of decode microbatches, one per (microbatch, padded size), over static buffers (docs/contract.md §6).

Only decode-only steps are captured (every row has one query token, so the padded attention
layout is [size rows, 1 query, max_model_len keys]); other steps run eagerly over the same static
buffers. The hash and the Engram staging gather run before the replay, outside the graph: rows
come from host tables. Each replay reads the static inputs and staging rows in place, so a
capture stays valid as long as those buffers keep their data pointers, which is checked.
"""
from __future__ import annotations

import torch

from ..errors import StaticBufferError
from ..model.context import ForwardContext


class CudaGraphs:
    def __init__(self, model, max_seq_len: int):
        self.model, self.max_seq_len = model, max_seq_len
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, int], torch.Tensor]] = {}

    @staticmethod
    def _ptrs(ctx: ForwardContext) -> dict[str, int]:
        b = ctx.batch
        out = {name: t.data_ptr() for name, t in b.fields().items() if isinstance(t, torch.Tensor)}
        out["staging"] = ctx.bufs.staging.data_ptr()
        return out

    def static_context(self, ctx: ForwardContext) -> ForwardContext:
        """The same context with the fixed shape bounds a captured graph needs (no host reads)."""
        return ForwardContext(ctx.batch, ctx.kv, ctx.bufs, ctx.engram_rows, None, max_query_len=1,
                              max_seq_len=self.max_seq_len)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [size, hidden] of one decode microbatch: captured on first use, replayed after."""
        ctx = self.static_context(ctx)
        key = (ctx.bufs.microbatch, ctx.batch.num_tokens)
        entry = self._graphs.get(key)
        if entry is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy inits)
                self.model.forward_step(ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.forward_step(ctx)
            entry = self._graphs[key] = (graph, self._ptrs(ctx), out)
        graph, ptrs, out = entry
        now = self._ptrs(ctx)
        moved = [k for k in ptrs if now.get(k) != ptrs[k]]
        if moved:
            raise StaticBufferError(f"graph of microbatch {key[0]} at padded size {key[1]}: static buffer(s) "
                                    f"{moved} changed address since capture")
        graph.replay()
        return out
