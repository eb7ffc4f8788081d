"""Checkpoint loading (the official V4.1 layout: a shard index, or one model.safetensors): round trip,
determinism, memory mapping, and every mismatch named with both values. The checkpoint here stores float32
(quantized storage: tests/test_v41_checkpoint.py)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram_serve.config import ModelConfig, read_json
from engram_serve.engram.layout import build_layout
from engram_serve.engram.tables import EngramTables
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.errors import CheckpointMismatch, ConfigError
from engram_serve.model import exactness, layers
from engram_serve.model.checkpoint import INDEX_FILE, CheckpointFiles
from engram_serve.model.deepseek_v41 import DeepseekV41, init_weights
from engram_serve.model.loader import CONFIG_FILE, TINY_DIR, WEIGHTS_FILE, check_tokenizer, load_model
from engram_serve.model.writer import Quant, make_random_checkpoint

FLOAT = Quant(linears=False, experts=None, tables=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=0, quant=FLOAT)


@pytest.fixture
def copy(ckpt, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(ckpt, tmp_path / "copy"))
    return make


def shards(d: Path) -> list[Path]:
    return sorted(d / f for f in set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))


def edit_config(d: Path, **changes) -> None:
    cfg = read_json(d / CONFIG_FILE)
    cfg["text_config"].update(changes)
    cfg.update({k: v for k, v in changes.items() if k in cfg})  # (token ids are at both levels)
    (d / CONFIG_FILE).write_text(json.dumps(cfg))


def edit_weights(d: Path, fn) -> None:
    """Apply fn to every tensor of the checkpoint, rewritten as one model.safetensors (no index)."""
    tensors = {k: v.clone() for f in shards(d) for k, v in load_file(f).items()}
    fn(tensors)
    for f in shards(d):
        f.unlink()
    (d / INDEX_FILE).unlink()
    save_file(tensors, d / WEIGHTS_FILE)


def test_tiny_config_matches_tokenizer_and_layout():
    """The shipped config agrees with the bundled tokenizer (V') and with the hash layout (table rows)."""
    cfg = ModelConfig.from_dict(read_json(TINY_DIR / CONFIG_FILE))
    tok = load_tokenizer(TINY_DIR / "tokenizer.json")
    check_tokenizer(cfg, tok)
    assert int(build_token_map(tok, cfg.engram.engram_compressed_vocab_size).max()) + 1 == 2726
    assert build_layout(cfg.engram).table_rows == list(cfg.engram.engram_num_embeddings) == [33048, 33644]


def test_round_trip_same_logits_and_tables(ckpt):
    loaded = load_model(ckpt)
    cfg = loaded.config
    ref = layers.layout_weights_(init_weights(DeepseekV41(cfg), 0, 0.05).eval())  # the loader's weight layout: MKL
    ref_tables = EngramTables.random(cfg.engram, 1)  # may round a call differently with another layout
    assert loaded.tables.rows_per_layer == list(cfg.engram.engram_num_embeddings)
    for a, b in zip(loaded.tables.tables, ref_tables.tables):
        assert torch.equal(a, b)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    rows = [torch.randn(2, 12, cfg.engram.num_columns, cfg.engram.engram_head_dim) for _ in range(2)]
    with torch.no_grad():
        assert torch.equal(loaded.model.forward_dense(ids, rows), ref.forward_dense(ids, rows))
    assert loaded.token_map.shape == (4096,) and int(loaded.token_map.max()) + 1 == 2726
    assert loaded.layout.table_rows == list(cfg.engram.engram_num_embeddings)


def test_random_checkpoint_is_deterministic_and_small(ckpt, tmp_path):
    again = make_random_checkpoint(tmp_path / "again", seed=0, quant=FLOAT)
    names = sorted(os.listdir(ckpt))
    assert names == sorted(os.listdir(again))
    for name in names:
        assert hashlib.sha256((ckpt / name).read_bytes()).digest() == \
            hashlib.sha256((again / name).read_bytes()).digest(), name
    assert sum((ckpt / n).stat().st_size for n in names) < 28 * 2**20  # (float32, the drafter's mtp.* included)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    real = os.path.realpath(path)
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] == real:
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_weights_and_tables_are_memory_mapped(ckpt):
    loaded = load_model(ckpt, pin_tables=False)
    files = shards(ckpt)
    ranges = [r for f in files for r in _mapped_ranges(f)]
    assert ranges, "the weights file is not mapped"

    def mapped(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    params = dict(loaded.model.named_parameters())
    # matmul weights are copied once, input-major (model/exactness.py); fused ones are built from mapped tensors
    matmul = [(getattr(m, name), n_in) for m, name, n_in in layers.matmul_params(loaded.model)]
    assert matmul and all(not mapped(p) and exactness.in_major(p, n_in) is p for p, n_in in matmul)
    copied = {id(p) for p, _ in matmul}
    assert all(mapped(p) for p in params.values() if id(p) not in copied and p.dim() < 3)  # norms, embedding, mHC
    # (the stacked experts are built from one tensor per expert: new tensors)
    assert all(mapped(t) for t in loaded.tables.tables)
    assert not mapped(params["norm.weight"].clone())  # control: a copy is not in the mapping
    # copy-on-write: writing a parameter leaves the file untouched
    before = [f.read_bytes() for f in files]
    with torch.no_grad():
        params["norm.weight"].add_(1.0)
    assert [f.read_bytes() for f in files] == before


def test_load_reports_progress(ckpt):
    seen = []
    load_model(ckpt, progress=lambda done, total, what: seen.append((done, total, what)))
    assert seen[-1][0] == seen[-1][1] and any(w == "head.weight" for _, _, w in seen)


def test_one_loader_for_every_caller(ckpt, tmp_path, capsys):
    """`load_model` is the only loader (the engine factory and the CLI have none of their own): it draws
    a bar with progress=True, passes a LoadedModel through, and names a wrongly typed config.json field."""
    from engram_serve import cli
    from engram_serve.engine import factory
    assert not hasattr(factory, "load") and not hasattr(cli, "load_checkpoint")
    loaded = load_model(ckpt, progress=True)
    assert "loading" in capsys.readouterr().err
    assert load_model(loaded) is loaded
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    raw = json.loads((bad / CONFIG_FILE).read_text())
    raw["text_config"]["num_attention_heads"] = 2.0
    (bad / CONFIG_FILE).write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"num_attention_heads=2\.0: must be an integer"):
        load_model(bad)
    raw["text_config"]["num_attention_heads"] = 4
    raw["text_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4}  # a KeyError while the model is built
    (bad / CONFIG_FILE).write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json: KeyError: 'original_max_position_embeddings'"):
        load_model(bad)


@pytest.mark.parametrize("change, pattern", [
    (dict(vocab_size=4000), r"vocab_size: config says 4000, the tokenizer has 4096"),
    (dict(vocab_size=5000, engram_pad_token_id=4500), r"engram_pad_token_id: config says 4500.*0\.\.4095"),
    (dict(vocab_size=5000, eos_token_id=4097), r"eos_token_id: config says 4097.*0\.\.4095"),
    (dict(engram_compressed_vocab_size=2725), r"engram_compressed_vocab_size: config says 2725.*yields 2726"),
    (dict(engram_num_embeddings=[33048, 33000]), r"engram_num_embeddings for Engram layer 4: config says 33000.*33644"),
])
def test_config_and_tokenizer_mismatch(copy, change, pattern):
    d = copy()
    edit_config(d, **change)
    with pytest.raises(CheckpointMismatch, match=pattern):
        load_model(d)


def _shrink_rows(t):
    t["layers.4.engram.embed.weight"] = t["layers.4.engram.embed.weight"][:-5].contiguous()


def _narrow(t):
    t["layers.1.engram.embed.weight"] = t["layers.1.engram.embed.weight"][:, :15].contiguous()


def _drop(t):
    del t["layers.2.ffn.experts.3.w2.weight"]


def _reshape(t):
    t["layers.0.attn.wq_a.weight"] = torch.zeros(64, 96)


def _extra(t):
    t["layers.9.attn.wq_a.weight"] = torch.zeros(4)


def _drop_table(t):
    del t["layers.1.engram.embed.weight"]


@pytest.mark.parametrize("fn, pattern", [
    (_shrink_rows, r"engram_num_embeddings for Engram layer 4: config says 33644, .*'layers.4.engram.embed.weight' "
                   r"has 33639 rows"),
    (_narrow, r"engram_head_dim for Engram layer 1: config says 32, .*'layers.1.engram.embed.weight' is 15 wide"),
    (_drop, r"missing tensor.*layers\.2\.ffn\.experts\.3\.w2\.weight.*\[128, 128\]"),
    (_reshape, r"layers\.0\.attn\.wq_a\.weight.*checkpoint shape \[64, 96\].*\[64, 128\]"),
    (_extra, r"unexpected tensor.*layers\.9\.attn\.wq_a\.weight"),
    (_drop_table, r"missing tensor 'layers\.1\.engram\.embed\.weight'"),
])
def test_weight_mismatch(copy, fn, pattern):
    d = copy()
    edit_weights(d, fn)
    with pytest.raises(CheckpointMismatch, match=pattern):
        load_model(d)


def test_untouched_copy_loads(copy):
    """Control for the mismatch tests: the copy itself is fine, so each failure comes from its edit."""
    d = copy()
    edit_weights(d, lambda t: None)
    load_model(d)


def test_corrupt_files(copy):
    d = copy()
    edit_weights(d, lambda t: None)  # one model.safetensors
    data = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointMismatch, match=r"model\.safetensors: not a valid safetensors file.*not fully covered"):
        load_model(d)
    (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointMismatch, match=r"model\.safetensors: not a valid safetensors file.*header too large"):
        load_model(d)
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointMismatch, match="model.safetensors"):
        load_model(d)


def test_bf16_checkpoint_views_correctly(tmp_path):
    t = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"a": t, "b": torch.arange(7, dtype=torch.int64)}, tmp_path / "x.safetensors")
    (tmp_path / "x.safetensors").rename(tmp_path / WEIGHTS_FILE)
    files = CheckpointFiles.open(tmp_path)
    assert files.tensor("a").dtype == torch.bfloat16 and torch.equal(files.tensor("a"), t)
    assert torch.equal(files.tensor("b"), torch.arange(7))


def test_script_writes_a_loadable_checkpoint(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "scripts" / "make_random_checkpoint.py"), "--out", str(tmp_path / "s"),
                    "--seed", "3"], check=True, cwd=root, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(root)})
    assert load_model(tmp_path / "s").config.hidden_size == 128
    same = make_random_checkpoint(tmp_path / "f", seed=3)  # the script is a front end of this function
    assert all((tmp_path / "s" / n).read_bytes() == (same / n).read_bytes() for n in os.listdir(same))
