"""DeepSeek-V4.1 checkpoints in the official layout: sharded safetensors, official names, FP8 block-scaled
linears, MXFP4 (or FP8) experts, FP8 Engram tables; DSpark and vision tensors left out with one line.

The dequantized weights are checked against plain bit decoders written here (E2M1 nibbles, E4M3 bytes,
E8M0 exponents), not against the loader's own code."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from engram_serve.errors import CheckpointMismatch
from engram_serve.model.loader import load_model
from engram_serve.model.writer import SMALL_TEXT_CONFIG, Quant, random_v41_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * E2M1[nibble & 7]


def e4m3(byte: int) -> float:
    sign, exp, man = -1.0 if byte & 0x80 else 1.0, (byte >> 3) & 15, byte & 7
    return sign * (man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def stored(d, name: str) -> torch.Tensor:
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(d / index[name]), framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41")
    extra = {"mtp.0.attn.wq_a.weight": torch.zeros(8, 8), "vision.blocks.0.attn.wo.weight": torch.zeros(4, 4),
             "aligner.w1.weight": torch.zeros(4, 4), "layers.2.ffn.gate.bias_vl": torch.zeros(4)}
    return random_v41_checkpoint(d, seed=3, shard_bytes=256 << 10, extra_tensors=extra)


def test_layout_is_official_and_sharded(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and cfg["text_config"]["model_type"] == "deepseek_v41_text"
    assert cfg["quantization_config"]["expert_dtype"] == "fp4"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.wgate.weight", "layers.4.attn.indexer.wk.weight",
                 "layers.6.attn.indexer.wq_b.scale", "layers.2.ffn.experts.3.w2.weight",
                 "layers.2.ffn.shared_experts.w1.scale", "layers.1.engram.embed.scale", "layers.3.engram.q_weight"):
        assert name in index, name
    assert "layers.4.attn.compressor.wgate.weight" not in index  # ratio 1: no gate
    assert "layers.2.attn.compressor.wkv.weight" not in index  # not a kv source
    assert stored(ckpt, "layers.2.ffn.experts.0.w1.weight").dtype == torch.int8
    assert stored(ckpt, "layers.2.attn.wq_b.weight").dtype == torch.float8_e4m3fn


def test_mxfp4_experts_decode_to_the_plain_definition(ckpt):
    model = load_model(ckpt).model
    i = SMALL_TEXT_CONFIG["moe_intermediate_size"]
    for e, proj in ((0, "w1"), (3, "w3"), (2, "w2")):
        w = stored(ckpt, f"layers.5.ffn.experts.{e}.{proj}.weight").view(torch.uint8)
        s = stored(ckpt, f"layers.5.ffn.experts.{e}.{proj}.scale").view(torch.uint8)
        rows, half = w.shape
        want = torch.tensor([[e2m1(int(w[r, c // 2]) >> (4 * (c % 2)) & 15) * 2.0 ** (int(s[r, c // 32]) - 127)
                              for c in range(2 * half)] for r in range(rows)])
        got = model.layers[5].ffn.w2[e] if proj == "w2" else model.layers[5].ffn.w13[e][(proj == "w3") * i:][:i]
        assert torch.equal(got, want.float()), (e, proj)


def test_fp8_block_linears_decode_to_the_plain_definition(ckpt):
    model = load_model(ckpt).model
    w = stored(ckpt, "layers.3.attn.wo_a.weight").view(torch.uint8)
    s = stored(ckpt, "layers.3.attn.wo_a.scale").view(torch.uint8)
    want = torch.tensor([[e4m3(int(w[r, c])) * 2.0 ** (int(s[r // 32, c // 32]) - 127) for c in range(w.shape[1])]
                         for r in range(w.shape[0])])
    assert torch.equal(model.layers[3].attn.wo_a.weight, want.float())


def test_not_text_forward_tensors_are_left_out_with_one_line(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="engram_serve.model.loader"):
        load_model(ckpt)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "4 tensor(s)" in lines[0]
    for kind in ("mtp", "vision", "aligner", "bias_vl"):
        assert kind in lines[0]


def test_fp8_experts_and_float_tables_load_too(tmp_path):
    d = random_v41_checkpoint(tmp_path, seed=1, quant=Quant(linears=False, experts="fp8", tables=False))
    model = load_model(d).model
    assert stored(d, "layers.0.ffn.experts.0.w1.weight").dtype == torch.float8_e4m3fn
    assert stored(d, "layers.1.engram.embed.weight").dtype == torch.float32
    assert model.layers[0].ffn.w13.dtype == torch.float32


def _rewrite(d, name: str, tensor: torch.Tensor | None):
    from safetensors.torch import save_file
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][name]
    with safe_open(str(d / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if tensor is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(d / shard))
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("name, tensor, match", [
    ("layers.2.ffn.experts.1.w3.scale", None, "needs its F8_E8M0 scales 'layers.2.ffn.experts.1.w3.scale'"),
    ("layers.2.ffn.experts.1.w3.weight", torch.zeros(32, 64, dtype=torch.int8), "MXFP4 tensor 'layers.2.ffn.experts.1.w3.weight'"),
    ("layers.0.attn.wkv.weight", None, "missing tensor 'layers.0.attn.wkv.weight'"),
])
def test_broken_checkpoints_are_refused_by_name(tmp_path, name, tensor, match):
    d = random_v41_checkpoint(tmp_path, seed=2)
    _rewrite(d, name, tensor)
    with pytest.raises(CheckpointMismatch, match=match):
        load_model(d)


def test_an_unknown_tensor_is_refused(tmp_path):
    d = random_v41_checkpoint(tmp_path, seed=2, extra_tensors={"layers.0.attn.wq.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointMismatch, match="unexpected tensor.*layers.0.attn.wq.weight"):
        load_model(d)
