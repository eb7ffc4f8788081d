"""Device-resident token ids of every live request, readable by (request slot, absolute position).

Memory: `max_slots * max_len * 5` bytes, preallocated: an int32 id (4 B) and a bool dead flag (1 B)
per token position. Invariant: positions `< lengths[slot]` hold the request's committed tokens
(prompt, then each sampled token once committed); everything at or past `lengths[slot]` is unread, except a
verify step's drafts (speculative decoding): `write` puts them there before the step, which alone reads them
(its input ids, and the in-step history of its own later tokens). Committing a verify step's tokens
overwrites the first rejected draft with the emitted token; the rejected ones after it lie past `lengths`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..engram.hashing import BEFORE_START, DEAD
from ..errors import InvalidRequest


class TokenStore:
    def __init__(self, max_slots: int, max_len: int, device: str | torch.device = "cpu"):
        self.max_slots, self.max_len, self.device = max_slots, max_len, torch.device(device)
        self.ids = torch.zeros(max_slots, max_len, dtype=torch.int32, device=self.device)
        self.dead = torch.zeros(max_slots, max_len, dtype=torch.bool, device=self.device)
        self.lengths = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self._free = list(range(max_slots - 1, -1, -1))
        # numpy views of the same memory (a CPU store): a commit indexes them without a conversion each step
        self._host = (self.ids.numpy(), self.dead.numpy(), self.lengths.numpy()) if self.device.type == "cpu" else None

    @property
    def bytes_per_token(self) -> int:
        return self.ids.element_size() + self.dead.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add(self, prompt: list[int] | torch.Tensor, dead: list[bool] | torch.Tensor | None = None) -> int:
        """Store a new request's prompt; returns its slot."""
        prompt = torch.as_tensor(prompt, dtype=torch.int32)
        if prompt.ndim != 1 or prompt.numel() > self.max_len:
            raise InvalidRequest(f"prompt length {prompt.numel()} exceeds the token store's max_len={self.max_len}")
        if not self._free:
            raise InvalidRequest(f"token store is full: all {self.max_slots} slots are in use")
        slot = self._free.pop()
        n = prompt.numel()
        self.ids[slot, :n] = prompt.to(self.device)
        self.dead[slot, :n] = torch.as_tensor(dead if dead is not None else False, dtype=torch.bool).to(self.device)
        self.lengths[slot] = n
        return slot

    def append(self, slots: np.ndarray | torch.Tensor, tokens: torch.Tensor) -> None:
        """Commit one sampled token per slot (host slot numbers), on the device, without a round trip of
        the tokens through Python; a CPU store through numpy views (a few us instead of ~20 of torch's
        indexing operators)."""
        slots = np.asarray(slots, dtype=np.int64)
        if self._host is not None:
            ids, dead, lengths = self._host
            pos = lengths[slots]
            ids[slots, pos] = tokens.numpy()
            dead[slots, pos] = False
            lengths[slots] = pos + 1
            return
        slots = torch.from_numpy(slots).to(self.device)
        pos = self.lengths[slots]
        self.ids[slots, pos] = tokens.to(self.device, torch.int32)
        self.dead[slots, pos] = False
        self.lengths[slots] = pos + 1

    def write(self, slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """ids[slots[i], positions[i]] = tokens[i], never dead (host arrays [S]; one indexing call each);
        `lengths` unchanged (drafts; a commit then calls `set_lengths`)."""
        slots, positions = np.asarray(slots, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int32)
        if self._host is not None:
            ids, dead, _ = self._host
            ids[slots, positions], dead[slots, positions] = tokens, False
            return
        at = (torch.from_numpy(slots).to(self.device), torch.from_numpy(positions).to(self.device))
        self.ids[at], self.dead[at] = torch.from_numpy(tokens).to(self.device), False

    def set_lengths(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """lengths[slots[i]] = lengths[i] (distinct host slots)."""
        if self._host is not None:
            self._host[2][np.asarray(slots, dtype=np.int64)] = lengths
            return
        self.lengths[torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)] = \
            torch.as_tensor(np.asarray(lengths, dtype=np.int64), device=self.device)

    def truncate(self, slot: int, length: int) -> None:
        """Drop tokens at positions >= length (e.g. rejected speculative tokens)."""
        self.lengths[slot] = min(int(self.lengths[slot]), length)

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def gather(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Raw ids at (slot, position), DEAD for dead tokens, BEFORE_START for position < 0. Same shape as positions."""
        p = positions.clamp(min=0)
        out = torch.where(self.dead[slots, p], torch.full_like(p, DEAD), self.ids[slots, p].long())
        return torch.where(positions < 0, torch.full_like(out, BEFORE_START), out)

    def history(self, slots: torch.Tensor, first_pos: torch.Tensor, d: int) -> torch.Tensor:
        """[R, D] int64: column j = token at position first_pos-1-j of each row's request (docs/contract.md §3)."""
        pos = first_pos.long()[:, None] - 1 - torch.arange(d, device=self.device)[None, :]  # [R, D]
        return self.gather(slots.long()[:, None].expand_as(pos), pos)

    def history_host(self, slots: np.ndarray, first_pos: np.ndarray, d: int) -> np.ndarray:
        """`history` for a CPU store, in numpy over views of its tensors (int64 host arrays in, the same values)."""
        pos = first_pos[:, None] - 1 - np.arange(d)[None, :]  # [R, D]
        at = (slots[:, None], np.maximum(pos, 0))
        ids, dead, _ = self._host if self._host is not None else (self.ids.numpy(), self.dead.numpy(), None)
        out = np.where(dead[at], DEAD, ids[at])
        return np.where(pos < 0, BEFORE_START, out).astype(np.int64)
