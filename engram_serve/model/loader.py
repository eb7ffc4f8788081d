"""Load (and write) a Hugging Face-style Engram checkpoint directory.

    config.json        DeepSeek-V4.1 field names (ModelConfig.from_dict)
    model.safetensors  backbone weights plus one `engram.{layer_id}.table` [rows, engram_head_dim] per Engram layer
    tokenizer.json     a `tokenizers` tokenizer

Weights are memory-mapped (copy-on-write, so the file is never modified and pages load on demand) and
assigned into a model built on the meta device: loading copies no weight. Every disagreement between
config, tokenizer and tensors raises CheckpointMismatch naming the field (or tensor) and both values.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ..config import ModelConfig, read_json
from ..engram.layout import EngramLayout, build_layout
from ..engram.tables import EngramTables, table_key
from ..engram.token_map import build_token_map, load_tokenizer
from ..errors import CheckpointMismatch
from .model import EngramModel, init_weights

TINY_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"

# safetensors dtype -> (numpy dtype used to view the bytes, torch dtype of the tensor)
_DTYPES = {
    "F64": (np.float64, torch.float64), "F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
    "BF16": (np.int16, torch.bfloat16), "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16), "I8": (np.int8, torch.int8), "U8": (np.uint8, torch.uint8),
    "BOOL": (np.bool_, torch.bool),
}

Progress = Callable[[int, int, str], None]  # (done, total, what)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: EngramModel
    tables: EngramTables
    layout: EngramLayout
    tokenizer: Tokenizer
    token_map: torch.Tensor  # [tokenizer vocab] int64 raw id -> compressed id
    path: Path


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file and the byte offset where its data starts."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointMismatch(f"{path}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)  # 8-byte little-endian header length
            if n > size - 8:
                raise CheckpointMismatch(f"{path}: header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointMismatch(f"cannot read checkpoint {path}: {e}") from None
    except ValueError as e:
        raise CheckpointMismatch(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointMismatch(f"{path}: safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + n, size - 8 - n
    for name, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in _DTYPES or not isinstance(e.get("shape"), list) \
                or not isinstance(e.get("data_offsets"), list) or len(e["data_offsets"]) != 2:
            raise CheckpointMismatch(f"{path}: tensor {name!r} has a malformed header entry {e!r}")
        begin, end = e["data_offsets"]
        want = math.prod(e["shape"]) * np.dtype(_DTYPES[e["dtype"]][0]).itemsize
        if not 0 <= begin <= end <= data_size or end - begin != want:
            raise CheckpointMismatch(f"{path}: tensor {name!r} data_offsets {e['data_offsets']} do not hold "
                                     f"{e['dtype']} {e['shape']} ({want} bytes) in {data_size} data bytes")
    return header, data_start


def mmap_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Zero-copy torch views of every tensor in a safetensors file (one copy-on-write mapping of the file)."""
    path = Path(path)
    header, data_start = read_safetensors_header(path)
    if not header:
        return {}
    raw = np.memmap(path, dtype=np.uint8, mode="c")  # "c": writable views, private pages, file untouched
    out = {}
    for name, e in header.items():
        np_dtype, torch_dtype = _DTYPES[e["dtype"]]
        begin, end = (data_start + o for o in e["data_offsets"])
        buf = raw[begin:end]
        if begin % np.dtype(np_dtype).itemsize:  # misaligned for its dtype: the one case that copies
            buf = np.array(buf)
        t = torch.from_numpy(buf.view(np_dtype).reshape(e["shape"]))
        out[name] = t.view(torch_dtype) if torch_dtype == torch.bfloat16 else t
    return out


