"""The DeepSeek-V4.1 configurations `bench peers` runs, their arithmetic per token, and the machine's limits.

Two text configs without Engram (mlx-lm has none), both random float32 checkpoints in the official layout
written by `model.writer.random_v41_checkpoint` (so both engines load the very same tensors):
- `builtin`: the built-in model's shape (engram_serve/data/tiny/config.json), Engram layers removed;
- `mid`: hidden 1024, 8 layers with every layer role (window-only layers 0-1; ratio-2 kv and index source 2,
  whose top-k layer 3 reuses; ratio-1 kv, index and candidate source 4, whose top-k layer 5 reuses; ratio-1
  index source 6 restricted to 4's candidates, whose top-k layer 7 reuses), 16 heads of 128, 16 routed
  experts (4 a token) of 256 plus a shared one, hc_mult 4, the built-in tokenizer's vocabulary.

`flops_per_token` counts 2 x the multiply-adds of one token's forward at a given context (every matmul the
token runs: its k experts and the shared one, not all experts; attention over the keys it reads; the indexer's
scores over the entries it sees; the vocabulary projection); `prefill_flops` those a prompt's prefill runs
(the last layer of the tokens before the last makes their keys alone, one token's logits).
`weight_bytes_per_token` is what a B = 1 decode step must read from memory at least: every weight it
multiplies by once (float32), the k chosen experts only. `machine()` reports the clock, the float32 FMA width
and the copy bandwidth measured now, for the physical-limit figures.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

TINY_CONFIG = Path(__file__).resolve().parent.parent / "data" / "tiny" / "config.json"

MID = dict(
    vocab_size=4096, hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=1, head_dim=128, qk_rope_head_dim=64, q_lora_rank=512, o_lora_rank=256, o_groups=4,
    hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 1024},
    n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=128, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1],
    compress_rope_theta=160000.0, kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6], index_n_heads=16,
    index_head_dim=64, index_topk=64, candidate_source_layer_id=4, candidate_topk_blocks=16, candidate_block_size=8,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[], engram_num_embeddings=[],
    engram_max_ngram_size=3, engram_vocab_size=4096, engram_n_heads=4, engram_head_dim=32, engram_pad_token_id=1,
    engram_compressed_vocab_size=2726, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=0)
SHAPES = ("builtin", "mid")
INIT_STD = {"builtin": 0.05, "mid": 0.02}  # keeps the random mid-size model's activations moderate


def text_config(shape: str) -> dict:
    """The flat text config of `shape` (no Engram layers)."""
    if shape == "builtin":
        text = json.loads(TINY_CONFIG.read_text())["text_config"]
        return {**text, "engram_layer_ids": [], "engram_num_embeddings": []}
    if shape == "mid":
        return dict(MID)
    raise ValueError(f"V4.1 shape {shape!r}: expected one of {list(SHAPES)}")


def write_checkpoint(shape: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A random float32 checkpoint of `shape` in the official layout (the built-in tokenizer)."""
    from ..model.writer import Quant, random_v41_checkpoint
    return random_v41_checkpoint(out_dir, text_config(shape), seed, Quant(linears=False, experts=None, tables=False),
                                 std=INIT_STD[shape])


def _visible(cfg: dict, layer: int, ctx: int) -> tuple[int, int, int]:
    """(window keys, compressed keys attended, indexer entries scored) of a token with `ctx` tokens up to and
    including itself, at `layer`."""
    r = cfg["compress_ratios"][layer]
    window = min(cfg["sliding_window"], ctx)
    if not r:
        return window, 0, 0
    entries = ctx // r
    scored = entries if layer in cfg["index_source_layer_ids"] else 0
    return window, min(cfg["index_topk"], entries), scored


