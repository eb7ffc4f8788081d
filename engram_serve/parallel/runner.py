"""The tensor-parallel model runner: the same `ModelRunner` on every rank, over that rank's shard.

Rank 0 owns the scheduler. Before each step it broadcasts the step's small host arrays (the StepBatch
fields, the microbatch bounds, whether to record) to every rank; every rank then runs the same
`execute` on its shard, so all ranks launch the same collectives in the same order. Each microbatch
owns two communication buffers (`scratch[COMM]`, room for `world` partials of its widest per-layer
sum, and `scratch[COMM_ENGRAM]` for the one sum of every Engram layer's projection, launched at the
start of the forward): a collective in flight belongs to its microbatch until it is awaited
(parallel/collectives.py).

Without CUDA graphs: under tensor parallelism steps run eagerly (static buffers and padding still
apply); capturing collectives into graphs is left out.
"""
from __future__ import annotations

import numpy as np
import torch

from ..inputs.batch import StepBatch
from ..model.loader import LoadedModel
from ..runner.model_runner import ModelRunner, RunnerConfig, StepOutput
from .collectives import COMM, COMM_ENGRAM
from .group import ParallelError, ParallelGroup


def pack_batch(batch: StepBatch) -> dict:
    """The StepBatch as host arrays (what rank 0 broadcasts)."""
    out = {}
    for name, v in batch.fields().items():
        out[name] = (v.device.type, v.cpu().numpy()) if isinstance(v, torch.Tensor) else v
    return out


def unpack_batch(packed: dict, device: torch.device) -> StepBatch:
    kw = {}
    for name, v in packed.items():
        if isinstance(v, tuple):
            kind, arr = v
            kw[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(device if kind != "cpu" else "cpu")
        else:
            kw[name] = v
    return StepBatch(**kw)


class ParallelModelRunner(ModelRunner):
    """`loaded` is this rank's shard (`shard_model`). `on_failure(check_only=False, wait_s=0)` (rank 0):
    a description of what went wrong with the workers (a dead process, a reported error) or None."""

    def __init__(self, loaded: LoadedModel, cfg: RunnerConfig, group: ParallelGroup, on_failure=None):
        if cfg.device != str(group.device) and torch.device(cfg.device) != group.device:
            raise ValueError(f"runner device {cfg.device!r} differs from the process group's {group.device}")
        self.group, self.on_failure = group, on_failure
        super().__init__(loaded, cfg)
        self.launches_collectives = group.world > 1  # every layer's sum is something a cut can hide (planner)
        self.decode_inputs = None  # every step goes through `execute`, which rank 0 broadcasts
        self.broken: str | None = None
        self.cluster = None  # rank 0: the TPCluster this runner owns (closed with it), if any

    def allocate_buffers(self, capacity: int):
        """The per-microbatch buffers plus each microbatch's own communication buffer (room for `world`
        partials of the widest cross-rank sum: the Engram projection, (hc_mult + 1) * hidden)."""
        bufs = super().allocate_buffers(capacity)
        mcfg = self.loaded.config
        width = max(mcfg.hidden_size, (mcfg.hc_mult + 1) * mcfg.hidden_size)
        engram = mcfg.engram.num_layers * (mcfg.hc_mult + 1) * mcfg.hidden_size  # all Engram projections
        for b in bufs:
            for name, w in ((COMM, width), (COMM_ENGRAM, engram)):
                if w:
                    b.scratch[name] = torch.zeros(self.group.world * capacity * w, dtype=b.staging.dtype,
                                                  device=b.staging.device)
        return bufs

    def close(self) -> None:
        super().close()
        if self.cluster is not None:
            self.cluster.close()

    def execute(self, batch: StepBatch, bounds: list[int] | None = None, record: bool = False,
                score_rows: list[int] | None = None, reads=None) -> StepOutput:
        if self.broken is not None:
            raise ParallelError(f"the tensor-parallel group is down: {self.broken}")
        try:
            if self.group.rank == 0:
                bounds = bounds if bounds is not None else self.plan(batch)
                if self.on_failure is not None:
                    dead = self.on_failure(check_only=True)
                    if dead:
                        raise ParallelError(dead)
                self.group.broadcast_object(("step", pack_batch(batch), list(bounds), record, score_rows,
                                             reads))
            return super().execute(batch, bounds, record, score_rows, reads)
        except ParallelError as e:
            why = self.on_failure(wait_s=3.0) if self.on_failure is not None else None
            self.broken = why or str(e)
            raise ParallelError(f"{why}; {e}" if why and why not in str(e) else str(e)) from None
