"""A random `qwen3moe` GGUF of the same size as a V4.1 bench shape, for llama.cpp's `llama-bench`.

The MoE is the shape's: hidden size, layers, routed experts, experts a token (top-k) and expert width
(`moe_intermediate_size`). qwen3moe has no shared expert, so the GGUF has none. The attention is the
shape's heads, head size and KV heads (mid: 16 heads of 128, one KV head) as plain grouped-query
projections with per-head q/k norms: V4.1's low-rank q and grouped o projections, compressors and
indexers have no qwen3moe counterpart, so its projections are about a third larger than the mid shape's
(4.5 M parameters a layer against 3.3 M, 3.5 M with the compressors and indexers spread over the layers);
without the shared expert, the bytes a decoded token reads come out close (`active_bytes`: 53.7 MiB in the
GGUF, 57.5 MiB in the mid checkpoint with its FP8 linears and BF16 head and mHC). The vocabulary and
tokenizer are the built-in model's (a byte-level BPE of 4096 tokens, stored as a `gpt2` tokenizer:
llama.cpp's loader needs token, type and merge lists even though llama-bench never tokenizes text).

Stored as llama.cpp's converters store such a model: routed experts MXFP4 (`ggml_mxfp4`: the official
packed E2M1 + E8M0 form of the V4.1 checkpoints, repacked into ggml's `block_mxfp4`, as llama.cpp's
DeepSeek converter does), the other matrices Q8_0, the router and the norms float32 (llama.cpp's converter
keeps `ffn_gate_inp` in float32). Random normal weights of standard deviation `std`, norms one.

Layout of one `block_mxfp4` (ggml-common.h), 17 bytes for 32 consecutive values of a row: byte 0 the E8M0
exponent e, bytes 1..16 the E2M1 codes, byte 1 + j holding value j in its low nibble and value j + 16 in
its high nibble; value = E2M1(code) x 2^(e - 127). The official form holds value 2i in the low nibble and
2i + 1 in the high nibble of byte i of a row, with one E8M0 byte per 32 values in a separate tensor.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCH = "qwen3moe"
BLOCK = 32  # values per MXFP4 and Q8_0 block
INSTALL = "pip install -e '.[bench]'"


@dataclass(frozen=True)
class GgufShape:
    """The qwen3moe hyperparameters of a V4.1 text config (`of_config`); `heads * head_dim` need not equal
    `hidden`, and `heads` is a multiple of `kv_heads`."""

    vocab: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_width: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int

    @classmethod
    def of_config(cls, cfg: dict) -> "GgufShape":
        shape = cls(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                    experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                    expert_width=cfg["moe_intermediate_size"], heads=cfg["num_attention_heads"],
                    kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rope_theta=cfg["rope_theta"],
                    rms_eps=cfg["rms_norm_eps"], context=cfg["max_position_embeddings"])
        if shape.heads % shape.kv_heads:
            raise ValueError(f"num_attention_heads={shape.heads} is not a multiple of num_key_value_heads={shape.kv_heads}")
        for name, n in (("hidden_size", shape.hidden), ("moe_intermediate_size", shape.expert_width),
                        ("num_attention_heads x head_dim", shape.heads * shape.head_dim)):
            if n % BLOCK:
                raise ValueError(f"{name}={n}: the GGUF's rows must be multiples of {BLOCK}")
        return shape


def ggml_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Official MXFP4 -> ggml blocks: packed [..., O, I/2] uint8/int8 (value 2i low nibble, 2i+1 high) and
    scale [..., O, I/32] E8M0 bytes -> [..., O, I/32 * 17] uint8 (`block_mxfp4`, module docstring).
    Moves bits only: the E2M1 codes and exponents are the same numbers in both forms."""
    p = np.ascontiguousarray(packed).view(np.uint8)
    s = np.ascontiguousarray(scale).view(np.uint8)
    *lead, rows, half = p.shape
    blocks = 2 * half // BLOCK
    if 2 * half % BLOCK or s.shape != (*lead, rows, blocks):
        raise ValueError(f"ggml_mxfp4: packed {p.shape} and scale {s.shape} are not [.., O, I/2] and [.., O, I/32]")
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*lead, rows, blocks, BLOCK)  # value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [..., O, blocks, 16]
    return np.concatenate([s[..., None], qs], axis=-1).reshape(*lead, rows, blocks * 17)


