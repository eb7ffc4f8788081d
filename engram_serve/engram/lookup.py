"""An Engram lookup over a checkpoint directory, without the backbone.

`EngramReader.open(dir)` reads only what the Engram layers need: `config.json` (nested or flat; the
Engram fields), `tokenizer.json` (the compressed map, checked against engram_compressed_vocab_size),
and the Engram tables of the shards that hold them (through the shard index, memory-mapped; no
other shard is opened). `lookup(text)` tokenizes, hashes from position 0 with the production
`hash_step`, and stages the rows with the production gather (`EngramTables.gather`, dequantizing FP8
rows), exactly as a serving step would. Someone holding the official V4.1 directory can so check this
project's Engram path on it: `engram-serve lookup --model DIR "text" --json`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..config import EngramConfig, read_json
from ..errors import CheckpointMismatch
from .hashing import hash_step
from .layout import EngramLayout, build_layout
from .tables import EngramTables
from .token_map import build_token_map, load_tokenizer


@dataclass
class LookupResult:
    """token_ids [T]; hash_ids [T, L_e, C] int64; rows [L_e, T, C, head_dim] float32, as staged."""

    layer_ids: tuple[int, ...]
    token_ids: list[int]
    hash_ids: torch.Tensor
    rows: torch.Tensor

    def to_json(self) -> dict:
        """`rows` as Python floats: each float32 converts exactly, and json writes a float's repr, so the
        printed decimal reads back to the same float32 bits."""
        return {"layer_ids": list(self.layer_ids), "token_ids": self.token_ids, "hash_ids": self.hash_ids.tolist(),
                "rows": self.rows.tolist()}

    def digest(self, layer: int, token: int) -> str:
        """sha256 (first 16 hex digits) of one token's staged float32 rows of one Engram layer."""
        return hashlib.sha256(self.rows[layer, token].contiguous().numpy().tobytes()).hexdigest()[:16]


@dataclass
class EngramReader:
    config: EngramConfig
    layout: EngramLayout
    tokenizer: Tokenizer
    token_map: torch.Tensor  # [vocab] int64
    tables: EngramTables
    shards: list[Path]  # the safetensors files opened

    @classmethod
    def open(cls, model_dir: str | Path, cache_bytes: int = 0) -> "EngramReader":
        from ..model.checkpoint import CheckpointFiles
        from ..model.loader import CONFIG_FILE, TOKENIZER_FILE, read_tables

        root = Path(model_dir)
        for f in (CONFIG_FILE, TOKENIZER_FILE):
            if not (root / f).is_file():
                raise CheckpointMismatch(f"checkpoint {root} has no {f}")
        cfg = EngramConfig.from_dict(read_json(root / CONFIG_FILE))
        tok = load_tokenizer(root / TOKENIZER_FILE)
        tmap = build_token_map(tok, cfg.engram_compressed_vocab_size)  # raises on a V' mismatch
        if not 0 <= cfg.engram_pad_token_id < len(tmap):
            raise CheckpointMismatch(f"engram_pad_token_id: config says {cfg.engram_pad_token_id}, the tokenizer "
                                     f"has only ids 0..{len(tmap) - 1}")
        layout = build_layout(cfg)  # raises on a row-count mismatch
        files = CheckpointFiles.open(root)
        tables = read_tables(files, cfg, pin=False, cache_bytes=cache_bytes)
        return cls(cfg, layout, tok, tmap, tables, files.shards_opened())

    def lookup_ids(self, token_ids: list[int]) -> LookupResult:
        """Hash ids and staged float32 rows of one sequence starting at position 0."""
        if not token_ids:
            raise CheckpointMismatch("lookup: the text gives no tokens")
        ids = torch.tensor(token_ids, dtype=torch.int64)
        history = torch.full((1, self.config.history_len), -1, dtype=torch.int64)  # [1, D]: position 0
        pad_id = int(self.token_map[self.config.engram_pad_token_id])
        hash_ids = hash_step(ids, torch.tensor([0, len(token_ids)]), history, self.layout, self.token_map, pad_id)
        e = self.config
        rows = torch.empty(e.num_layers, len(token_ids), e.num_columns, e.engram_head_dim)  # [L, T, C, hd] f32
        self.tables.gather(hash_ids, rows)
        return LookupResult(e.engram_layer_ids, list(token_ids), hash_ids, rows)

    def lookup(self, text: str) -> LookupResult:
        return self.lookup_ids(self.tokenizer.encode(text).ids)


def engram_lookup(model_dir: str | Path, text: str) -> LookupResult:
    """The Python function behind `engram-serve lookup`."""
    return EngramReader.open(model_dir).lookup(text)
