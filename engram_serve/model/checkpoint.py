"""The tensors of a checkpoint directory, single-file or sharded, read zero-copy through `safetensors.safe_open`.

    model.safetensors                       one file, or
    model.safetensors.index.json            {"weight_map": {tensor name: shard file}} plus the shards

`safe_open` parses and validates each shard's header (dtypes, shapes, offsets that cover the data
exactly, without gaps or overlap: a truncated shard fails here). The data is then mapped with numpy,
per tensor, at the offsets that validated layout implies (tensors in `offset_keys()` order, back to
back, ending at the end of the file): weights copy-on-write (writable, the file never changes),
Engram tables read-only. Why not `safe_open(..., framework="pt").get_tensor`: it is zero-copy too,
but it maps the WHOLE file private and writable, which the kernel charges to committed memory and
refuses for a file larger than RAM (ENOMEM, measured with a 37 GiB shard on a 24 GiB machine); a
read-only mapping is not charged, so a table larger than RAM opens and pages load when read.
Only the shards that hold a requested tensor are opened. Every failure is a CheckpointMismatch
naming the file, the tensor and the values.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointMismatch

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
CONFIG_FILE, TOKENIZER_FILE = "config.json", "tokenizer.json"
TINY_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny"  # the built-in model's checkpoint
# safetensors dtype code -> torch dtype (the element size follows)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


PAGE = mmap.PAGESIZE


def meminfo(key: str) -> int | None:
    """A /proc/meminfo figure in bytes (MemTotal, MemAvailable), or None where there is none."""
    path = Path("/proc/meminfo")
    for line in path.read_text().splitlines() if path.is_file() else ():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return None


def drop_pages(t: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over the whole pages inside a tensor that is a view of a shard's map and was read
    once (converted at load): the map lets them go, and they no longer count in the process's resident memory
    (read from the file again if ever touched; a page shared with a neighbour is kept). A no-op elsewhere."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return
    start = -(-t.data_ptr() // PAGE) * PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE * PAGE
    if end > start:
        try:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)
        except (OSError, AttributeError):
            pass


class _Shard:
    """One validated safetensors file: its safe_open handle and every tensor's (dtype, shape, byte range)."""

    def __init__(self, path: Path):
        try:
            self.handle = safe_open(str(path), framework="numpy")  # read-only map: opens files larger than RAM
        except (SafetensorError, OSError) as e:
            raise CheckpointMismatch(f"{path}: not a valid safetensors file ({e})") from None
        self.path = path
        self.entries: dict[str, tuple[str, list[int], int, int]] = {}  # name -> (dtype, shape, begin, end)
        pos = 0
        for name in self.handle.offset_keys():
            sl = self.handle.get_slice(name)
            dtype, shape = sl.get_dtype(), list(sl.get_shape())
            if dtype not in DTYPES:
                raise CheckpointMismatch(f"{path}: tensor {name!r} has dtype {dtype}, which engram-serve does not "
                                         f"read (known: {sorted(DTYPES)})")
            n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=DTYPES[dtype]).element_size()
            self.entries[name] = (dtype, shape, pos, pos + n)
            pos += n
        self.data_start = path.stat().st_size - pos  # the data ends at the end of the file (validated)

    def _map(self, writable: bool) -> np.memmap:
        """The whole file, mapped once per mode (copy-on-write or read-only): every tensor is a view of it (one file
        descriptor a shard, whatever its number of tensors)."""
        maps = self.__dict__.setdefault("_maps", {})
        if writable not in maps:
            maps[writable] = np.memmap(self.path, dtype=np.uint8, mode="c" if writable else "r")
        return maps[writable]

    def tensor(self, name: str, writable: bool) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        tdtype = DTYPES[dtype]
        if end == begin:
            return torch.empty(shape, dtype=tdtype)
        buf = self._map(writable)[self.data_start + begin:self.data_start + end]
        if (self.data_start + begin) % torch.empty((), dtype=tdtype).element_size():
            buf = np.array(buf)  # misaligned for its dtype: the one case that copies
        with warnings.catch_warnings():  # a read-only table: torch warns that it cannot be written (it never is)
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(buf)
        return t.view(tdtype).view(shape)


class CheckpointFiles:
    """Invariant: `weight_map` names, for every tensor, the file that holds it (all files exist)."""

    def __init__(self, root: Path, weight_map: dict[str, Path], shards: dict[Path, _Shard] | None = None):
        self.root = root
        self.weight_map = weight_map
        self._handles: dict[Path, _Shard] = dict(shards or {})

    @classmethod
    def open(cls, root: str | Path) -> "CheckpointFiles":
        root = Path(root)
        if (root / INDEX_FILE).is_file():
            return cls._from_index(root)
        if not (root / WEIGHTS_FILE).is_file():
            raise CheckpointMismatch(f"checkpoint {root} has no {WEIGHTS_FILE} (nor {INDEX_FILE})")
        f = root / WEIGHTS_FILE
        shard = _Shard(f)
        return cls(root, {k: f for k in shard.entries}, {f: shard})

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

    def _handle(self, name: str) -> _Shard:
        if name not in self.weight_map:
            raise CheckpointMismatch(f"missing tensor {name!r} in checkpoint {self.root}")
        f = self.weight_map[name]
        if f not in self._handles:
            self._handles[f] = _Shard(f)
        h = self._handles[f]
        if name not in h.entries:
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
        dtype, shape, _, _ = self._handle(name).entries[name]
        return dtype, list(shape)

    def tensor(self, name: str, writable: bool = True) -> torch.Tensor:
        """Zero-copy view of the tensor: a copy-on-write mapping (writable) or a read-only one (writing to
        it would fault; for tables, which are only read, and which may be larger than RAM)."""
        try:
            return self._handle(name).tensor(name, writable)
        except OSError as e:
            raise CheckpointMismatch(f"{self.weight_map[name]}: cannot map tensor {name!r}: {e}") from None

    def expect(self, name: str, dtypes: tuple[str, ...], shape: list[int]) -> None:
        """Check that the tensor's dtype is one of dtypes and its shape is `shape` (reads no data)."""
        dtype, got = self.info(name)
        if dtype not in dtypes:
            raise CheckpointMismatch(f"{self.weight_map[name]}: tensor {name!r} has dtype {dtype}, expected "
                                     f"{' or '.join(dtypes)}")
        if got != list(shape):
            raise CheckpointMismatch(f"{self.weight_map[name]}: tensor {name!r} has shape {got}, expected {list(shape)}")

    def shards_opened(self) -> list[Path]:
        return sorted(self._handles)
