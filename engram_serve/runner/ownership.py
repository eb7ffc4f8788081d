"""Debug-mode check of spec §5: every buffer written during a forward belongs to one microbatch."""
from __future__ import annotations

import torch

from ..errors import OwnershipError


class OwnershipTracker:
    """Maps a buffer's storage to the (microbatch, name) that first touched it in this step.

    A touch by any other microbatch raises OwnershipError naming the buffer and both microbatches.
    """

    def __init__(self) -> None:
        self._owner: dict[int, tuple[int, str]] = {}

    def reset(self) -> None:
        self._owner.clear()

    def touch(self, name: str, tensor: torch.Tensor, ubatch: int) -> None:
        key = tensor.untyped_storage().data_ptr()
        owner = self._owner.setdefault(key, (ubatch, name))
        if owner[0] != ubatch:
            raise OwnershipError(
                f"buffer {name!r} is owned by microbatch {owner[0]} (as {owner[1]!r}) "
                f"but was touched by microbatch {ubatch}")
