"""Debug-mode check of docs/contract.md §5 and §10: every buffer written during a forward belongs to one microbatch,
and a buffer with a collective in flight belongs to the microbatch that launched it until it waits."""
from __future__ import annotations

import torch

from ..errors import OwnershipError


class OwnershipTracker:
    """Maps a buffer's storage to the (microbatch, name) that first touched it in this step.

    A touch by any other microbatch raises OwnershipError naming the buffer and both microbatches.
    `launch` marks a buffer in flight (a collective reads/writes it); until `land` by the same
    microbatch, any touch or launch on it - by another microbatch, or by the owner's next launch -
    raises, naming the buffer and both microbatches.
    """

    def __init__(self) -> None:
        self._owner: dict[int, tuple[int, str]] = {}
        self._inflight: dict[int, tuple[int, str]] = {}

    def reset(self) -> None:
        self._owner.clear()
        self._inflight.clear()

    def touch(self, name: str, tensor: torch.Tensor, microbatch: int) -> None:
        key = tensor.untyped_storage().data_ptr()
        busy = self._inflight.get(key)
        if busy is not None:
            raise OwnershipError(
                f"buffer {name!r} has a collective in flight, launched by microbatch {busy[0]} (as {busy[1]!r}) "
                f"and not yet waited on, but was touched by microbatch {microbatch}")
        owner = self._owner.setdefault(key, (microbatch, name))
        if owner[0] != microbatch:
            raise OwnershipError(
                f"buffer {name!r} is owned by microbatch {owner[0]} (as {owner[1]!r}) "
                f"but was touched by microbatch {microbatch}")

    def launch(self, name: str, tensor: torch.Tensor, microbatch: int) -> None:
        self.touch(name, tensor, microbatch)  # raises if in flight (also for the owner's own next launch)
        self._inflight[tensor.untyped_storage().data_ptr()] = (microbatch, name)

    def land(self, name: str, tensor: torch.Tensor, microbatch: int) -> None:
        key = tensor.untyped_storage().data_ptr()
        busy = self._inflight.get(key)
        if busy is None or busy[0] != microbatch:
            raise OwnershipError(f"buffer {name!r}: microbatch {microbatch} waited on a collective it does not own "
                                 f"(in flight: {busy})")
        del self._inflight[key]

    def in_flight(self) -> list[tuple[int, str]]:
        return list(self._inflight.values())
