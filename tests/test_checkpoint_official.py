"""A scaled-down checkpoint in the official DeepSeek-V4.1 layout (scripts/make_official_checkpoint.py, the
built-in model's shape): nested config, sharded index, official names, FP8 E4M3 tables with E8M0 scales,
FP8 block-scaled linears (the Engram wkv among them) and MXFP4 experts.

The reference here shares no code with the loader: it parses the safetensors headers with `struct`
and `json`, reads the bytes with `open`, decodes E4M3 and E8M0 bit by bit and hashes with the
plain-loop `reference_hash`.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_serve.cli import main
from engram_serve.config import read_json
from engram_serve.engram.hashing import reference_hash
from engram_serve.engram.layout import build_layout
from engram_serve.engram.lookup import EngramReader, engram_lookup
from engram_serve.engram.quantized import Fp8Table
from engram_serve.errors import CheckpointMismatch
from engram_serve.engram.tables import EngramTables
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import Quant, save_v41_checkpoint
from fp8_tables import e4m3, e8m0

ROOT = Path(__file__).resolve().parents[1]
SHARD_MIB = 0.25
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)  # the the the"


def write_official(out: Path, *extra: str) -> Path:
    """The script's checkpoint with the built-in model's shape (or `--from` a checkpoint)."""
    shape = () if "--from" in extra else ("--config", str(TINY_DIR / "config.json"))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_official_checkpoint.py"), "--out", str(out),
                    "--shard-mib", str(SHARD_MIB), *shape, *extra], check=True, cwd=ROOT, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    return write_official(tmp_path_factory.mktemp("official") / "v41-small")


# ---- the independent reference: headers by hand, bytes by hand, E4M3 / E8M0 bits by hand ----

def raw_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def raw_bytes(root: Path, name: str) -> tuple[str, list[int], bytes]:
    shard = root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]
    header, base = raw_header(shard)
    e = header[name]
    with open(shard, "rb") as f:
        f.seek(base + e["data_offsets"][0])
        return e["dtype"], e["shape"], f.read(e["data_offsets"][1] - e["data_offsets"][0])


def reference_row(w: bytes, s: bytes, row: int, hd: int) -> list[np.float32]:
    out = []
    for col in range(hd):
        exact = e4m3(w[row * hd + col]) * e8m0(s[row * (hd // 32) + col // 32])  # exact in a double
        out.append(np.float32(exact))  # one rounding to float32
    return out


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


# ---- the layout ----

def test_directory_is_sharded_with_official_names_and_fp8_tables(official):
    names = set(os.listdir(official))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    cfg = read_json(official / "config.json")
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["model_type"] == "deepseek_v41"
    assert "engram_layer_ids" in cfg["text_config"] and "engram_layer_ids" not in cfg
    assert {"vision_config", "quantization_config"} <= set(cfg)
    weight_map = json.loads((official / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3 and all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors")
                                    for s in shards)
    text = cfg["text_config"]
    hd = text["engram_head_dim"]
    for lid, rows in zip(text["engram_layer_ids"], text["engram_num_embeddings"]):
        dtype, shape, data = raw_bytes(official, f"layers.{lid}.engram.embed.weight")
        assert (dtype, shape) == ("F8_E4M3", [rows, hd])
        assert len(data) > SHARD_MIB * 2**20  # the table is bigger than the shard size
        assert raw_bytes(official, f"layers.{lid}.engram.embed.scale")[:2] == ("F8_E8M0", [rows, hd // 32])
        wkv = raw_bytes(official, f"layers.{lid}.engram.wkv.weight")[:2]
        wkv_in = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * hd
        assert wkv == ("F8_E4M3", [(text["hc_mult"] + 1) * text["hidden_size"], wkv_in])
        assert raw_bytes(official, f"layers.{lid}.engram.wkv.scale")[:2] == ("F8_E8M0", [-(-wkv[1][0] // 32),
                                                                                         wkv[1][1] // 32])
        for qk in ("q_weight", "k_weight"):
            assert raw_bytes(official, f"layers.{lid}.engram.{qk}")[1] == [text["hc_mult"], text["hidden_size"]]
    assert "embed.weight" in weight_map and "head.weight" in weight_map
    assert not any(n.startswith("engram.") or "embed_tokens" in n for n in weight_map)
    experts = [n for n in weight_map if ".ffn.experts." in n and n.endswith(".weight")]
    assert experts and all(raw_bytes(official, n)[0] in ("I8", "U8") for n in experts[:4])  # MXFP4, packed


def test_script_is_deterministic(official, tmp_path):
    again = write_official(tmp_path / "again")
    for name in os.listdir(official):
        assert (official / name).read_bytes() == (again / name).read_bytes(), name


# ---- lookup, bit for bit against the plain dequantization ----

def test_lookup_json_equals_plain_dequantization(official, capsys):
    assert main(["lookup", "--model", str(official), "--json", TEXT]) == 0
    got = json.loads(capsys.readouterr().out)
    reader = EngramReader.open(official)
    ids = reader.tokenizer.encode(TEXT).ids
    assert got["token_ids"] == ids and len(ids) > 10
    text = read_json(official / "config.json")["text_config"]
    from engram_serve.config import EngramConfig
    cfg = EngramConfig.from_dict(read_json(official / "config.json"))
    tmap = reader.token_map.tolist()
    ref_hash = reference_hash(ids, [False] * len(ids), build_layout(cfg), tmap, tmap[cfg.engram_pad_token_id])
    assert got["hash_ids"] == ref_hash
    hd = text["engram_head_dim"]
    for layer, lid in enumerate(text["engram_layer_ids"]):
        _, _, w = raw_bytes(official, f"layers.{lid}.engram.embed.weight")
        _, _, s = raw_bytes(official, f"layers.{lid}.engram.embed.scale")
        for t in range(len(ids)):
            for c, row in enumerate(ref_hash[t][layer]):
                assert np.array_equal(bits(got["rows"][layer][t][c]), bits(reference_row(w, s, row, hd))), (layer, t, c)
    # the repeated "the" shares hash ids between tokens: dedup read them once, the staging still has every copy
    assert len({r for t in ref_hash for r in t[0]}) < len(ids) * cfg.num_columns


def test_lookup_reads_only_the_engram_shards_and_the_python_api_agrees(official, capsys):
    reader = EngramReader.open(official)
    weight_map = json.loads((official / "model.safetensors.index.json").read_text())["weight_map"]
    engram_shards = {weight_map[n] for n in weight_map if ".engram.embed." in n}
    assert {p.name for p in reader.shards} == engram_shards
    assert len(engram_shards) < len(set(weight_map.values()))
    res = engram_lookup(official, TEXT)
    assert main(["lookup", "--model", str(official), TEXT]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(res.token_ids) * 2
    assert res.digest(1, 3) in lines[1 + 3 * 2 + 1]


# ---- the engine ----

def test_fp8_model_equals_its_float32_conversion_and_generates(official, tmp_path):
    """The FP8 checkpoint (tables dequantized per row at gather, wkv at load) gives the same logits as a
    native float32 checkpoint holding the dequantized values, and the engine generates with it."""
    from engram_serve.llm import LLM
    from engram_serve.sampling_params import SamplingParams

    fp8 = load_model(official, pin_tables=False)
    assert all(isinstance(t, Fp8Table) for t in fp8.tables.tables)
    text = read_json(official / "config.json")["text_config"]
    native = save_v41_checkpoint(tmp_path / "native", text, fp8.model,
                                 EngramTables(fp8.tables.layer_ids, [t.dequantize() for t in fp8.tables.tables],
                                              pin=False), official / "tokenizer.json",
                                 Quant(linears=False, experts=None, tables=False))
    flt = load_model(native, pin_tables=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = [LLM(m).generate([TEXT, "import os\n"], params) for m in (fp8, flt)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(len(o.token_ids) == 12 for o in outs[0])
    e = fp8.config.engram
    ids = torch.tensor([fp8.tokenizer.encode(TEXT).ids])
    hid = torch.randint(0, min(e.engram_num_embeddings), (1, ids.shape[1], e.num_layers, e.num_columns))
    rows = []
    for m in (fp8, flt):
        staged = torch.empty(e.num_layers, ids.shape[1], e.num_columns, e.engram_head_dim)
        m.tables.gather(hid[0], staged)
        rows.append([staged[i][None] for i in range(e.num_layers)])
    assert all(torch.equal(a, b) for a, b in zip(*rows))
    with torch.no_grad():
        assert torch.equal(fp8.model.forward_dense(ids, rows[0]), flt.model.forward_dense(ids, rows[1]))
    # the script re-stores a float32 checkpoint quantized (tables, linears, experts): it loads, and its table
    # rows are the float ones within E4M3 precision
    again = load_model(write_official(tmp_path / "converted", "--from", str(native)), pin_tables=False)
    assert all(isinstance(t, Fp8Table) for t in again.tables.tables)
    for a, b in zip(again.tables.tables, flt.tables.tables):
        diff = (a.dequantize() - b).abs()
        assert (diff <= b.abs() * 2.0 ** -4 + b.abs().amax() * 2.0 ** -12).all()


def test_verify_passes_on_the_official_checkpoint(official):
    from engram_serve.verify import verify
    res = verify(load_model(official), seed=1, num_requests=3, gen_tokens=4,  # the cut sweep: tests/test_verify.py
                 only=("microbatches", "prefill chunk", "graph", "reused prefix", "preemption", "at token 7"))
    assert res["passed"], res
    assert res["straddling_rows"] > 0 and res["hash_mismatches"] == 0 and res["row_mismatches"] == 0


# ---- bad checkpoints fail at load, naming the file, the tensor and both values ----

@pytest.fixture
def broken(official, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(official, tmp_path / "copy"))
    return make


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _rewrite_shard(d: Path, name: str, fn) -> Path:
    from safetensors.torch import load_file, save_file
    shard = d / _index(d)["weight_map"][name]
    tensors = {k: v.clone() for k, v in load_file(shard).items()}
    fn(tensors)
    save_file(tensors, shard)
    return shard


def test_truncated_shard(broken):
    d = broken()
    shard = d / _index(d)["weight_map"]["layers.1.engram.embed.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointMismatch, match=rf"{shard.name}: not a valid safetensors file"):
        load_model(d)
    with pytest.raises(CheckpointMismatch, match=rf"{shard.name}"):
        EngramReader.open(d)


def test_index_names_a_shard_without_the_tensor(broken):
    d = broken()
    idx = _index(d)
    wrong = idx["weight_map"]["embed.weight"]
    idx["weight_map"]["layers.4.engram.embed.scale"] = wrong
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointMismatch, match=rf"{wrong}: the shard index places tensor "
                                                 r"'layers\.4\.engram\.embed\.scale' in this file"):
        load_model(d)


def test_missing_shard_and_missing_tensor(broken):
    d = broken()
    idx = _index(d)
    del idx["weight_map"]["layers.0.ffn.shared_experts.w2.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointMismatch, match=r"missing tensor.*layers\.0\.ffn\.shared_experts\.w2\.weight"
                                                 r".*\[128, 128\]"):
        load_model(d)
    idx["weight_map"]["layers.0.ffn.shared_experts.w2.weight"] = "model-00099-of-00007.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointMismatch, match=r"layers\.0\.ffn\.shared_experts\.w2\.weight"
                                                 r".*model-00099-of-00007"):
        load_model(d)


def _scale_as_uint8(t):
    t["layers.1.engram.embed.scale"] = t["layers.1.engram.embed.scale"].view(torch.uint8).clone()


def _scale_narrow(t):
    t["layers.1.engram.embed.scale"] = t["layers.1.engram.embed.scale"][:, :0].clone()


def _wkv_scale_shape(t):
    t["layers.1.engram.wkv.scale"] = t["layers.1.engram.wkv.scale"][:-1].clone()


def _table_as_int8(t):
    t["layers.1.engram.embed.weight"] = t["layers.1.engram.embed.weight"].view(torch.int8).clone()


def _q_weight_shape(t):
    t["layers.1.engram.q_weight"] = torch.zeros(3, 128)


@pytest.mark.parametrize("name, fn, pattern", [
    ("layers.1.engram.embed.scale", _scale_as_uint8,
     r"tensor 'layers\.1\.engram\.embed\.scale' has dtype U8, expected F8_E8M0"),
    ("layers.1.engram.embed.scale", _scale_narrow,
     r"tensor 'layers\.1\.engram\.embed\.scale' has shape \[\d+, 0\], expected \[\d+, 1\]"),
    ("layers.1.engram.wkv.scale", _wkv_scale_shape,
     r"scales 'layers\.1\.engram\.wkv\.scale' are F8_E8M0 \[19, 8\]; expected F8_E8M0 \[ceil\(640/b\), ceil\(256/b\)\]"),
    ("layers.1.engram.embed.weight", _table_as_int8,
     r"table 'layers\.1\.engram\.embed\.weight' has dtype I8, expected F8_E4M3"),
    ("layers.1.engram.q_weight", _q_weight_shape,
     r"tensor 'layers\.1\.engram\.q_weight': checkpoint shape \[3, 128\], the config needs \[4, 128\]"),
])
def test_wrong_dtype_or_shape_names_file_tensor_and_values(broken, name, fn, pattern):
    d = broken()
    shard = _rewrite_shard(d, name, fn)
    with pytest.raises(CheckpointMismatch, match=pattern) as info:
        load_model(d)
    assert shard.name in str(info.value)


def test_untouched_copy_loads(broken):
    """Control for the tests above: the copy, rewritten unchanged, loads."""
    d = broken()
    _rewrite_shard(d, "layers.1.engram.embed.scale", lambda t: None)
    load_model(d)
