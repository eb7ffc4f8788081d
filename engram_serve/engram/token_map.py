"""Compressed token map of docs/contract.md §2, built from a Hugging Face tokenizer.json via `tokenizers`."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, normalizers

from ..errors import CheckpointMismatch

_SENTINEL = "\ue000"


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def compressed_keys(tok: Tokenizer) -> list[str]:
    """The normalised key of every raw token id, in id order."""
    norm = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[t] for t in range(n)], skip_special_tokens=False)
    keys = []
    for t, text in enumerate(texts):
        if "\ufffd" in text:
            keys.append(tok.id_to_token(t))
            continue
        key = norm.normalize_str(text)
        keys.append(key if key else text)
    return keys


def build_token_map(tok: Tokenizer, compressed_vocab_size: int | None = None) -> torch.Tensor:
    """[vocab] int64: raw id -> compressed id (ids handed out by first appearance).

    With compressed_vocab_size, a different number of distinct keys raises CheckpointMismatch."""
    ids: dict[str, int] = {}
    out = [ids.setdefault(k, len(ids)) for k in compressed_keys(tok)]
    if compressed_vocab_size is not None and len(ids) != compressed_vocab_size:
        raise CheckpointMismatch(
            f"engram_compressed_vocab_size: config says {compressed_vocab_size}, "
            f"the tokenizer yields {len(ids)} distinct normalised keys")
    return torch.tensor(out, dtype=torch.int64)


def load_tokenizer(path: str | Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise CheckpointMismatch(f"cannot read tokenizer {path}: {e}") from None
