"""The tensors of a checkpoint directory, single-file or sharded, read zero-copy through `safetensors.safe_open`.

    model.safetensors                       one file, or
    model.safetensors.index.json            {"weight_map": {tensor name: shard file}} plus the shards

`safe_open` validates each shard's header (offsets inside the file, dtypes, no overlap) and maps the
file; `tensor(name)` is a view of that private (copy-on-write) mapping, so opening copies nothing,
a checkpoint larger than RAM opens, and pages load when read. Only the shards that hold a requested
tensor are opened. Every failure is a CheckpointMismatch naming the file, the tensor and the values.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointMismatch

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


class CheckpointFiles:
    """Invariant: `weight_map` names, for every tensor, the file that holds it (all files exist)."""

    def __init__(self, root: Path, weight_map: dict[str, Path]):
        self.root = root
        self.weight_map = weight_map
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, root: str | Path) -> "CheckpointFiles":
        root = Path(root)
        if (root / INDEX_FILE).is_file():
            return cls._from_index(root)
        if not (root / WEIGHTS_FILE).is_file():
            raise CheckpointMismatch(f"checkpoint {root} has no {WEIGHTS_FILE} (nor {INDEX_FILE})")
        f = root / WEIGHTS_FILE
        return cls(root, {k: f for k in cls._handle_of(f, {}).keys()})

    @classmethod
    def _from_index(cls, root: Path) -> "CheckpointFiles":
        path = root / INDEX_FILE
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointMismatch(f"{path}: cannot read the shard index: {e}") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointMismatch(f"{path}: 'weight_map' must map tensor names to shard file names, got "
                                     f"{type(wm).__name__}")
        out = {}
        for name, shard in wm.items():
            f = root / shard
            if Path(shard).name != shard or not f.is_file():
                raise CheckpointMismatch(f"{path}: tensor {name!r} is in shard {shard!r}, which is not a file in {root}")
            out[name] = f
        return cls(root, out)

    @staticmethod
    def _handle_of(f: Path, cache: dict):
        if f not in cache:
            try:
                cache[f] = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointMismatch(f"{f}: not a valid safetensors file ({e})") from None
        return cache[f]

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise CheckpointMismatch(f"missing tensor {name!r} in checkpoint {self.root}")
        h = self._handle_of(self.weight_map[name], self._handles)
        if name not in h.keys():
            raise CheckpointMismatch(f"{self.weight_map[name]}: the shard index places tensor {name!r} in this "
                                     f"file, which does not hold it")
        return h

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        return self.weight_map[name]

    def info(self, name: str) -> tuple[str, list[int]]:
        """(safetensors dtype code, e.g. "F8_E4M3"; shape) without reading the data."""
        s = self._handle(name).get_slice(name)
        return s.get_dtype(), list(s.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of the tensor in its file's private mapping."""
        try:
            return self._handle(name).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointMismatch(f"{self.weight_map[name]}: cannot read tensor {name!r}: {e}") from None

    def expect(self, name: str, dtypes: tuple[str, ...], shape: list[int]) -> torch.Tensor:
        """The tensor, after checking its dtype is one of dtypes and its shape is `shape`."""
        dtype, got = self.info(name)
        if dtype not in dtypes:
            raise CheckpointMismatch(f"{self.weight_map[name]}: tensor {name!r} has dtype {dtype}, expected "
                                     f"{' or '.join(dtypes)}")
        if got != list(shape):
            raise CheckpointMismatch(f"{self.weight_map[name]}: tensor {name!r} has shape {got}, expected {list(shape)}")
        return self.tensor(name)

    def shards_opened(self) -> list[Path]:
        return sorted(self._handles)