def mxfp4_experts(rng: np.random.Generator, experts: int, rows: int, cols: int, std: float) -> np.ndarray:
    """Random experts [E, rows, cols] quantized as the V4.1 checkpoints' experts (engram's `quantize_fp4`),
    as ggml blocks [E, rows, cols/32 * 17] uint8."""
    import torch

    from ..engram.quantized import quantize_fp4
    x = torch.from_numpy(rng.standard_normal((experts * rows, cols), dtype=np.float32) * std)
    packed, scale = quantize_fp4(x)
    blocks = ggml_mxfp4(packed.numpy(), scale.view(torch.uint8).numpy())
    return blocks.reshape(experts, rows, -1)


def q8_0(x: np.ndarray) -> np.ndarray:
    import gguf
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)


def _tokenizer(path: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges "a b") of a byte-level BPE tokenizer.json."""
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in tok.get("added_tokens", ()) if a.get("special")}
    types = [3 if i in special else 1 for i in range(len(tokens))]  # CONTROL, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_gguf(path: str | Path, cfg: dict, seed: int = 0, std: float = 0.02,
               tokenizer: str | Path | None = None) -> Path:
    """Write the random qwen3moe GGUF of the V4.1 text config `cfg` (module docstring); returns its path."""
    import gguf

    from ..model.checkpoint import TINY_DIR
    s = GgufShape.of_config(cfg)
    tokens, types, merges = _tokenizer(Path(tokenizer or TINY_DIR / "tokenizer.json"))
    if len(tokens) != s.vocab:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, the config's vocab_size is {s.vocab}")
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(f"random {ARCH} {s.hidden}x{s.layers} {s.experts}e{s.top_k}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.expert_width)
    w.add_expert_feed_forward_length(s.expert_width)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 0))
    w.add_eos_token_id(cfg.get("eos_token_id", 0))

    def matrix(rows: int, cols: int) -> np.ndarray:  # [rows, cols] float32
        return rng.standard_normal((rows, cols), dtype=np.float32) * std

    ones = np.ones
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    d, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    w.add_tensor("token_embd.weight", q8_0(matrix(s.vocab, d)), raw_dtype=q8)
    for i in range(s.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(d, np.float32))
        w.add_tensor(b + "attn_q.weight", q8_0(matrix(q, d)), raw_dtype=q8)
        w.add_tensor(b + "attn_k.weight", q8_0(matrix(kv, d)), raw_dtype=q8)
        w.add_tensor(b + "attn_v.weight", q8_0(matrix(kv, d)), raw_dtype=q8)
        w.add_tensor(b + "attn_output.weight", q8_0(matrix(d, q)), raw_dtype=q8)
        w.add_tensor(b + "attn_q_norm.weight", ones(s.head_dim, np.float32))
        w.add_tensor(b + "attn_k_norm.weight", ones(s.head_dim, np.float32))
        w.add_tensor(b + "ffn_norm.weight", ones(d, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", matrix(s.experts, d))
        w.add_tensor(b + "ffn_gate_exps.weight", mxfp4_experts(rng, s.experts, s.expert_width, d, std), raw_dtype=mx)
        w.add_tensor(b + "ffn_up_exps.weight", mxfp4_experts(rng, s.experts, s.expert_width, d, std), raw_dtype=mx)
        w.add_tensor(b + "ffn_down_exps.weight", mxfp4_experts(rng, s.experts, d, s.expert_width, std), raw_dtype=mx)
    w.add_tensor("output_norm.weight", ones(d, np.float32))
    w.add_tensor("output.weight", q8_0(matrix(s.vocab, d)), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def active_bytes(sizes: dict[str, int], routed: str, embedding: str, rows: int, top_k: int, experts: int) -> int:
    """Bytes a B = 1 decode step reads at least, from stored tensor sizes {name: bytes}: every tensor once,
    except the routed experts (names containing `routed`), of which top_k / experts, and the embedding
    (`embedding`, `rows` rows), of which one row."""
    total = 0
    for name, n in sizes.items():
        if routed in name:
            total += n * top_k // experts
        elif name == embedding:
            total += n // rows
        else:
            total += n
    return total


def gguf_sizes(path: str | Path) -> dict[str, int]:
    """{tensor name: stored bytes} of a GGUF file."""
    import gguf
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


def gguf_active_bytes(path: str | Path, cfg: dict) -> int:
    s = GgufShape.of_config(cfg)
    return active_bytes(gguf_sizes(path), "_exps.", "token_embd.weight", s.vocab, s.top_k, s.experts)
