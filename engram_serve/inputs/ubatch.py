"""Microbatch planning and slicing (docs/contract.md §4).

Boundaries are plain Python ints. Every StepBatch field has an explicit slicing rule in
`SLICE_RULES`; a field without one makes `slice_batch` raise SliceError (never a silent copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engram.hashing import DEAD
from ..errors import SliceError
from .batch import StepBatch

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


@dataclass(frozen=True)
class SplitConfig:
    """How a step is cut. A step stays whole below the token thresholds.

    `when` says whether cutting must pay for itself:
    - "overlap" (default): cut only when a microbatch has something to hide behind another's compute
      (`plan_split`'s `hideable_ms`: a collective, Engram rows gathered from host memory into a device,
      or a measured table gather of at least `min_hidden_ms` per step). Otherwise the step runs whole:
      two half-size forwards on one CPU only add fixed per-operator cost.
    - "always": cut every step above the thresholds (verification and tests: split invariance must be
      proven on cut steps, whether or not cutting is worth it here).
    """

    num_ubatches: int = 2
    policy: str = "tokens"  # "tokens": even token split; "requests": prefer request boundaries
    decode_threshold: int = 32  # an all-decode step with fewer tokens is not split
    prefill_threshold: int = 128  # a step with prefill tokens and fewer tokens than this is not split
    max_imbalance: float = 0.25  # "requests": |size - ideal| / ideal allowed for a boundary cut
    when: str = "overlap"
    # "overlap": the least hideable time per step worth a cut. A cut costs a second forward's fixed
    # per-operator overhead (about 3-5 ms for the built-in model on one CPU core), so less is not worth it.
    min_hidden_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.num_ubatches < 1:
            raise ValueError(f"num_ubatches={self.num_ubatches}: must be >= 1")
        if self.policy not in ("tokens", "requests"):
            raise ValueError(f"policy={self.policy!r}: must be 'tokens' or 'requests'")
        if not 0 <= self.max_imbalance < 1:
            raise ValueError(f"max_imbalance={self.max_imbalance}: must be in [0, 1)")
        if self.when not in ("overlap", "always"):
            raise ValueError(f"when={self.when!r}: must be 'overlap' or 'always'")
        if not self.min_hidden_ms >= 0:
            raise ValueError(f"min_hidden_ms={self.min_hidden_ms}: must be >= 0")


def plan_split(qsl: np.ndarray, cfg: SplitConfig, is_decode_only: bool, hideable_ms: float = 0.0) -> list[int]:
    """Token boundaries [0, b1, ..., T] (strictly increasing) for a step with row boundaries qsl.

    `hideable_ms`: how much of this step's time a cut could hide (the runner's estimate: inf with
    collectives or host-resident tables on a device, else the measured Engram gather time). With
    `cfg.when == "overlap"` a step whose hideable time is below `cfg.min_hidden_ms` stays whole."""
    total = int(qsl[-1])
    threshold = cfg.decode_threshold if is_decode_only else cfg.prefill_threshold
    n = min(cfg.num_ubatches, total)
    if n <= 1 or total < threshold or (cfg.when == "overlap" and hideable_ms < cfg.min_hidden_ms):
        return [0, total]
    bounds = [0]
    for k in range(1, n):
        ideal = round(k * total / n)
        cut = ideal
        if cfg.policy == "requests":
            inner = qsl[(qsl > bounds[-1]) & (qsl < total)]
            if len(inner):
                near = int(inner[np.argmin(np.abs(inner - ideal))])
                if abs(near - ideal) <= cfg.max_imbalance * (total / n):
                    cut = near
        if bounds[-1] < cut < total:
            bounds.append(cut)
    return bounds + [total]


def padded_sizes(bounds: list[int], padded_total: int) -> list[int]:
    """Per-microbatch padded token counts; all padding goes to the last microbatch."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    if padded_total < bounds[-1]:
        raise SliceError(f"padded size {padded_total} is smaller than the step's {bounds[-1]} tokens")
    sizes[-1] += padded_total - bounds[-1]
    return sizes


def ubatch_history(batch: StepBatch, t0: int, r0: int) -> torch.Tensor:
    """[D] history of row r0 for its first token at t0: earlier tokens of this step, then older ones."""
    d = batch.history.shape[1]
    off = t0 - int(batch.qsl_host[r0])  # tokens of row r0 in earlier microbatches
    j = torch.arange(d, device=batch.history.device)
    step_ids = torch.where(batch.dead, torch.full_like(batch.input_ids, DEAD), batch.input_ids)
    from_step = step_ids[(t0 - 1 - j).clamp(min=0)]
    from_old = batch.history[r0, (j - off).clamp(min=0)]
    return torch.where(j < off, from_step, from_old)


def slice_batch(batch: StepBatch, t0: int, t1: int, rebuild_history: bool = True) -> StepBatch:
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
                out[name][0] = ubatch_history(batch, t0, r0)
        else:
            out[name] = value
    return StepBatch(**out)


def split_batch(batch: StepBatch, bounds: list[int], rebuild_history: bool = True) -> list[StepBatch]:
    """The microbatches of `bounds`; a whole step ([0, T]) is the batch itself (every rule is the identity)."""
    if len(bounds) == 2 and bounds[0] == 0 and bounds[1] == batch.num_tokens:
        return [batch]
    return [slice_batch(batch, a, b, rebuild_history) for a, b in zip(bounds, bounds[1:])]


def check_slice_invariants(batch: StepBatch, ubatches: list[StepBatch], bounds: list[int]) -> None:
    """Raise SliceError if a split breaks docs/contract.md §4: tokens, positions, query lengths, sampled rows."""
    tokens = torch.cat([u.input_ids for u in ubatches])
    if not torch.equal(tokens, batch.input_ids) or not torch.equal(torch.cat([u.positions for u in ubatches]),
                                                                   batch.positions):
        raise SliceError("tokens or positions not conserved by the split")
    qlen = torch.zeros(int(batch.req_slots.max()) + 1 if batch.num_rows else 0, dtype=torch.int64)
    for u in ubatches:
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
    sampled = torch.cat([u.positions[u.logits_indices] for u in ubatches]) if ubatches else None
    if not torch.equal(sampled, batch.positions[batch.logits_indices]):
        raise SliceError("sampled rows lost or duplicated by the split")
