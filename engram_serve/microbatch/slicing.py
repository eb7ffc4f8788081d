"""Slicing a step into microbatches (docs/contract.md §4).

Boundaries are plain Python ints. Every StepBatch field has an explicit slicing rule in
`SLICE_RULES`; a field without one makes `slice_microbatch` raise SliceError (never a silent copy).
"""
from __future__ import annotations

import numpy as np
import torch

from ..engram.hashing import DEAD
from ..errors import SliceError
from ..inputs.batch import StepBatch

TOKEN, REQUEST = "token", "request"
SLICE_RULES: dict[str, str] = {
    "input_ids": TOKEN, "positions": TOKEN, "dead": TOKEN, "slot_mapping": TOKEN, "hash_ids": TOKEN,
    "req_slots": REQUEST, "block_tables": REQUEST,
    # request-indexed with an adjustment at a straddling edge:
    "num_computed": "first row: + its tokens in earlier microbatches",
    "seq_lens": "last row: - its tokens in later microbatches",
    "sample": "last row: False when it continues into the next microbatch",
    "qsl": "rebased to 0 and clipped to the token range",
    "qsl_host": "rebased to 0 and clipped to the token range",
    "history": "rebuilt for each row's first token in the microbatch",
    "block_size": "scalar, shared",
}


def microbatch_history(batch: StepBatch, t0: int, r0: int) -> torch.Tensor:
    """[D] history of row r0 for its first token at t0: earlier tokens of this step, then older ones."""
    d = batch.history.shape[1]
    off = t0 - int(batch.qsl_host[r0])  # tokens of row r0 in earlier microbatches
    j = torch.arange(d, device=batch.history.device)
    step_ids = torch.where(batch.dead, torch.full_like(batch.input_ids, DEAD), batch.input_ids)
    from_step = step_ids[(t0 - 1 - j).clamp(min=0)]
    from_old = batch.history[r0, (j - off).clamp(min=0)]
    return torch.where(j < off, from_step, from_old)


def slice_microbatch(batch: StepBatch, t0: int, t1: int, rebuild_history: bool = True) -> StepBatch:
    """The microbatch of tokens [t0, t1). Request fields cover every row touching the range."""
    if not 0 <= t0 < t1 <= batch.num_tokens:
        raise SliceError(f"token range [{t0}, {t1}) is not inside the step's {batch.num_tokens} tokens")
    qh = batch.qsl_host
    r0 = int(np.searchsorted(qh, t0, side="right")) - 1
    r1 = int(np.searchsorted(qh, t1 - 1, side="right"))  # rows r0..r1-1
    moved_in, moved_out = t0 - int(qh[r0]), int(qh[r1]) - t1
    out = {}
    for name, value in batch.fields().items():
        rule = SLICE_RULES.get(name)
        if rule is None:
            raise SliceError(f"StepBatch field {name!r} has no slicing rule")
        if rule == TOKEN:
            out[name] = None if value is None else value[t0:t1]
        elif rule == REQUEST:
            out[name] = value[r0:r1]
        elif name in ("qsl", "qsl_host"):
            out[name] = (value[r0:r1 + 1] - t0).clip(0, t1 - t0)
        elif name == "num_computed":
            out[name] = value[r0:r1].clone()
            out[name][0] += moved_in
        elif name == "seq_lens":
            out[name] = value[r0:r1].clone()
            out[name][-1] -= moved_out
        elif name == "sample":
            out[name] = value[r0:r1].clone()
            if moved_out:
                out[name][-1] = False
        elif name == "history":
            out[name] = value[r0:r1].clone()
            if rebuild_history and moved_in:
                out[name][0] = microbatch_history(batch, t0, r0)
        else:
            out[name] = value
    return StepBatch(**out)


def slice_microbatches(batch: StepBatch, bounds: list[int], rebuild_history: bool = True) -> list[StepBatch]:
    """The microbatches of `bounds`; a whole step ([0, T]) is the batch itself (every rule is the identity)."""
    if len(bounds) == 2 and bounds[0] == 0 and bounds[1] == batch.num_tokens:
        return [batch]
    return [slice_microbatch(batch, a, b, rebuild_history) for a, b in zip(bounds, bounds[1:])]


def check_slice_invariants(batch: StepBatch, microbatches: list[StepBatch], bounds: list[int]) -> None:
    """Raise SliceError if a cut breaks docs/contract.md §4: tokens, positions, query lengths, sampled rows."""
    tokens = torch.cat([u.input_ids for u in microbatches])
    if not torch.equal(tokens, batch.input_ids) or not torch.equal(torch.cat([u.positions for u in microbatches]),
                                                                   batch.positions):
        raise SliceError("tokens or positions not conserved by the microbatches")
    qlen = torch.zeros(int(batch.req_slots.max()) + 1 if batch.num_rows else 0, dtype=torch.int64)
    for u in microbatches:
        if int(u.qsl_host[-1]) != u.num_tokens or u.qsl_host[0] != 0:
            raise SliceError(f"microbatch qsl {u.qsl_host.tolist()} does not span its {u.num_tokens} tokens")
        lens = torch.from_numpy(np.diff(u.qsl_host))
        qlen.index_add_(0, u.req_slots.cpu(), lens)
        row = torch.repeat_interleave(torch.arange(u.num_rows), lens)
        want = u.num_computed.cpu()[row] + torch.arange(u.num_tokens) - torch.from_numpy(u.qsl_host)[row]
        if not torch.equal(want, u.positions.cpu()):
            raise SliceError("positions != num_computed[row] + offset in a microbatch")
        if not torch.equal(u.seq_lens.cpu(), u.num_computed.cpu() + lens):
            raise SliceError("seq_lens != num_computed + query length in a microbatch")
    full = torch.zeros_like(qlen).index_add_(0, batch.req_slots.cpu(), torch.from_numpy(np.diff(batch.qsl_host)))
    if not torch.equal(qlen, full):
        raise SliceError("per-request query lengths do not sum to the original")
    sampled = torch.cat([u.positions[u.logits_indices] for u in microbatches]) if microbatches else None
    if not torch.equal(sampled, batch.positions[batch.logits_indices]):
        raise SliceError("sampled rows lost or duplicated by the microbatches")