def _keys_macs(cfg: dict, layer: int) -> int:
    """Multiply-adds of a token's keys at `layer`: its window key, and at a kv source its compressor and index key."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    macs = d * hd  # wkv
    if layer in cfg["kv_source_layer_ids"]:
        macs += d * hd * (2 if cfg["compress_ratios"][layer] == 2 else 1) + hd * cfg["index_head_dim"]
    return macs


def _layer_macs(cfg: dict, layer: int, ctx: int) -> int:
    """Multiply-adds of one token at `layer` with `ctx` tokens of context (itself included)."""
    d, hc, h, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, og, inter = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"], cfg["moe_intermediate_size"]
    nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    macs = 2 * (2 + hc) * hc * hc * d  # the two mHC products
    macs += d * ql + ql * h * hd + og * (h * hd // og) * ol + og * ol * d  # wq_a, wq_b, wo_a, wo_b
    window, picked, scored = _visible(cfg, layer, ctx)
    macs += 2 * h * (window + picked) * hd  # scores and values
    macs += _keys_macs(cfg, layer)
    if layer in cfg["index_source_layer_ids"]:
        macs += ql * nh * ihd + d * nh + scored * nh * ihd  # indexer query, weights, scores
    return macs + d * cfg["n_routed_experts"] + (cfg["num_experts_per_tok"] + 1) * 3 * d * inter  # router, experts


def flops_per_token(cfg: dict, ctx: int) -> int:
    """2 x the multiply-adds of one token's forward with `ctx` tokens of context (itself included), its logits
    included."""
    return 2 * (sum(_layer_macs(cfg, layer, ctx) for layer in range(cfg["num_hidden_layers"]))
                + cfg["hidden_size"] * cfg["vocab_size"])


def prefill_flops(cfg: dict, prompt: int) -> int:
    """2 x the multiply-adds of a `prompt`-token prefill to its first token, as the serving forward runs it: every
    layer for every token, except that in the last layer the tokens before the last only make their keys (no
    later layer reads the rest: ForwardContext.keep), and the logits of the last token alone."""
    last = cfg["num_hidden_layers"] - 1
    body = sum(_layer_macs(cfg, layer, c) for layer in range(last) for c in range(1, prompt + 1))
    ends = (prompt - 1) * _keys_macs(cfg, last) + _layer_macs(cfg, last, prompt)
    return 2 * (body + ends + cfg["hidden_size"] * cfg["vocab_size"])


def weight_bytes_per_token(cfg: dict) -> int:
    """float32 bytes of the weights one B = 1 decode step multiplies by (each read at least once)."""
    d, hc, h, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, og, inter = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"], cfg["moe_intermediate_size"]
    nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    params = 0
    for layer in range(cfg["num_hidden_layers"]):
        params += 2 * (2 + hc) * hc * hc * d
        params += d * ql + ql * h * hd + d * hd + og * (h * hd // og) * ol + og * ol * d
        if layer in cfg["kv_source_layer_ids"]:
            params += d * hd * (2 if cfg["compress_ratios"][layer] == 2 else 1) + hd * ihd
        if layer in cfg["index_source_layer_ids"]:
            params += ql * nh * ihd + d * nh
        params += d * cfg["n_routed_experts"] + (cfg["num_experts_per_tok"] + 1) * 3 * d * inter
    params += d * cfg["vocab_size"]
    return 4 * params


def llama_flops_per_token(llama: dict, ctx: int) -> int:
    """2 x the multiply-adds of one token of the peers' Llama (transformers LlamaConfig fields) at `ctx`."""
    d, layers, inter = llama["hidden_size"], llama["num_hidden_layers"], llama["intermediate_size"]
    h, kvh, hd = llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]
    per_layer = d * h * hd + 2 * d * kvh * hd + h * hd * d + 3 * d * inter + 2 * h * ctx * hd
    return 2 * (layers * per_layer + d * llama["vocab_size"])


def measured_mhz(rounds: int = 1 << 21, repeats: int = 5) -> float | None:
    """The core's clock now, in MHz: the fastest of `repeats` timings of `rounds` x 8 dependent integer adds
    (one cycle each; the linear kernel's `spin_adds`), None without that kernel or off x86-64. A virtual
    machine's /proc/cpuinfo may give the nominal clock while the core runs faster (the Xeon here: 2,100 MHz
    reported, 2,700-3,600 measured, lower with both cores busy)."""
    from .. import kernels
    lin = kernels.get("linear")
    if lin is None or lin.spin_adds(1) is None:
        return None
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        lin.spin_adds(rounds)
        best = min(best, time.perf_counter() - t0)
    return 8 * rounds / best / 1e6


def cpu_facts() -> dict:
    """lscpu's model name, the clock (measured, `measured_mhz`, else what /proc/cpuinfo reports, which is also
    kept as `mhz_reported`) and the float32 lanes of one fused multiply-add (8 with AVX2 + FMA, 16 with
    AVX-512F) with the FMA units a core has (2 on the x86 cores here)."""
    text = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)$", text, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.*)$", text, re.M) or re.match("()", "")).group(1).split())
    lanes = 16 if "avx512f" in flags else (8 if {"avx2", "fma"} <= flags else 4)
    reported = float(mhz.group(1)) if mhz else None
    return {"cpu": model.group(1).strip() if model else "unknown", "mhz": measured_mhz() or reported,
            "mhz_reported": reported, "fma_lanes": lanes, "fma_units": 2}


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large array copy (read + write counted once each: 2 x size per copy), best of
    `repeats`: the memory bandwidth one thread sees now."""
    import numpy as np
    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second one thread reads a large array (a float32 sum: loads only), best of `repeats`: the
    rate a matrix-vector product can stream its weights at, which a copy does not show (its loads share the
    memory system with its stores)."""
    import torch
    src = torch.ones(mib << 18)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best