def check_tokenizer(cfg: ModelConfig, tok: Tokenizer) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise CheckpointMismatch(f"vocab_size: config says {cfg.vocab_size}, the tokenizer has {n} tokens")
    for name, v in (("engram_pad_token_id", cfg.engram.engram_pad_token_id), ("eos_token_id", cfg.eos_token_id),
                    ("bos_token_id", cfg.bos_token_id)):
        if not 0 <= v < n:
            raise CheckpointMismatch(f"{name}: config says {v}, the tokenizer has only ids 0..{n - 1}")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _split_tables(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    e = cfg.engram
    tables = []
    for lid, rows in zip(e.engram_layer_ids, e.engram_num_embeddings):
        key = table_key(lid)
        if key not in tensors:
            raise CheckpointMismatch(f"missing tensor {key!r} (expected shape {[rows, e.engram_head_dim]})")
        t = tensors.pop(key)
        if t.ndim != 2:
            raise CheckpointMismatch(f"tensor {key!r}: checkpoint shape {_shape(t)}, "
                                     f"expected {[rows, e.engram_head_dim]}")
        if t.shape[0] != rows:
            raise CheckpointMismatch(f"engram_num_embeddings for Engram layer {lid}: config says {rows}, "
                                     f"checkpoint table {key!r} has {t.shape[0]} rows")
        if t.shape[1] != e.engram_head_dim:
            raise CheckpointMismatch(f"engram_head_dim for Engram layer {lid}: config says {e.engram_head_dim}, "
                                     f"checkpoint table {key!r} is {t.shape[1]} wide")
        tables.append(t)
    return tables


def _check_weights(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shapes = {k: _shape(expected[k]) for k in missing[:5]}
        raise CheckpointMismatch(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                                 f"(expected shapes {shapes}; {len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointMismatch(f"unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                                 f"(checkpoint shapes {[_shape(tensors[k]) for k in unexpected[:5]]})")
    for name, ref in expected.items():
        if tensors[name].shape != ref.shape:
            raise CheckpointMismatch(f"tensor {name!r}: checkpoint shape {_shape(tensors[name])}, "
                                     f"the config needs {_shape(ref)}")
        if not tensors[name].is_floating_point():
            raise CheckpointMismatch(f"tensor {name!r}: checkpoint dtype {tensors[name].dtype}, expected a float dtype")


def load_model(path: str | Path | None = None, *, device: str | torch.device = "cpu", pin_tables: bool | None = None,
               progress: Progress | None = None) -> LoadedModel:
    """Load a checkpoint directory (None: the built-in tiny model). Parameters are memory-mapped on CPU
    (copied only when `device` is not the CPU) and have requires_grad off; Engram tables stay on the host,
    pinned when CUDA is available (pin_tables=None) - pinning copies them out of the mapping."""
    root = Path(path) if path is not None else TINY_DIR
    note = progress or (lambda done, total, what: None)
    for f in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (root / f).is_file():
            raise CheckpointMismatch(f"checkpoint {root} has no {f}")
    cfg = ModelConfig.from_dict(read_json(root / CONFIG_FILE))
    tok = load_tokenizer(root / TOKENIZER_FILE)
    check_tokenizer(cfg, tok)
    token_map = build_token_map(tok, cfg.engram.engram_compressed_vocab_size)  # raises on a V' mismatch
    layout = build_layout(cfg.engram)  # raises on a row-count mismatch
    note(0, 1, "config and tokenizer")
    tensors = mmap_safetensors(root / WEIGHTS_FILE)
    tables = _split_tables(cfg, tensors)
    with torch.device("meta"):
        model = EngramModel(cfg)
    expected = model.state_dict()
    _check_weights(expected, tensors)
    state = {}
    for i, name in enumerate(expected):
        state[name] = tensors[name]
        note(i + 1, len(expected), name)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False).eval()
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return LoadedModel(cfg, model, EngramTables(cfg.engram.engram_layer_ids, tables, pin=pin_tables), layout, tok,
                       token_map, root)


def save_checkpoint(out_dir: str | Path, cfg: ModelConfig, model: EngramModel, tables: EngramTables,
                    tokenizer_path: str | Path) -> Path:
    """Write config.json, model.safetensors (weights + Engram tables) and tokenizer.json into out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    state.update({k: v.detach().cpu().contiguous() for k, v in tables.state_dict().items()})
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if Path(tokenizer_path).resolve() != (out / TOKENIZER_FILE).resolve():
        shutil.copyfile(tokenizer_path, out / TOKENIZER_FILE)
    return out


def make_random_checkpoint(out_dir: str | Path, seed: int = 0, config: ModelConfig | str | Path | None = None,
                           tokenizer_path: str | Path | None = None) -> Path:
    """A deterministic random checkpoint: same seed and config, same bytes. `config` None = the tiny config;
    the tokenizer defaults to a tokenizer.json beside a config path, else the tiny tokenizer."""
    if isinstance(config, ModelConfig):
        cfg = config
    else:
        cfg_path = Path(config) if config is not None else TINY_DIR / CONFIG_FILE
        cfg = ModelConfig.from_dict(read_json(cfg_path))
        if tokenizer_path is None and (cfg_path.parent / TOKENIZER_FILE).is_file():
            tokenizer_path = cfg_path.parent / TOKENIZER_FILE
    tokenizer_path = tokenizer_path or TINY_DIR / TOKENIZER_FILE
    model = init_weights(EngramModel(cfg), seed)
    tables = EngramTables.random(cfg.engram, seed + 1, pin=False)
    return save_checkpoint(out_dir, cfg, model, tables, tokenizer_path)
