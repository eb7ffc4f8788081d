"""An independent reference of the model's math: one request, token by token, written for obviousness.

It shares no code with the serving path: it reads the raw parameter tensors by name and recomputes
everything with plain Python loops over tokens, layers, heads and keys and small torch vector ops
(dot products, sums). Hash ids come from `reference_hash` (the contract's pseudo-code as a plain loop)
and table rows by plain indexing. Float order differs from the serving kernels, so results agree to
float rounding, not bit for bit.

docs/contract.md §7 (Engram gate), causal attention over a plain list of keys, index-sharing selection and the
MoE routing are each written out term by term below.
"""
from __future__ import annotations

import math

import torch

from engram_serve.engram.hashing import reference_hash


def _rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / math.sqrt(float((x * x).sum()) / x.numel() + eps)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _rotate(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotate-half rotary of one head vector x [hd] at absolute position pos."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / x.shape[0])
        c, s = math.cos(ang), math.sin(ang)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def _softmax_attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """softmax_j(q . k_j / sqrt(hd)) weighted sum of v_j over a plain list of keys."""
    scores = [float((q * k).sum()) / math.sqrt(q.shape[0]) for k in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    out = torch.zeros_like(q)
    for w, v in zip(weights, values):
        out = out + (w / total) * v
    return out


class ReferenceModel:
    def __init__(self, cfg, state: dict[str, torch.Tensor], tables: list[torch.Tensor], layout, token_map, pad_id):
        self.cfg = cfg
        self.p = {k: v.detach().double() for k, v in state.items()}  # float64: rounding is not the question
        self.tables = [t.double() for t in tables]
        self.layout, self.token_map, self.pad_id = layout, list(token_map.tolist()), pad_id

    def logits(self, tokens: list[int], dead: list[bool] | None = None) -> torch.Tensor:
        """[S, vocab] logits of every position of one request whose tokens are `tokens`."""
        cfg, e, p = self.cfg, self.cfg.engram, self.p
        s = len(tokens)
        dead = dead or [False] * s
        hashes = reference_hash(tokens, dead, self.layout, self.token_map, self.pad_id)  # [S][L_e][C]
        heads, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        group = heads // kvh
        keys = [[[] for _ in range(kvh)] for _ in range(cfg.num_hidden_layers)]  # [layer][kv head] -> per position
        values = [[[] for _ in range(kvh)] for _ in range(cfg.num_hidden_layers)]
        chosen: dict[tuple[int, int], list[int]] = {}  # (selecting layer, position) -> key positions
        out = []
        for pos in range(s):
            h = [p["embed_tokens.weight"][tokens[pos]].clone() for _ in range(cfg.hc_mult)]
            for layer in range(cfg.num_hidden_layers):
                pre = f"layers.{layer}."
                if layer in e.engram_layer_ids:  # ---- Engram gate, docs/contract.md §7
                    li = e.engram_layer_ids.index(layer)
                    rows = [self.tables[li][hashes[pos][li][c]] for c in range(e.num_columns)]
                    kv = p[pre + "engram.wkv.weight"] @ torch.cat(rows)
                    value = kv[cfg.hc_mult * cfg.hidden_size:]
                    for i in range(cfg.hc_mult):
                        key_i = kv[i * cfg.hidden_size:(i + 1) * cfg.hidden_size]
                        hn, kn = _rmsnorm(h[i], cfg.rms_norm_eps).tolist(), _rmsnorm(key_i, cfg.rms_norm_eps).tolist()
                        qw, kw = p[pre + "engram.q_w"][i].tolist(), p[pre + "engram.k_w"][i].tolist()
                        dot = 0.0
                        for j in range(cfg.hidden_size):
                            dot += hn[j] * qw[j] * kn[j] * kw[j]
                        dot /= math.sqrt(cfg.hidden_size)
                        sign = (dot > 0) - (dot < 0)
                        gate = 1.0 / (1.0 + math.exp(-sign * math.sqrt(max(abs(dot), 1e-6))))
                        if dead[pos]:
                            gate = 0.0
                        h[i] = h[i] + gate * value
                # ---- attention
                x = _rmsnorm(sum(h) / cfg.hc_mult, cfg.rms_norm_eps) * p[pre + "attn_norm.weight"]
                q = (p[pre + "attn.q_proj.weight"] @ x).view(heads, hd)
                k = (p[pre + "attn.k_proj.weight"] @ x).view(kvh, hd)
                v = (p[pre + "attn.v_proj.weight"] @ x).view(kvh, hd)
                q = [_rotate(q[i], pos, cfg.rope_theta) for i in range(heads)]
                for j in range(kvh):
                    keys[layer][j].append(_rotate(k[j], pos, cfg.rope_theta))
                    values[layer][j].append(v[j])
                visible = list(range(pos + 1))
                if layer in cfg.index_layer_ids:  # select: head-mean of q.k, best first, ties by lower position
                    score = {j: sum(float((q[i] * keys[layer][i // group][j]).sum()) for i in range(heads)) / heads
                             for j in visible}
                    visible = sorted(visible, key=lambda j: (-score[j], j))[:cfg.index_topk]
                    chosen[(layer, pos)] = visible
                elif layer - 1 in cfg.index_layer_ids:  # reuse the previous layer's choice
                    visible = chosen[(layer - 1, pos)]
                att = [_softmax_attend(q[i], [keys[layer][i // group][j] for j in visible],
                                       [values[layer][i // group][j] for j in visible]) for i in range(heads)]
                a = p[pre + "attn.o_proj.weight"] @ torch.cat(att)
                h = [hi + a for hi in h]
                # ---- MLP or MoE
                x = _rmsnorm(sum(h) / cfg.hc_mult, cfg.rms_norm_eps) * p[pre + "mlp_norm.weight"]
                if layer in cfg.moe_layer_ids:
                    logits = p[pre + "mlp.router.weight"] @ x
                    probs = torch.exp(logits - logits.max())
                    probs = probs / probs.sum()
                    ranked = sorted(range(cfg.n_routed_experts), key=lambda j: -float(probs[j]))
                    top = ranked[:cfg.num_experts_per_tok]
                    norm = sum(float(probs[j]) for j in top)
                    m = torch.zeros_like(x)
                    for j in top:
                        inner = _silu(p[pre + "mlp.w_gate"][j] @ x) * (p[pre + "mlp.w_up"][j] @ x)
                        m = m + (float(probs[j]) / norm) * (p[pre + "mlp.w_down"][j] @ inner)
                else:
                    m = p[pre + "mlp.down_proj.weight"] @ (_silu(p[pre + "mlp.gate_proj.weight"] @ x)
                                                           * (p[pre + "mlp.up_proj.weight"] @ x))
                h = [hi + m for hi in h]
            x = _rmsnorm(sum(h) / cfg.hc_mult, cfg.rms_norm_eps) * p["norm.weight"]
            head = p["embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
            out.append(head @ x)
        return torch.stack(out)
