"""Tests of the float64 DeepSeek-V4.1 reference itself (tests/reference/reference_v41.py).

Hand-computed cases recompute one layer with vectorised torch (masks, einsum, complex rotation), a
different route from the reference's loops; the building blocks are checked against facts that hold by
construction (Sinkhorn's sums, a -inf sink, identical tokens pooled, the tie rule, the gate's root)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_v41 import (NearTie, Reference, attend, check_config, compressor_latent, engram_gate, flat_config,
                           fragile_pair, reference_forward, rope, rope_frequencies, sigmoid, sinkhorn, swiglu, top_k)
from v41_fixtures import (engram_hash_ids, random_v41_weights, small_v41_config, token_map_for, v41_configs,
                          with_engram_rows, with_tiny_tokenizer)

F64 = torch.float64
TOKENS = [5, 17, 3, 40, 22, 9, 31, 12, 7, 26, 2, 44, 19]


# ------------------------------------------------------------------------------------------------ hand model
# A second, vectorised forward for configs whose compressed layers are each their own kv and index source
# and that have no candidate source: whole-sequence tensors, masks and einsum instead of loops.

def in_hand_scope(cfg: dict) -> dict:
    """cfg with every compressed layer its own kv and index source and no candidate source (still valid)."""
    compressed = [l for l in range(cfg["num_hidden_layers"]) if cfg["compress_ratios"][l] > 0]
    return with_engram_rows({**cfg, "kv_source_layer_ids": compressed, "index_source_layer_ids": compressed,
                             "candidate_source_layer_id": -1})


def t64(w: dict, name: str) -> torch.Tensor:
    return w[name].to(F64)


def hand_rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def hand_freqs(cfg: dict, ratio: int) -> torch.Tensor:
    """[rd/2] rotation frequencies of a layer: plain, or compress_rope_theta with YaRN's ramp."""
    rd = cfg["qk_rope_head_dim"]
    theta = cfg["compress_rope_theta"] if ratio else cfg["rope_theta"]
    f = theta ** (-torch.arange(0, rd, 2, dtype=F64) / rd)
    if not ratio:
        return f
    y = cfg["rope_scaling"]
    c = [rd * math.log(y["original_max_position_embeddings"] / (2 * math.pi * b)) / (2 * math.log(theta))
         for b in (y["beta_fast"], y["beta_slow"])]
    lo, hi = max(math.floor(c[0]), 0), min(math.ceil(c[1]), rd - 1)
    ramp = ((torch.arange(rd // 2, dtype=F64) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
    return f / y["factor"] * ramp + f * (1 - ramp)


def hand_rope(t: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """t [S, ..., width]: rotate the last 2*len(freqs) dims (interleaved pairs) of row s by positions[s] * f."""
    rd = 2 * freqs.shape[0]
    ang = positions.to(F64)[:, None] * freqs[None] * (-1 if inverse else 1)  # [S, rd/2]
    rot = torch.polar(torch.ones_like(ang), ang).view(t.shape[0], *([1] * (t.dim() - 2)), rd // 2)
    pairs = torch.view_as_complex(t[..., t.shape[-1] - rd:].reshape(*t.shape[:-1], rd // 2, 2).contiguous())
    return torch.cat([t[..., :t.shape[-1] - rd], torch.view_as_real(pairs * rot).flatten(-2)], dim=-1)


def hand_top_k(row: torch.Tensor, k: int) -> list[int]:
    finite = [g for g in range(len(row)) if row[g] > -math.inf]
    return sorted(finite, key=lambda g: (-float(row[g]), g))[:k]


def hand_entries(cfg: dict, w: dict, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ckv [G, hd], ik [G, ihd]) of a kv source from its attention inputs x [S, D]."""
    p, r, eps = f"layers.{layer}.attn.", cfg["compress_ratios"][layer], cfg["rms_norm_eps"]
    g, hd = x.shape[0] // r, cfg["head_dim"]
    a = (x[:g * r] @ t64(w, p + "compressor.wkv.weight").T).view(g, r, hd)  # [G, r, hd]
    if r == 2:
        s = (x[:g * r] @ t64(w, p + "compressor.wgate.weight").T).view(g, r, hd)
        a = (torch.softmax(s, dim=1) * a).sum(1, keepdim=True)
    latent = hand_rmsnorm(a[:, 0], t64(w, p + "compressor.norm.weight"), eps)  # [G, hd]
    starts, freqs = torch.arange(g) * r, hand_freqs(cfg, r)
    ik = hand_rmsnorm(latent @ t64(w, p + "indexer.wk.weight").T, t64(w, p + "indexer.k_norm.weight"), eps)
    return hand_rope(latent, starts, freqs), hand_rope(ik, starts, freqs)


def hand_index_scores(cfg: dict, w: dict, layer: int, x: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """[S, G] s(g) of an index source; -inf where entry g is not yet visible."""
    p, eps, r = f"layers.{layer}.attn.", cfg["rms_norm_eps"], cfg["compress_ratios"][layer]
    nh, ihd, seq = cfg["index_n_heads"], cfg["index_head_dim"], x.shape[0]
    qr = hand_rmsnorm(x @ t64(w, p + "wq_a.weight").T, t64(w, p + "q_norm.weight"), eps)
    qi = hand_rope((qr @ t64(w, p + "indexer.wq_b.weight").T).view(seq, nh, ihd), torch.arange(seq), hand_freqs(cfg, r))
    wh = x @ t64(w, p + "indexer.weights_proj.weight").T / math.sqrt(ihd) / math.sqrt(nh)  # [S, nh]
    s = torch.einsum("sh,shg->sg", wh, torch.relu(torch.einsum("shd,gd->shg", qi, ik)))
    visible = torch.arange(ik.shape[0])[None, :] < ((torch.arange(seq) + 1) // r)[:, None]
    return torch.where(visible, s, torch.tensor(-math.inf, dtype=F64))


def hand_attention(cfg: dict, w: dict, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """(attention output [S, D], chosen entries per position) of one layer from its inputs x [S, D]:
    a masked softmax over the window and the chosen entries with one extra sink column."""
    p, eps, seq, r = f"layers.{layer}.attn.", cfg["rms_norm_eps"], x.shape[0], cfg["compress_ratios"][layer]
    heads, hd, og = cfg["num_attention_heads"], cfg["head_dim"], cfg["o_groups"]
    pos, freqs = torch.arange(seq), hand_freqs(cfg, r)
    qr = hand_rmsnorm(x @ t64(w, p + "wq_a.weight").T, t64(w, p + "q_norm.weight"), eps)
    q = hand_rope((qr @ t64(w, p + "wq_b.weight").T).view(seq, heads, hd), pos, freqs)  # [S, H, hd]
    kv = hand_rope(hand_rmsnorm(x @ t64(w, p + "wkv.weight").T, t64(w, p + "kv_norm.weight"), eps), pos, freqs)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg["sliding_window"])  # [S, S]
    chosen: list[list[int]] = []
    keys = kv
    if r:
        ckv, ik = hand_entries(cfg, w, layer, x)
        scores = hand_index_scores(cfg, w, layer, x, ik)
        chosen = [hand_top_k(scores[s], cfg["index_topk"]) for s in range(seq)]
        picked = torch.zeros(seq, ckv.shape[0], dtype=torch.bool)
        for s, gs in enumerate(chosen):
            picked[s, gs] = True
        keys, mask = torch.cat([kv, ckv]), torch.cat([mask, picked], dim=1)
    z = torch.einsum("shd,kd->shk", q, keys) / math.sqrt(hd)  # [S, H, K]
    z = torch.where(mask[:, None, :], z, torch.tensor(-math.inf, dtype=F64))
    sink = t64(w, p + "attn_sink").view(1, heads, 1).expand(seq, heads, 1)
    prob = torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :-1]
    o = hand_rope(torch.einsum("shk,kd->shd", prob, keys), pos, freqs, inverse=True)  # [S, H, hd]
    wo_a = t64(w, p + "wo_a.weight").view(og, cfg["o_lora_rank"], heads * hd // og)
    u = torch.einsum("sgi,goi->sgo", o.reshape(seq, og, heads * hd // og), wo_a).reshape(seq, -1)
    return u @ t64(w, p + "wo_b.weight").T, chosen


def hand_mhc(cfg: dict, w: dict, layer: int, sub: str, xs: torch.Tensor):
    """(pre [S, hc], post [S, hc], C [S, hc, hc]) from the streams xs [S, hc, D]."""
    p, hc, e = f"layers.{layer}.hc_{sub}_", xs.shape[1], cfg["hc_eps"]
    v = xs.reshape(xs.shape[0], -1)  # [S, hc*D]
    scale = t64(w, p + "scale")
    scales = torch.cat([scale[0].repeat(hc), scale[1].repeat(hc), scale[2].repeat(hc * hc)])
    m = (v @ t64(w, p + "fn").T) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * scales
    m = m + t64(w, p + "base")
    c = torch.softmax(m[:, 2 * hc:].view(-1, hc, hc), dim=-1) + e
    c = c / (c.sum(1, keepdim=True) + e)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        c = c / (c.sum(2, keepdim=True) + e)
        c = c / (c.sum(1, keepdim=True) + e)
    return torch.sigmoid(m[:, :hc]) + e, 2 * torch.sigmoid(m[:, hc:2 * hc]), c


def hand_moe(cfg: dict, w: dict, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    p, limit = f"layers.{layer}.ffn.", cfg["swiglu_limit"]

    def expert(name: str) -> torch.Tensor:
        g, u = x @ t64(w, name + "w1.weight").T, x @ t64(w, name + "w3.weight").T
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (torch.nn.functional.silu(g) * u) @ t64(w, name + "w2.weight").T  # [S, D]

    score = torch.logaddexp(x @ t64(w, p + "gate.weight").T, torch.zeros(1, dtype=F64)).sqrt()  # [S, E]
    chosen = [hand_top_k(row, cfg["num_experts_per_tok"]) for row in score + t64(w, p + "gate.bias")]
    out = expert(p + "shared_experts.")
    for e in range(cfg["n_routed_experts"]):
        wt = torch.tensor([float(score[s, e] / score[s, c].sum()) if e in c else 0.0 for s, c in enumerate(chosen)],
                          dtype=F64)
        out = out + (wt * cfg["routed_scaling_factor"])[:, None] * expert(f"{p}experts.{e}.")
    return out, chosen


def hand_engram(cfg: dict, w: dict, layer: int, xs: torch.Tensor, hashes: torch.Tensor, dead: list[bool]):
    p, d, eps = f"layers.{layer}.engram.", cfg["hidden_size"], cfg["rms_norm_eps"]
    hc = xs.shape[1]
    e = t64(w, p + "embed.weight")[hashes].reshape(xs.shape[0], -1)  # [S, C*ehd]
    kv = e @ t64(w, p + "wkv.weight").T  # [S, (hc+1)*D]
    k, v = kv[:, :hc * d].view(-1, hc, d), kv[:, hc * d:]
    dot = (hand_rmsnorm(xs, None, eps) * t64(w, p + "q_weight") * hand_rmsnorm(k, None, eps)
           * t64(w, p + "k_weight")).sum(-1) / math.sqrt(d)  # [S, hc]
    sign = torch.where(dot >= 0, 1.0, -1.0)
    gate = torch.sigmoid(sign * dot.abs().clamp(min=1e-6).sqrt()) * (~torch.tensor(dead))[:, None]
    return xs + gate[..., None] * v[:, None, :]


def hand_forward(cfg: dict, w: dict, tokens: list[int], hashes: dict, dead: list[bool]):
    """(logits [S, V], experts {layer: per position}, index_topk {layer: per position}) of an in-scope config."""
    assert cfg == in_hand_scope(cfg), "the hand forward needs self-sourced compressed layers"
    seq, hc = len(tokens), cfg["hc_mult"]
    xs = t64(w, "embed.weight")[tokens][:, None, :].repeat(1, hc, 1)  # [S, hc, D]
    pre_prev = torch.zeros(seq, hc, dtype=F64)
    pre_prev[:, 0] = 1.0
    experts, index_topk = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        if layer in cfg["engram_layer_ids"]:
            xs = hand_engram(cfg, w, layer, xs, hashes[layer], dead)
        pre_a, post_a, c_a = hand_mhc(cfg, w, layer, "attn", xs)
        x = hand_rmsnorm(torch.einsum("si,sid->sd", pre_prev, xs), t64(w, p + "attn_norm.weight"), cfg["rms_norm_eps"])
        o, chosen = hand_attention(cfg, w, layer, x)
        if chosen:
            index_topk[layer] = chosen
        xs = post_a[..., None] * o[:, None, :] + torch.einsum("sab,sad->sbd", c_a, xs)
        pre_f, post_f, c_f = hand_mhc(cfg, w, layer, "ffn", xs)
        x = hand_rmsnorm(torch.einsum("si,sid->sd", pre_a, xs), t64(w, p + "ffn_norm.weight"), cfg["rms_norm_eps"])
        o, experts[layer] = hand_moe(cfg, w, layer, x)
        xs = post_f[..., None] * o[:, None, :] + torch.einsum("sab,sad->sbd", c_f, xs)
        pre_prev = pre_f
    hidden = hand_rmsnorm(torch.einsum("si,sid->sd", pre_prev, xs), t64(w, "norm.weight"), cfg["rms_norm_eps"])
    return hidden @ t64(w, "head.weight").T, experts, index_topk


def one_layer_config(ratio: int, **over) -> dict:
    """One layer, hc_mult 1, exact mHC (hc_eps 0), no Engram."""
    sources = [0] if ratio else []
    base = dict(num_hidden_layers=1, compress_ratios=[ratio], kv_source_layer_ids=sources,
                index_source_layer_ids=sources, candidate_source_layer_id=-1, hc_mult=1, hc_eps=0.0,
                engram_layer_ids=[], rms_norm_eps=1e-20)
    return small_v41_config(**{**base, **over})


def without_mhc_and_moe(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Weights where mHC is constant (fn = 0: m = base) and every expert's output is 0."""
    w = random_v41_weights(cfg, seed)
    for name in w:
        if name.endswith("_fn") or (".ffn." in name and name.endswith("w2.weight")):
            w[name] = torch.zeros_like(w[name])
    return w


def hand_one_layer_logits(cfg: dict, w: dict, tokens: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [S, V] of `one_layer_config` with `without_mhc_and_moe` weights, and the chosen entries.

    hc = 1 with hc_eps 0 makes C = 1, so the stream after attention is e + 2 sigmoid(base[1]) * attn(x); the
    MoE adds 0 and the final rmsnorm does not see the constant pre."""
    eps = cfg["rms_norm_eps"]
    e = t64(w, "embed.weight")[tokens]
    attn, chosen = hand_attention(cfg, w, 0, hand_rmsnorm(e, t64(w, "layers.0.attn_norm.weight"), eps))
    post = 2 * torch.sigmoid(t64(w, "layers.0.hc_attn_base")[1])
    hidden = hand_rmsnorm(e + post * attn, t64(w, "norm.weight"), eps)
    return hidden @ t64(w, "head.weight").T, chosen


@pytest.mark.parametrize("window", [len(TOKENS), 3])
def test_one_window_layer_is_causal_softmax_attention_with_a_sink(window):
    cfg = one_layer_config(0, sliding_window=window)
    w = without_mhc_and_moe(cfg, seed=3)
    want, _ = hand_one_layer_logits(cfg, w, TOKENS)
    got = reference_forward(cfg, w, TOKENS)
    torch.testing.assert_close(got.logits, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.logprobs.exp().sum(-1), torch.ones(len(TOKENS), dtype=F64))


@pytest.mark.parametrize("ratio,topk", [(1, 2), (1, 100), (2, 1), (2, 100)])
def test_one_compressed_layer_attends_its_window_and_the_chosen_entries(ratio, topk):
    cfg = one_layer_config(ratio, sliding_window=2, index_topk=topk)
    w = without_mhc_and_moe(cfg, seed=4)
    want, chosen = hand_one_layer_logits(cfg, w, TOKENS)
    got = reference_forward(cfg, w, TOKENS)
    assert got.index_topk[0] == chosen
    assert any(len(c) == min(topk, (p + 1) // ratio) for p, c in enumerate(chosen))
    torch.testing.assert_close(got.logits, want, rtol=1e-10, atol=1e-10)


def test_candidate_blocks_by_hand_and_the_restriction_after_them():
    cfg = small_v41_config(num_hidden_layers=2, compress_ratios=[1, 1], kv_source_layer_ids=[0],
                           index_source_layer_ids=[0, 1], candidate_source_layer_id=0, candidate_block_size=2,
                           candidate_topk_blocks=2, index_topk=4, engram_layer_ids=[])
    w = random_v41_weights(cfg, seed=5)
    got = reference_forward(cfg, w, TOKENS)
    x = hand_rmsnorm(t64(w, "embed.weight")[TOKENS], t64(w, "layers.0.attn_norm.weight"), cfg["rms_norm_eps"])
    scores = hand_index_scores(cfg, w, 0, x, hand_entries(cfg, w, 0, x)[1])  # [S, G]
    for p in range(len(TOKENS)):
        n = p + 1  # visible entries at ratio 1
        blocks = [float(scores[p, b * 2:min(b * 2 + 2, n)].max()) for b in range((n + 1) // 2)]
        blocks[(n - 1) // 2] = math.inf
        assert got.candidates[p] == hand_top_k(torch.tensor(blocks), 2)
        allowed = {g for b in got.candidates[p] for g in (2 * b, 2 * b + 1)}
        assert set(got.index_topk[1][p]) <= allowed  # the index source after the candidate source
    assert any(len(got.index_topk[1][p]) == 4 for p in range(len(TOKENS)))
    assert any(set(got.index_topk[1][p]) != set(hand_top_k(scores[p], 4)) for p in range(len(TOKENS)))


HAND_CASES = {
    "hc4-window-r1-r2-engram-clamp": dict(num_hidden_layers=3, compress_ratios=[0, 1, 2], hc_mult=4,
                                          engram_layer_ids=[0, 2], swiglu_limit=0.25, rms_norm_eps=1e-20),
    "hc2-two-r2-sources": dict(num_hidden_layers=2, compress_ratios=[2, 2, 1], hc_mult=2, engram_layer_ids=[1],
                               sliding_window=2, index_topk=2, index_n_heads=1),
    "hc3-window-only": dict(num_hidden_layers=4, compress_ratios=[0, 0, 0, 0], hc_mult=3, hc_sinkhorn_iters=3,
                            engram_layer_ids=[3], n_routed_experts=7, num_experts_per_tok=3, swiglu_limit=0.0),
}


def assert_matches_hand(cfg: dict, seed: int, tokens: list[int], dead: list[bool]) -> None:
    w = random_v41_weights(cfg, seed)
    hashes = engram_hash_ids(cfg, tokens, dead)
    got = reference_forward(cfg, w, tokens, hashes, dead)
    logits, experts, index_topk = hand_forward(cfg, w, tokens, hashes, dead)
    assert got.experts == experts and got.index_topk == index_topk
    torch.testing.assert_close(got.logits, logits, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_the_reference_equals_a_vectorised_hand_forward(case):
    cfg = in_hand_scope(small_v41_config(**HAND_CASES[case]))
    dead = [p % 5 == 3 for p in range(len(TOKENS))]
    assert_matches_hand(cfg, seed=9, tokens=TOKENS, dead=dead)


@settings(max_examples=8, deadline=None)
@given(cfg=v41_configs(), data=st.data())
def test_the_reference_equals_the_hand_forward_on_self_sourced_configs(cfg, data):
    cfg = in_hand_scope(cfg)
    seq = data.draw(st.integers(1, 16))
    tokens = data.draw(st.lists(st.integers(0, cfg["vocab_size"] - 1), min_size=seq, max_size=seq))
    dead = data.draw(st.lists(st.booleans(), min_size=seq, max_size=seq))
    assert_matches_hand(cfg, data.draw(st.integers(0, 2**16)), tokens, dead)


# ------------------------------------------------------------------------------------------------ building blocks

def test_sinkhorn_is_nearly_doubly_stochastic():
    logits = np.random.default_rng(0).normal(scale=3.0, size=(4, 4))
    c = sinkhorn(logits, 1e-6, 20)
    assert np.abs(c.sum(axis=0) - 1).max() < 1e-5
    assert np.abs(c.sum(axis=1) - 1).max() < 1e-3
    assert np.abs(sinkhorn(logits, 1e-6, 1).sum(axis=1) - 1).max() > 1e-2  # one pass is not enough: iterations count


def test_a_sink_of_minus_infinity_is_a_plain_softmax_and_a_finite_sink_only_adds_to_the_denominator():
    rng = np.random.default_rng(1)
    q, keys = rng.normal(size=8), [rng.normal(size=8) for _ in range(5)]
    z = torch.tensor([float(q @ k) / math.sqrt(8) for k in keys], dtype=F64)
    values = torch.tensor(np.array(keys))
    want = torch.softmax(z, 0) @ values
    torch.testing.assert_close(torch.tensor(attend(q, keys, -math.inf)), want, rtol=1e-12, atol=1e-12)
    with_sink = torch.softmax(torch.cat([z, torch.tensor([0.7], dtype=F64)]), 0)[:-1] @ values
    torch.testing.assert_close(torch.tensor(attend(q, keys, 0.7)), with_sink, rtol=1e-12, atol=1e-12)


def test_ratio_two_pooling_of_two_identical_tokens_equals_ratio_one():
    rng = np.random.default_rng(2)
    x, wkv, wgate, norm = rng.normal(size=8), rng.normal(size=(6, 8)), rng.normal(size=(6, 8)), rng.normal(size=6)
    np.testing.assert_allclose(compressor_latent([x, x], wkv, wgate, norm, 1e-6),
                               compressor_latent([x], wkv, None, norm, 1e-6), rtol=1e-12)
    y = rng.normal(size=8)  # a zero gate averages the two tokens
    np.testing.assert_allclose(compressor_latent([x, y], wkv, np.zeros((6, 8)), norm, 1e-6),
                               compressor_latent([(x + y) / 2], wkv, None, norm, 1e-6), rtol=1e-12)


def test_the_tie_rule_picks_the_earlier_entry_and_skips_minus_infinity():
    assert top_k([1.0, 3.0, 3.0, 2.0, 3.0], 2) == [1, 2]
    assert top_k([-math.inf, 0.0, -math.inf, 0.0], 3) == [1, 3]
    assert top_k([0.5, math.inf, 0.5], 2) == [1, 0]


def test_router_ties_go_to_the_lower_expert_and_are_reported_as_near_ties():
    cfg = small_v41_config(n_routed_experts=6, num_experts_per_tok=3)
    w = random_v41_weights(cfg, seed=6)
    for layer in range(cfg["num_hidden_layers"]):
        gate = w[f"layers.{layer}.ffn.gate.weight"]
        gate[:] = gate[0]  # every expert scores the same
        w[f"layers.{layer}.ffn.gate.bias"].zero_()
    got = reference_forward(cfg, w, TOKENS, engram_hash_ids(cfg, TOKENS))
    assert all(c == [0, 1, 2] for layer in got.experts.values() for c in layer)
    assert {t.kind for t in got.near_ties} == {"router"} and got.tainted(0)


def test_random_weights_give_no_near_ties_and_robust_exact_zeros_are_not_ties():
    cfg, tokens = small_v41_config(), list(range(3, 40))  # candidate blocks tie at exactly 0 at 6 positions
    w, hashes = random_v41_weights(cfg, 0), engram_hash_ids(cfg, tokens)
    got = reference_forward(cfg, w, tokens, hashes)
    assert got.near_ties == [] and not got.tainted(len(tokens) - 1)
    loose = reference_forward(cfg, w, tokens, hashes, tie_tolerance=1.0)  # every bound is non-zero
    assert {t.kind for t in loose.near_ties} == {"router", "indexer", "candidate_blocks", "engram_sign"}
    assert fragile_pair([0.0, 0.0], [0.0, 0.0], [0]) is None  # exact zeros from clearly negative ReLUs
    assert fragile_pair([0.0, 0.0], [0.0, 1e-7], [0]) == (0, 1)  # a ReLU input within tolerance of 0
    assert fragile_pair([1.0, 0.5, -math.inf], [1.2, 0.7, -math.inf], [0]) is None


def test_tainted_covers_the_tie_position_and_every_later_one():
    ref = Reference(torch.zeros(6, 2, dtype=F64), torch.zeros(6, 2, dtype=F64),
                    [NearTie(3, 1, "router", 0, 1, 0.0, 1e-6)])
    assert [ref.tainted(p) for p in range(6)] == [False, False, False, True, True, True]
    assert ref.first_tainted() == 3


def test_the_engram_gate_takes_the_positive_root_at_minus_zero_and_is_zero_for_a_dead_token():
    assert engram_gate(-0.0, dead=False) == engram_gate(0.0, dead=False) == sigmoid(1e-3)
    assert engram_gate(-1e-300, dead=False) == sigmoid(-1e-3)
    assert engram_gate(0.25, dead=False) == sigmoid(0.5)
    assert engram_gate(0.25, dead=True) == 0.0


def test_dead_tokens_add_no_engram_value():
    cfg = small_v41_config()
    w = random_v41_weights(cfg, seed=7)
    dead = [True] * len(TOKENS)
    hashes = engram_hash_ids(cfg, TOKENS, dead)
    all_dead = reference_forward(cfg, w, TOKENS, hashes, dead).logits
    no_value = dict(w)
    for layer in cfg["engram_layer_ids"]:
        no_value[f"layers.{layer}.engram.wkv.weight"] = torch.zeros_like(w[f"layers.{layer}.engram.wkv.weight"])
    torch.testing.assert_close(all_dead, reference_forward(cfg, no_value, TOKENS, hashes).logits,
                               rtol=1e-12, atol=1e-12)
    alive = reference_forward(cfg, w, TOKENS, hashes).logits
    assert (alive - all_dead).abs().max() > 1e-3


def test_swiglu_clamps_the_gate_from_above_and_the_up_both_ways():
    g, u = np.array([3.0, -3.0, 0.5]), np.array([-2.0, 2.0, 0.5])
    np.testing.assert_allclose(swiglu(g, u, 1.0), [1.0 / (1 + math.exp(-1.0)) * -1.0,
                                                    -3.0 / (1 + math.exp(3.0)) * 1.0, 0.5 / (1 + math.exp(-0.5)) * 0.5])
    np.testing.assert_allclose(swiglu(g, u, 0.0), g / (1 + np.exp(-g)) * u)  # 0: no clamp


def test_yarn_frequencies_of_the_published_flash_rope():
    scaling = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
               "original_max_position_embeddings": 65536}
    plain = rope_frequencies(64, 160000.0, None)
    yarn = rope_frequencies(64, 160000.0, scaling)
    # c(32) = 64 ln(65536 / 64 pi) / (2 ln 160000) = 15.46 -> lo 15; c(1) = 24.71 -> hi 25
    assert yarn[:16] == plain[:16]
    np.testing.assert_allclose(yarn[25:], [f / 16 for f in plain[25:]], rtol=1e-15)
    np.testing.assert_allclose(yarn[20], plain[20] / 16 * 0.5 + plain[20] * 0.5, rtol=1e-15)
    assert rope_frequencies(64, 160000.0, {**scaling, "factor": 1}) == pytest.approx(plain, rel=1e-15)


def test_rope_turns_only_the_last_pairs_and_its_inverse_undoes_it():
    x = np.arange(1.0, 9.0)
    freqs = [1.0, 0.5]
    y = rope(x, 3, freqs)
    assert list(y[:4]) == [1.0, 2.0, 3.0, 4.0]
    assert y[4] == pytest.approx(5 * math.cos(3) - 6 * math.sin(3))
    assert y[5] == pytest.approx(5 * math.sin(3) + 6 * math.cos(3))
    np.testing.assert_allclose(rope(y, 3, freqs, inverse=True), x, rtol=1e-14)


# ------------------------------------------------------------------------------------------------ configs

PUBLISHED_FLASH = {
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
    "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "attention_bias": False, "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
}


def test_the_published_flash_config_is_valid_and_broken_ones_name_their_field():
    check_config(PUBLISHED_FLASH)
    check_config(flat_config({"text_config": PUBLISHED_FLASH, "model_type": "deepseek_v41"}))
    broken = {
        "index_source_layer_ids": dict(index_source_layer_ids=[8, 14, 20, 24]),  # kv source 2 is not one
        "kv_source_layer_ids": dict(kv_source_layer_ids=[2, 8, 14], index_source_layer_ids=[2, 8, 14]),  # 20: ratio 1
        "candidate_source_layer_id": dict(candidate_source_layer_id=24),  # an index source, not a kv source
        "compress_ratios": dict(compress_ratios=[0, 0, 4] + [2] * 17 + [1] * 20),
        "scoring_func": dict(scoring_func="softmax"),
    }
    for name, over in broken.items():
        with pytest.raises(ValueError, match=name):
            check_config({**PUBLISHED_FLASH, **over})


def test_the_tiny_tokenizer_config_hashes_with_its_map():
    cfg = with_tiny_tokenizer(small_v41_config())
    assert token_map_for(cfg).shape == (4096,) and int(token_map_for(cfg).max()) == 2725
    tokens = [100, 4095, 7, 2000, 100, 4095]
    ids = engram_hash_ids(cfg, tokens)
    assert set(ids) == {1, 3} and ids[1].shape == (6, 4)
    bigrams = slice(0, cfg["engram_n_heads"])  # column c = (n-2)*H + h
    assert torch.equal(ids[1][1, bigrams], ids[1][5, bigrams])  # (100, 4095) twice
    assert not torch.equal(ids[1][1], ids[1][5])  # (pad, 100, 4095) vs (2000, 100, 4095)
    got = reference_forward(cfg, random_v41_weights(cfg, 8), tokens, ids)
    assert got.logits.shape == (6, 4096)


@settings(max_examples=12, deadline=None)
@given(cfg=v41_configs(tiny_tokenizer=None), data=st.data())
def test_the_reference_runs_on_every_config_with_finite_logprobs_and_is_causal(cfg, data):
    check_config(cfg)
    seq = data.draw(st.integers(1, 20))
    tokens = data.draw(st.lists(st.integers(0, cfg["vocab_size"] - 1), min_size=seq, max_size=seq))
    dead = data.draw(st.lists(st.booleans(), min_size=seq, max_size=seq))
    w = random_v41_weights(cfg, data.draw(st.integers(0, 2**16)))
    got = reference_forward(cfg, w, tokens, engram_hash_ids(cfg, tokens, dead), dead)
    assert got.logprobs.shape == (seq, cfg["vocab_size"]) and torch.isfinite(got.logprobs).all()
    torch.testing.assert_close(got.logprobs.exp().sum(-1), torch.ones(seq, dtype=F64))
    cut = data.draw(st.integers(1, seq))  # a prefix sees neither later tokens nor incomplete entries
    prefix = reference_forward(cfg, w, tokens[:cut], engram_hash_ids(cfg, tokens[:cut], dead[:cut]), dead[:cut])
    torch.testing.assert_close(prefix.logits, got.logits[:cut], rtol=1e-12, atol=1e-12)
