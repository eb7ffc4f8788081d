"""The small random V4.1 model the peer comparisons run (tests/reference/test_peers_agree.py,
tests/reference/test_model_vs_peers.py): a config with every layer role in the published field names,
random weights under the official names, a prompt longer than the window."""
from __future__ import annotations

import math
from pathlib import Path

import torch

TOKENIZER = Path(__file__).resolve().parents[2] / "engram_serve" / "data" / "tiny" / "tokenizer.json"



def small_config(**overrides) -> dict:
    """A 6-layer V4.1 text_config with every layer role; published field names, Flash constants.

    Layer 0 window only; 1 ratio-2 kv + index source; 2 reuses 1's top-k; 3 ratio-1 kv + index +
    candidate source; 4 ratio-1 index source restricted to 3's candidates; 5 reuses 4's top-k.
    candidate_topk_blocks * candidate_block_size - (block - 1) > index_topk, so the candidates
    never hold fewer entries than the top-k (where NeMo and mlx are known to differ).
    """
    config = dict(
        vocab_size=4096, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True,
        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0,
        rms_norm_eps=1e-6, sliding_window=8, compress_ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3,
        candidate_topk_blocks=3, candidate_block_size=2, index_n_heads=8, index_head_dim=32,
        index_topk=4, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1048576, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[], engram_num_embeddings=[], engram_max_ngram_size=3, engram_n_heads=2,
        engram_head_dim=8, engram_vocab_size=97, engram_pad_token_id=1,
        engram_compressed_vocab_size=2726,
    )
    config.update(overrides)
    if "engram_layer_ids" in overrides and "engram_num_embeddings" not in overrides:
        config["engram_num_embeddings"] = _engram_rows(config)
    return config


def _engram_rows(config: dict) -> list[int]:
    """Table rows per Engram layer: the sum of its (N-1)*H fresh primes (SPEC section 2)."""
    used: set[int] = set()
    rows = []
    for _ in config["engram_layer_ids"]:
        total = 0
        for _ in range(config["engram_max_ngram_size"] - 1):
            current = config["engram_vocab_size"] - 1
            for _ in range(config["engram_n_heads"]):
                current += 1
                while current in used or any(current % d == 0 for d in range(2, math.isqrt(current) + 1)):
                    current += 1
                used.add(current)
                total += current
        rows.append(total)
    return rows


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors under the official checkpoint names, sized so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    D, hc, H, hd = c["hidden_size"], c["hc_mult"], c["num_attention_heads"], c["head_dim"]
    ql, og, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    nh, ihd, V = c["index_n_heads"], c["index_head_dim"], c["vocab_size"]

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"embed.weight": torch.randn(V, D, generator=g), "head.weight": lin(V, D), "norm.weight": norm(D)}
    mix = (2 + hc) * hc
    for l, ratio in enumerate(c["compress_ratios"][: c["num_hidden_layers"]]):
        p = f"layers.{l}."
        w[p + "attn_norm.weight"], w[p + "ffn_norm.weight"] = norm(D), norm(D)
        for s in ("attn", "ffn"):
            w[p + f"hc_{s}_fn"] = lin(mix, hc * D)
            w[p + f"hc_{s}_base"] = 0.5 * torch.randn(mix, generator=g)
            w[p + f"hc_{s}_scale"] = 1.0 + 0.2 * torch.randn(3, generator=g)
        w[p + "attn.wq_a.weight"], w[p + "attn.q_norm.weight"] = lin(ql, D), norm(ql)
        w[p + "attn.wq_b.weight"] = lin(H * hd, ql)
        w[p + "attn.wkv.weight"], w[p + "attn.kv_norm.weight"] = lin(hd, D), norm(hd)
        w[p + "attn.wo_a.weight"] = lin(og * ol, H * hd // og)
        w[p + "attn.wo_b.weight"] = lin(D, og * ol)
        w[p + "attn.attn_sink"] = torch.randn(H, generator=g)
        if l in c["kv_source_layer_ids"]:
            w[p + "attn.compressor.wkv.weight"], w[p + "attn.compressor.norm.weight"] = lin(hd, D), norm(hd)
            if ratio == 2:
                w[p + "attn.compressor.wgate.weight"] = lin(hd, D)
            w[p + "attn.indexer.wk.weight"], w[p + "attn.indexer.k_norm.weight"] = lin(ihd, hd), norm(ihd)
        if l in c["index_source_layer_ids"]:
            w[p + "attn.indexer.wq_b.weight"] = lin(nh * ihd, ql)
            w[p + "attn.indexer.weights_proj.weight"] = lin(nh, D)
        w[p + "ffn.gate.weight"], w[p + "ffn.gate.bias"] = lin(E, D), 0.1 * torch.randn(E, generator=g)
        for e in range(E):
            w[p + f"ffn.experts.{e}.w1.weight"], w[p + f"ffn.experts.{e}.w3.weight"] = lin(I, D), lin(I, D)
            w[p + f"ffn.experts.{e}.w2.weight"] = lin(D, I)
        for k in ("w1", "w3"):
            w[p + f"ffn.shared_experts.{k}.weight"] = lin(I, D)
        w[p + "ffn.shared_experts.w2.weight"] = lin(D, I)
        if l in c["engram_layer_ids"]:
            columns = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            rows = c["engram_num_embeddings"][c["engram_layer_ids"].index(l)]
            w[p + "engram.embed.weight"] = torch.randn(rows, c["engram_head_dim"], generator=g)
            w[p + "engram.wkv.weight"] = lin((hc + 1) * D, columns * c["engram_head_dim"])
            w[p + "engram.q_weight"] = norm(hc * D).view(hc, D)
            w[p + "engram.k_weight"] = norm(hc * D).view(hc, D)
    return w

# END OF LOCAL FIXTURES
# ---------------------------------------------------------------------------------------------

PROMPT_LEN = 41  # > sliding_window (8), > index_topk * ratio (8); odd: ends in an open ratio-2 group


def prompt_ids(config: dict, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, config["vocab_size"], (PROMPT_LEN,), generator=g).tolist()
