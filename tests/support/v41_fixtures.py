"""Fixtures for DeepSeek-V4.1 tests: small valid text configs, random weights under the official names of
docs/deepseek_v41.md, and Engram hash ids from the project's own hashing (docs/contract.md §2).

Configs are flat dicts with the published `text_config` field names. Validity (NeMo's rules): every kv
source is an index source; ratio-0 layers are neither; the most recent kv source at or before a layer with
ratio > 0 has the layer's ratio; the candidate source, if any, is a kv source. `compress_ratios` may be
longer than `num_hidden_layers` (the DSpark layers after them), as published.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from hypothesis import strategies as st

import engram_serve
from engram_serve.config import EngramConfig
from engram_serve.engram.hashing import hash_step
from engram_serve.engram.layout import build_layout
from engram_serve.engram.token_map import build_token_map, load_tokenizer

TINY_TOKENIZER = Path(engram_serve.__file__).parent / "data" / "tiny" / "tokenizer.json"
TINY_VOCAB, TINY_COMPRESSED_VOCAB = 4096, 2726  # the built-in tokenizer's size and distinct keys

FIXED = {  # the published values of the fields that must not vary
    "hidden_act": "silu", "attention_bias": False, "num_key_value_heads": 1, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "hc_eps": 1e-6,
    "max_position_embeddings": 1048576, "engram_head_dim": 32,
}

_SMALL = {
    **FIXED,
    "vocab_size": 48, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 5,
    "num_attention_heads": 4, "head_dim": 16, "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_lora_rank": 8,
    "o_groups": 2, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5, "sliding_window": 4,
    "compress_ratios": [0, 1, 2, 2, 0, 0],  # 5 layers + one DSpark entry
    "compress_rope_theta": 160000.0,
    "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2, 3],
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 3,
    "candidate_source_layer_id": 2, "candidate_topk_blocks": 2, "candidate_block_size": 2,
    "hc_mult": 2, "hc_sinkhorn_iters": 20, "num_nextn_predict_layers": 1,
    "engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_vocab_size": 101,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 48,
}


def with_engram_rows(cfg: dict) -> dict:
    """A copy of cfg whose engram_num_embeddings are the per-layer table rows of the hash layout."""
    out = dict(cfg)
    if not out["engram_layer_ids"]:
        out["engram_num_embeddings"] = []
        return out
    out["engram_num_embeddings"] = [0] * len(out["engram_layer_ids"])
    out["engram_num_embeddings"] = build_layout(EngramConfig.from_dict(out), check_rows=False).table_rows
    return out


def small_v41_config(**overrides) -> dict:
    """A valid small config for hand-written tests (5 layers: window, ratio-1 and ratio-2 kv sources, a
    candidate source with a restricted index source after it, Engram on 2 layers); engram_num_embeddings
    follows the layout unless overridden."""
    cfg = {**_SMALL, **overrides}
    if "engram_num_embeddings" in overrides:
        return cfg
    return with_engram_rows(cfg)


def with_tiny_tokenizer(cfg: dict) -> dict:
    """cfg sized for the built-in tokenizer (hash with `token_map_for`)."""
    return with_engram_rows({**cfg, "vocab_size": TINY_VOCAB, "engram_compressed_vocab_size": TINY_COMPRESSED_VOCAB})


def _kv_sources(draw, ratios: list[int]) -> list[int]:
    """Every compressed layer whose most recent kv source has another ratio (or none) must be one; the
    others may be."""
    kv: list[int] = []
    for layer, r in enumerate(ratios):
        if r == 0:
            continue
        if not kv or ratios[kv[-1]] != r or draw(st.booleans()):
            kv.append(layer)
    return kv


@st.composite
def v41_configs(draw, tiny_tokenizer: bool | None = False, aligned_candidates: bool = True) -> dict:
    """Small valid V4.1 text configs. tiny_tokenizer: vocab of the built-in tokenizer (None: either), else a
    small vocab hashed with the identity map. aligned_candidates: every kv source after the candidate source
    has its ratio, so a restricted index source's entry g covers the positions of the candidate's entry g."""
    layers = draw(st.integers(2, 6))
    ratios = [draw(st.sampled_from([0, 1, 2])) for _ in range(layers)]
    dspark = draw(st.lists(st.sampled_from([0, 1, 2]), max_size=3))
    kv = _kv_sources(draw, ratios)
    index = sorted(set(kv) | {l for l, r in enumerate(ratios) if r > 0 and l not in kv and draw(st.booleans())})
    eligible = [c for c in kv if not aligned_candidates or all(ratios[k] == ratios[c] for k in kv if k > c)]
    candidate = draw(st.sampled_from([-1] + eligible))
    heads = draw(st.integers(1, 4))
    head_dim, index_head_dim = draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 16]))
    experts = draw(st.integers(2, 8))
    use_tiny = draw(st.booleans()) if tiny_tokenizer is None else tiny_tokenizer
    vocab = TINY_VOCAB if use_tiny else draw(st.integers(16, 64))
    cfg = {
        **FIXED,
        "vocab_size": vocab,
        "hidden_size": draw(st.sampled_from([16, 32])),
        "moe_intermediate_size": draw(st.sampled_from([8, 16])),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "qk_rope_head_dim": draw(st.sampled_from(list(range(2, min(head_dim, index_head_dim) + 1, 2)))),
        "q_lora_rank": draw(st.sampled_from([8, 16])),
        "o_lora_rank": draw(st.sampled_from([4, 8])),
        "o_groups": draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0])),
        "swiglu_limit": draw(st.sampled_from([0.0, 0.25, 1.0, 10.0])),  # 0: no clamp; 0.25 bites on most units
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-20])),
        "rope_theta": draw(st.sampled_from([10000.0, 50000.0])),
        "rope_scaling": {"rope_type": "yarn", "factor": draw(st.sampled_from([1, 4, 16])),
                         "beta_fast": draw(st.sampled_from([8, 32])), "beta_slow": draw(st.sampled_from([1, 2])),
                         "original_max_position_embeddings": draw(st.sampled_from([16, 256, 65536]))},
        "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(2, experts)),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 1.5, 2.5])),
        "sliding_window": draw(st.integers(2, 8)),
        "compress_ratios": ratios + dspark,
        "compress_rope_theta": draw(st.sampled_from([10000.0, 160000.0])),
        "kv_source_layer_ids": kv,
        "index_source_layer_ids": index,
        "index_n_heads": draw(st.integers(1, 4)),
        "index_head_dim": index_head_dim,
        "index_topk": draw(st.integers(1, 6)),
        "candidate_source_layer_id": candidate,
        "candidate_topk_blocks": draw(st.integers(1, 4)),
        "candidate_block_size": draw(st.integers(1, 4)),
        "hc_mult": draw(st.integers(1, 4)),
        "hc_sinkhorn_iters": draw(st.sampled_from([1, 3, 20])),
        "num_nextn_predict_layers": len(dspark),
        "engram_layer_ids": [l for l in range(layers) if draw(st.booleans())],
        "engram_max_ngram_size": draw(st.integers(2, 3)),
        "engram_n_heads": draw(st.integers(1, 4)),
        "engram_vocab_size": draw(st.integers(64, 300)),
        "engram_pad_token_id": draw(st.integers(0, 15)),
        "engram_compressed_vocab_size": TINY_COMPRESSED_VOCAB if vocab == TINY_VOCAB else vocab,
    }
    return with_engram_rows(cfg)


# ------------------------------------------------------------------------------------------------ weights

def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every text-forward tensor of the config under its official name, with its shape (docs table)."""
    d, hc, heads, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, og, ol, inter = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"], cfg["moe_intermediate_size"]
    nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    ratios = cfg["compress_ratios"]
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg["vocab_size"], d), "head.weight": (cfg["vocab_size"], d), "norm.weight": (d,)}
    engram_rows = dict(zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"]))
    columns = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        shapes[p + "attn_norm.weight"] = shapes[p + "ffn_norm.weight"] = (d,)
        for sub in ("attn", "ffn"):
            shapes[f"{p}hc_{sub}_fn"] = ((2 + hc) * hc, hc * d)
            shapes[f"{p}hc_{sub}_base"] = ((2 + hc) * hc,)
            shapes[f"{p}hc_{sub}_scale"] = (3,)
        a = p + "attn."
        shapes.update({a + "wq_a.weight": (ql, d), a + "q_norm.weight": (ql,), a + "wq_b.weight": (heads * hd, ql),
                       a + "wkv.weight": (hd, d), a + "kv_norm.weight": (hd,),
                       a + "wo_a.weight": (og * ol, heads * hd // og), a + "wo_b.weight": (d, og * ol),
                       a + "attn_sink": (heads,)})
        if layer in cfg["kv_source_layer_ids"]:
            shapes.update({a + "compressor.wkv.weight": (hd, d), a + "compressor.norm.weight": (hd,),
                           a + "indexer.wk.weight": (ihd, hd), a + "indexer.k_norm.weight": (ihd,)})
            if ratios[layer] == 2:
                shapes[a + "compressor.wgate.weight"] = (hd, d)
        if layer in cfg["index_source_layer_ids"]:
            shapes.update({a + "indexer.wq_b.weight": (nh * ihd, ql), a + "indexer.weights_proj.weight": (nh, d)})
        f = p + "ffn."
        shapes.update({f + "gate.weight": (cfg["n_routed_experts"], d), f + "gate.bias": (cfg["n_routed_experts"],)})
        for e in [f"experts.{i}." for i in range(cfg["n_routed_experts"])] + ["shared_experts."]:
            shapes.update({f + e + "w1.weight": (inter, d), f + e + "w3.weight": (inter, d),
                           f + e + "w2.weight": (d, inter)})
        if layer in engram_rows:
            g = p + "engram."
            shapes.update({g + "embed.weight": (engram_rows[layer], cfg["engram_head_dim"]),
                           g + "wkv.weight": ((hc + 1) * d, columns * cfg["engram_head_dim"]),
                           g + "q_weight": (hc, d), g + "k_weight": (hc, d)})
    return {**shapes, **dspark_shapes(cfg)}


def has_drafter(cfg: dict) -> bool:
    return cfg.get("num_nextn_predict_layers", 0) > 0 and bool(cfg.get("dspark_target_layer_ids"))


def dspark_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The DSpark drafter's tensors (`mtp.*`) of a config that has one, with their shapes; else none."""
    if not has_drafter(cfg):
        return {}
    d, hc, heads, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, og, ol, inter = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"], cfg["moe_intermediate_size"]
    n, rank, experts = cfg["num_nextn_predict_layers"], cfg["dspark_markov_rank"], cfg["dspark_n_routed_experts"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        p = f"mtp.{i}."
        shapes[p + "attn_norm.weight"] = shapes[p + "ffn_norm.weight"] = (d,)
        for sub in ("attn", "ffn"):
            shapes.update({f"{p}hc_{sub}_fn": ((2 + hc) * hc, hc * d), f"{p}hc_{sub}_base": ((2 + hc) * hc,),
                           f"{p}hc_{sub}_scale": (3,)})
        a = p + "attn."
        shapes.update({a + "wq_a.weight": (ql, d), a + "q_norm.weight": (ql,), a + "wq_b.weight": (heads * hd, ql),
                       a + "wkv.weight": (hd, d), a + "kv_norm.weight": (hd,),
                       a + "wo_a.weight": (og * ol, heads * hd // og), a + "wo_b.weight": (d, og * ol),
                       a + "attn_sink": (heads,)})
        f = p + "ffn."
        shapes.update({f + "gate.weight": (experts, d), f + "gate.bias": (experts,)})
        for e in [f"experts.{j}." for j in range(experts)] + ["shared_experts."]:
            shapes.update({f + e + "w1.weight": (inter, d), f + e + "w3.weight": (inter, d),
                           f + e + "w2.weight": (d, inter)})
    shapes["mtp.0.main_proj.weight"] = (d, len(cfg["dspark_target_layer_ids"]) * d)
    shapes["mtp.0.main_norm.weight"] = (d,)
    last = f"mtp.{n - 1}."
    shapes.update({last + "norm.weight": (d,), last + "markov_head.embed.weight": (cfg["vocab_size"], rank),
                   last + "markov_head.head.weight": (cfg["vocab_size"], rank),
                   last + "confidence_head.proj.weight": (1, d + rank)})
    return shapes


def with_drafter(cfg: dict, layers: int = 2, block: int = 3, targets: tuple[int, ...] | None = None,
                 rank: int = 8, experts: int = 4, per_token: int = 2, noise: int | None = None) -> dict:
    """cfg with a DSpark drafter: `layers` draft layers (ratio 0 after the backbone's), reading the streams entering
    `targets` (default: the last two layers)."""
    n = cfg["num_hidden_layers"]
    return {**cfg, "compress_ratios": list(cfg["compress_ratios"][:n]) + [0] * layers,
            "num_nextn_predict_layers": layers, "dspark_block_size": block,
            "dspark_noise_token_id": cfg["vocab_size"] - 1 if noise is None else noise,
            "dspark_target_layer_ids": list(targets if targets is not None else range(max(0, n - 2), n)),
            "dspark_markov_rank": rank, "dspark_n_routed_experts": experts, "dspark_num_experts_per_tok": per_token}


def _std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's init: activations stay O(1); norms near 1; hc fn small; sinks near 0;
    the gate bias small enough that it changes the selection only sometimes."""
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1.0, 0.1
    if name.endswith("_fn"):
        return 0.0, 0.5 / shape[1] ** 0.5
    if name.endswith("_base"):
        return 0.0, 0.3
    if name.endswith("_scale"):
        return 1.0, 0.2
    if name.endswith("attn_sink"):
        return 0.0, 0.5
    if name.endswith("gate.bias"):
        return 0.0, 0.1
    if name == "embed.weight" or name.endswith(("engram.embed.weight", "markov_head.embed.weight")):
        return 0.0, 1.0
    return 0.0, 1.0 / shape[1] ** 0.5  # a projection [out, in]: unit-variance outputs for unit inputs


def random_v41_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors under the official names and shapes, drawn from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        mean, std = _std(name, shape)
        out[name] = (mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)).to(torch.float32)
    return out


# ------------------------------------------------------------------------------------------------ Engram hash ids

@lru_cache(maxsize=1)
def tiny_token_map() -> torch.Tensor:
    """[4096] int64: the built-in tokenizer's compressed token map (2726 keys)."""
    return build_token_map(load_tokenizer(TINY_TOKENIZER), TINY_COMPRESSED_VOCAB)


def token_map_for(config: dict) -> torch.Tensor:
    """The identity map of a small vocab, or the built-in tokenizer's map for its vocab."""
    vocab, compressed = config["vocab_size"], config["engram_compressed_vocab_size"]
    if (vocab, compressed) == (TINY_VOCAB, TINY_COMPRESSED_VOCAB):
        return tiny_token_map()
    if vocab != compressed:
        raise ValueError(f"engram_compressed_vocab_size={compressed} with vocab_size={vocab}: no token map "
                         "known (identity needs them equal); pass token_map")
    return torch.arange(vocab, dtype=torch.int64)


def engram_hash_ids(config: dict, token_ids: list[int], dead: list[bool] | None = None,
                    token_map: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """{Engram layer id: [S, (N-1)*H_e] int64 table rows} of one request from position 0 (hash_step)."""
    if not config["engram_layer_ids"]:
        return {}
    layout = build_layout(EngramConfig.from_dict(config))
    tmap = token_map_for(config) if token_map is None else token_map
    pad = int(tmap[config["engram_pad_token_id"]])
    history = torch.full((1, config["engram_max_ngram_size"] - 1), -1, dtype=torch.int64)  # before position 0
    dead_t = None if dead is None else torch.tensor(dead, dtype=torch.bool)
    ids = hash_step(torch.tensor(token_ids, dtype=torch.int64), torch.tensor([0, len(token_ids)]), history,
                    layout, tmap, pad, dead_t)  # [S, L_e, C]
    return {layer: ids[:, j, :].clone() for j, layer in enumerate(config["engram_layer_ids"])}
