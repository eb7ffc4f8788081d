"""A float64 reference of the DeepSeek-V4.1 text forward, written for obviousness from docs/deepseek_v41.md.

It shares no code with `engram_serve`: it reads the weights by their official names and recomputes one
request from position 0 with plain loops over layers, tokens, heads, keys and experts. Vectors are numpy
float64 arrays; a matrix-vector product is `W @ x`; everything else is a loop or a one-line helper.

Layer-major order: a layer is computed for every position before the next layer starts. That is the
same function as token-major order, because a token reads only earlier or equal positions of a layer.

**Near ties.** The model runs in float32. Every top-k decision (the router, an indexer, the candidate
blocks) and every sign of an Engram dot (the gate jumps at 0) whose outcome float32 rounding could change
is recorded as a `NearTie`. Each score gets an error bound: `tie_tolerance` (default 1e-5, about 170
float32 epsilons, room for the rounding that earlier layers pass on) times the sum of the magnitudes of
the terms the score is made of. A decision is fragile when some chosen item's score minus its bound does
not exceed some unchosen item's score plus its bound. Exact ties broken by the written rule are robust
only when both bounds are zero: an indexer score that is exactly 0 because every ReLU input is clearly
negative (below -tolerance x its terms), or the +inf of the newest candidate block. A ReLU input within
tolerance of 0 could come out positive in float32, so it counts with a non-zero bound. A near tie at
position p taints p and every later position (`Reference.tainted`): p's state reaches later tokens
through the window and the compressed entries.

**One reading the definition leaves implicit.** An index source after the candidate source keeps entry
g when block g // candidate_block_size is a candidate, whichever kv source it reads (the same rule as
for the candidate source's own entries; the published layout has no kv source after the candidate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

NEAR_TIE_TOLERANCE = 1e-5  # relative to the magnitude of the terms of a score; float32 eps is 6e-8
ENGRAM_MIN_ABS_DOT = 1e-6
INF = math.inf

REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "swiglu_limit", "rms_norm_eps", "rope_theta", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "routed_scaling_factor", "sliding_window", "compress_ratios", "compress_rope_theta", "kv_source_layer_ids",
    "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
)
FIXED_FIELDS = {  # the values the definition covers; anything else changes the math
    "hidden_act": "silu", "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "num_key_value_heads": 1, "attention_bias": False, "n_shared_experts": 1,
}


# ------------------------------------------------------------------------------------------------ results

@dataclass(frozen=True)
class NearTie:
    """A decision at `position` of `layer` that float32 rounding could flip.

    kind: "router", "indexer", "candidate_blocks" or "engram_sign". For a top-k, `chosen` and `rival` are the
    item picked and the item left out whose score intervals touch (gap = score difference, tolerance = the
    two bounds together); for "engram_sign", `chosen` is the stream, `rival` -1, gap the dot."""

    position: int
    layer: int
    kind: str
    chosen: int
    rival: int
    gap: float
    tolerance: float


@dataclass
class Reference:
    """One request's float64 results. Invariant: logprobs[p] = log_softmax(logits[p]); every near tie's
    position is < len(logits). Selections are kept for debugging: experts[l][p] (best first),
    index_topk[l][p] (best first, index sources only), candidates[p] (blocks, best first)."""

    logits: torch.Tensor  # [S, V] float64
    logprobs: torch.Tensor  # [S, V] float64
    near_ties: list[NearTie] = field(default_factory=list)
    experts: dict[int, list[list[int]]] = field(default_factory=dict)
    index_topk: dict[int, list[list[int]]] = field(default_factory=dict)
    candidates: list[list[int]] | None = None
    features: torch.Tensor | None = None  # [S, nL*D] float64: the captured layers' stream means (`capture`)

    def tainted(self, position: int) -> bool:
        """True when a near tie at `position` or before could make float32 differ from this reference."""
        return any(t.position <= position for t in self.near_ties)

    def first_tainted(self) -> int | None:
        return min((t.position for t in self.near_ties), default=None)


# ------------------------------------------------------------------------------------------------ scalars

def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def softplus(z: float) -> float:
    return max(z, 0.0) + math.log1p(math.exp(-abs(z)))


def silu(z: float) -> float:
    return z * sigmoid(z)


# ------------------------------------------------------------------------------------------------ building blocks

def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x * (mean(x^2) + eps)^(-1/2) * weight (no weight: plain)."""
    y = x / math.sqrt(float(np.mean(x * x)) + eps)
    return y if weight is None else y * weight


def rope_frequencies(rd: int, theta: float, yarn: dict | None) -> list[float]:
    """f_j = theta^(-2j/rd) for the rd/2 pairs, with YaRN's ramp when `yarn` is given (attention factor 1)."""
    freqs = [theta ** (-2.0 * j / rd) for j in range(rd // 2)]
    if yarn is None:
        return freqs
    factor, base_len = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])

    def correction(b: float) -> float:
        return rd * math.log(base_len / (2 * math.pi * b)) / (2 * math.log(theta))

    lo = max(math.floor(correction(float(yarn["beta_fast"]))), 0)
    hi = min(math.ceil(correction(float(yarn["beta_slow"]))), rd - 1)
    out = []
    for j, f in enumerate(freqs):
        ramp = min(max((j - lo) / max(hi - lo, 0.001), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1.0 - ramp))
    return out


def rope(x: np.ndarray, position: int, freqs: list[float], inverse: bool = False) -> np.ndarray:
    """Rotate the interleaved pairs of the last 2*len(freqs) dims of x by position * f_j (inverse: by -)."""
    out = x.copy()
    d0 = len(x) - 2 * len(freqs)
    for j, f in enumerate(freqs):
        a = -position * f if inverse else position * f
        x0, x1 = x[d0 + 2 * j], x[d0 + 2 * j + 1]
        out[d0 + 2 * j] = x0 * math.cos(a) - x1 * math.sin(a)
        out[d0 + 2 * j + 1] = x0 * math.sin(a) + x1 * math.cos(a)
    return out


def swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(g, L)) * clamp(u, -L, L); no clamp when L <= 0."""
    out = np.zeros(len(g))
    for i in range(len(g)):
        gi, ui = g[i], u[i]
        if limit > 0:
            gi, ui = min(gi, limit), min(max(ui, -limit), limit)
        out[i] = silu(gi) * ui
    return out


def top_k(scores: list[float], k: int) -> list[int]:
    """Indices of the k best scores that are not -inf, best first; equal scores: the lower index first."""
    qualifying = [i for i, s in enumerate(scores) if s != -INF]
    return sorted(qualifying, key=lambda i: (-scores[i], i))[:k]


def fragile_pair(lo: list[float], hi: list[float], chosen: list[int]) -> tuple[int, int] | None:
    """(chosen item, rival) whose score intervals [lo, hi] (what float32 may compute) touch, or None when
    the chosen set is robust. Items scored -inf cannot be chosen.

    Two exact scores (lo == hi) that are equal are a tie float32 sees too: the written rule decides it the
    same way, so it is robust."""
    picked = set(chosen)
    for i in chosen:
        for j in range(len(lo)):
            if j in picked or hi[j] == -INF:
                continue
            if lo[i] == hi[i] == lo[j] == hi[j]:
                continue
            if lo[i] <= hi[j]:
                return i, j
    return None


def attend(q: np.ndarray, keys: list[np.ndarray], sink: float) -> np.ndarray:
    """sum_j exp(z_j) key_j / (sum_j exp(z_j) + exp(sink)), z_j = q . key_j / sqrt(hd); key = value."""
    logits = [float(q @ key) / math.sqrt(len(q)) for key in keys]
    top = max(logits + [sink])
    weights = [math.exp(z - top) for z in logits]
    denominator = sum(weights) + math.exp(sink - top)  # exp(-inf) = 0: no sink
    out = np.zeros(len(q))
    for w, key in zip(weights, keys):
        out = out + w * key
    return out / denominator


def sinkhorn(logits: np.ndarray, hc_eps: float, iters: int) -> np.ndarray:
    """C [hc, hc]: softmax over b of each row a, + eps, columns normalised, then (rows, columns) iters-1 times."""
    hc = logits.shape[0]
    c = np.zeros((hc, hc))
    for a in range(hc):
        top = max(logits[a])
        e = [math.exp(logits[a, b] - top) for b in range(hc)]
        for b in range(hc):
            c[a, b] = e[b] / sum(e) + hc_eps
    c = _normalise_columns(c, hc_eps)
    for _ in range(iters - 1):
        c = _normalise_rows(c, hc_eps)
        c = _normalise_columns(c, hc_eps)
    return c


def _normalise_rows(c: np.ndarray, eps: float) -> np.ndarray:
    out = c.copy()
    for a in range(c.shape[0]):
        total = sum(c[a, b] for b in range(c.shape[1]))
        for b in range(c.shape[1]):
            out[a, b] = c[a, b] / (total + eps)
    return out


def _normalise_columns(c: np.ndarray, eps: float) -> np.ndarray:
    return _normalise_rows(c.T, eps).T


def mhc(streams: list[np.ndarray], fn: np.ndarray, base: np.ndarray, scale: np.ndarray, norm_eps: float,
        hc_eps: float, iters: int) -> tuple[list[float], list[float], np.ndarray]:
    """(pre [hc], post [hc], C [hc, hc]) of one sublayer from the streams it receives."""
    hc = len(streams)
    v = np.concatenate(streams)  # [hc*D]
    m = fn @ v / math.sqrt(float(np.mean(v * v)) + norm_eps)  # [(2+hc)*hc]
    m = np.array([m[i] * scale[0 if i < hc else 1 if i < 2 * hc else 2] + base[i] for i in range(len(m))])
    pre = [sigmoid(m[i]) + hc_eps for i in range(hc)]
    post = [2.0 * sigmoid(m[hc + i]) for i in range(hc)]
    c = sinkhorn(m[2 * hc:].reshape(hc, hc), hc_eps, iters)
    return pre, post, c


def collapse(streams: list[np.ndarray], pre: list[float]) -> np.ndarray:
    """sum_i pre[i] X[i]."""
    out = np.zeros(len(streams[0]))
    for w, s in zip(pre, streams):
        out = out + w * s
    return out


def mix(streams: list[np.ndarray], post: list[float], c: np.ndarray, o: np.ndarray) -> list[np.ndarray]:
    """X'[b] = post[b] o + sum_a C[a, b] X[a]."""
    hc = len(streams)
    out = []
    for b in range(hc):
        x = post[b] * o
        for a in range(hc):
            x = x + c[a, b] * streams[a]
        out.append(x)
    return out


def compressor_latent(xs: list[np.ndarray], wkv: np.ndarray, wgate: np.ndarray | None, norm: np.ndarray,
                      eps: float) -> np.ndarray:
    """latent of one compressed entry from the attention inputs of its r positions (r = 1 or 2)."""
    if len(xs) == 1:
        return rmsnorm(wkv @ xs[0], norm, eps)
    a = [wkv @ x for x in xs]  # [r][hd]
    s = [wgate @ x for x in xs]
    pooled = np.zeros(wkv.shape[0])
    for ch in range(wkv.shape[0]):  # softmax over the r tokens, per channel
        top = max(s_t[ch] for s_t in s)
        w = [math.exp(s_t[ch] - top) for s_t in s]
        pooled[ch] = sum(w_t * a_t[ch] for w_t, a_t in zip(w, a)) / sum(w)
    return rmsnorm(pooled, norm, eps)


def engram_gate(dot: float, dead: bool) -> float:
    """sigmoid(sign * sqrt(max(|dot|, 1e-6))), the positive root at dot = +-0; 0 for a dead token."""
    if dead:
        return 0.0
    sign = 1.0 if dot >= 0 else -1.0  # -0.0 >= 0 is True
    return sigmoid(sign * math.sqrt(max(abs(dot), ENGRAM_MIN_ABS_DOT)))


# ------------------------------------------------------------------------------------------------ config

def flat_config(config: dict) -> dict:
    """The text fields, whether nested under text_config or flat."""
    out = {k: v for k, v in config.items() if k != "text_config"}
    out.update(config.get("text_config", {}))
    return out


def check_config(cfg: dict) -> None:
    """ValueError naming the field when the config is outside what docs/deepseek_v41.md defines."""
    for name in REQUIRED_FIELDS:
        if name not in cfg:
            raise ValueError(f"config field {name} is missing")
    for name, want in FIXED_FIELDS.items():
        if name in cfg and cfg[name] != want:
            raise ValueError(f"config field {name}={cfg[name]!r}: the reference defines only {want!r}")
    layers = cfg["num_hidden_layers"]
    ratios = list(cfg["compress_ratios"])[:layers]
    if len(ratios) != layers or any(r not in (0, 1, 2) for r in ratios):
        raise ValueError(f"config field compress_ratios={cfg['compress_ratios']!r}: "
                         f"needs {layers} entries in {{0,1,2}}")
    kv, index = set(cfg["kv_source_layer_ids"]), set(cfg["index_source_layer_ids"])
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        if any(not 0 <= i < layers or ratios[i] == 0 for i in ids):
            raise ValueError(f"config field {name}={sorted(ids)}: every source must be a layer with ratio > 0")
    if not kv <= index:
        raise ValueError(f"config field index_source_layer_ids={sorted(index)}: "
                         f"must include every kv source {sorted(kv)}")
    for layer, r in enumerate(ratios):
        if r > 0:
            source = max((i for i in kv if i <= layer), default=None)
            if source is None or ratios[source] != r:
                raise ValueError(f"config field kv_source_layer_ids={sorted(kv)}: layer {layer} (ratio {r}) has "
                                 f"kv source {source} of another ratio")
    c = cfg["candidate_source_layer_id"]
    if c != -1 and c not in kv:
        raise ValueError(f"config field candidate_source_layer_id={c}: must be -1 or a kv source {sorted(kv)}")
    heads, hd, rd = cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]
    if heads % cfg["o_groups"]:
        raise ValueError(f"config field o_groups={cfg['o_groups']}: must divide num_attention_heads={heads}")
    if rd % 2 or rd > hd or rd > cfg["index_head_dim"]:
        raise ValueError(f"config field qk_rope_head_dim={rd}: must be even and <= head_dim and index_head_dim")
    if not 1 <= cfg["num_experts_per_tok"] <= cfg["n_routed_experts"]:
        raise ValueError(f"config field num_experts_per_tok={cfg['num_experts_per_tok']}: must be in "
                         f"1..n_routed_experts={cfg['n_routed_experts']}")
    if cfg["hc_sinkhorn_iters"] < 1:
        raise ValueError(f"config field hc_sinkhorn_iters={cfg['hc_sinkhorn_iters']}: must be >= 1")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise ValueError(f"config field rope_scaling={scaling!r}: only yarn is defined")
    if any(not 0 <= i < layers for i in cfg.get("engram_layer_ids", [])):
        raise ValueError(f"config field engram_layer_ids={cfg['engram_layer_ids']}: layers are 0..{layers - 1}")


def kv_source(cfg: dict, layer: int) -> int:
    """The largest kv source <= layer (a compressed layer reads its entries)."""
    return max(i for i in cfg["kv_source_layer_ids"] if i <= layer)


def index_source(cfg: dict, layer: int) -> int:
    """The largest index source <= layer (a compressed layer reuses its top-k)."""
    return max(i for i in cfg["index_source_layer_ids"] if i <= layer)


# ------------------------------------------------------------------------------------------------ the forward

class _Forward:
    """One request's forward: weights as float64 numpy, the config, and what layers hand each other."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], token_ids: list[int],
                 engram_hash_ids: dict[int, torch.Tensor] | None, dead: list[bool] | None, tie_tolerance: float):
        self.cfg = cfg
        self.weights = weights
        self.w: dict[str, np.ndarray] = {}  # float64 copies, made when first read
        self.tol = float(tie_tolerance)
        self.tokens = list(token_ids)
        self.dead = list(dead) if dead is not None else [False] * len(token_ids)
        if len(self.dead) != len(self.tokens):
            raise ValueError(f"dead has {len(self.dead)} flags for {len(self.tokens)} tokens")
        self.hash_ids = {int(k): v.tolist() for k, v in (engram_hash_ids or {}).items()}
        self.eps = float(cfg["rms_norm_eps"])
        self.ratios = list(cfg["compress_ratios"])[:cfg["num_hidden_layers"]]
        scaling = cfg.get("rope_scaling")
        rd = cfg["qk_rope_head_dim"]
        self.window_freqs = rope_frequencies(rd, float(cfg["rope_theta"]), None)
        self.compressed_freqs = rope_frequencies(rd, float(cfg["compress_rope_theta"]), scaling)
        self.entries: dict[int, list[tuple[np.ndarray, np.ndarray | None]]] = {}  # kv source -> [(ckv_g, ik_g)]
        self.near_ties: list[NearTie] = []
        self.experts: dict[int, list[list[int]]] = {}
        self.index_topk: dict[int, list[list[int]]] = {}
        self.candidates: list[list[int]] | None = None
        self.capture: tuple[int, ...] = ()
        self.features: dict[int, list[np.ndarray]] = {}

    def p(self, name: str) -> np.ndarray:
        """The float64 weight `name`, read from `weights` when first used (a routed expert's each time it is used,
        not kept: `weights` may be a mapping that reads a checkpoint larger than memory)."""
        if name in self.w:
            return self.w[name]
        if name not in self.weights:
            raise KeyError(f"weight {name} is missing")
        w = self.weights[name].detach().to(torch.float64).numpy()
        if ".experts." not in name:
            self.w[name] = w
        return w

    def freqs(self, layer: int) -> list[float]:
        return self.compressed_freqs if self.ratios[layer] > 0 else self.window_freqs

    # ---------------------------------------------------------------- the whole model

    def run(self) -> Reference:
        cfg, hc, seq = self.cfg, self.cfg["hc_mult"], len(self.tokens)
        streams = [[self.p("embed.weight")[t].copy() for _ in range(hc)] for t in self.tokens]  # [S][hc][D]
        pre_prev = [[1.0] + [0.0] * (hc - 1) for _ in range(seq)]  # layer 0 attention: stream 0 alone
        for layer in range(cfg["num_hidden_layers"]):
            pre_prev = self.layer(layer, streams, pre_prev)
        logits = []
        for pos in range(seq):
            hidden = rmsnorm(collapse(streams[pos], pre_prev[pos]), self.p("norm.weight"), self.eps)
            logits.append(self.p("head.weight") @ hidden)
        logits_t = torch.tensor(np.array(logits), dtype=torch.float64)  # [S, V]
        features = None
        if self.capture:
            features = torch.tensor(np.array([np.concatenate([self.features[layer][pos] for layer in self.capture])
                                              for pos in range(seq)]), dtype=torch.float64)
        return Reference(logits_t, torch.log_softmax(logits_t, dim=-1), self.near_ties, self.experts,
                         self.index_topk, self.candidates, features)

    def layer(self, layer: int, streams: list[list[np.ndarray]], pre_prev: list[list[float]]) -> list[list[float]]:
        """Update every position's streams in place through layer `layer`; return each position's FFN pre."""
        pre = f"layers.{layer}."
        seq = len(streams)
        if layer in self.cfg.get("engram_layer_ids", []):
            for pos in range(seq):
                streams[pos] = self.engram(layer, pos, streams[pos])
        if layer in self.capture:  # the DSpark features: the streams entering the layer, after its Engram gate
            self.features[layer] = [sum(streams[pos]) / len(streams[pos]) for pos in range(seq)]
        attn_mix = [self.mhc(layer, "attn", streams[pos]) for pos in range(seq)]
        xs = [rmsnorm(collapse(streams[pos], pre_prev[pos]), self.p(pre + "attn_norm.weight"), self.eps)
              for pos in range(seq)]
        outs = self.attention(layer, xs)
        for pos in range(seq):
            _, post_a, c_a = attn_mix[pos]
            streams[pos] = mix(streams[pos], post_a, c_a, outs[pos])
        pre_f_all = []
        self.experts[layer] = []
        for pos in range(seq):
            pre_f, post_f, c_f = self.mhc(layer, "ffn", streams[pos])
            x = rmsnorm(collapse(streams[pos], attn_mix[pos][0]), self.p(pre + "ffn_norm.weight"), self.eps)
            streams[pos] = mix(streams[pos], post_f, c_f, self.moe(layer, pos, x))
            pre_f_all.append(pre_f)
        return pre_f_all

    def mhc(self, layer: int, sub: str, streams: list[np.ndarray], prefix: str | None = None):
        pre = (prefix or f"layers.{layer}.") + f"hc_{sub}_"
        return mhc(streams, self.p(pre + "fn"), self.p(pre + "base"), self.p(pre + "scale"), self.eps,
                   float(self.cfg["hc_eps"]), int(self.cfg["hc_sinkhorn_iters"]))

    # ---------------------------------------------------------------- Engram

    def engram(self, layer: int, pos: int, streams: list[np.ndarray]) -> list[np.ndarray]:
        cfg, pre = self.cfg, f"layers.{layer}.engram."
        if layer not in self.hash_ids:
            raise KeyError(f"engram_hash_ids has no entry for Engram layer {layer}")
        columns = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
        rows = self.hash_ids[layer][pos]
        if len(rows) != columns:
            raise ValueError(f"engram_hash_ids[{layer}] has {len(rows)} columns; (N-1)*H_e = {columns}")
        table = self.weights[pre + "embed.weight"]  # (its rows alone read: a table may be larger than memory)
        e = np.concatenate([table[row].detach().to(torch.float64).numpy() for row in rows])  # [C*ehd]
        kv = self.p(pre + "wkv.weight") @ e  # [(hc+1)*D]
        d = cfg["hidden_size"]
        value = kv[len(streams) * d:]
        out = []
        for i, x in enumerate(streams):
            key = kv[i * d:(i + 1) * d]
            terms = (rmsnorm(x, None, self.eps) * self.p(pre + "q_weight")[i]
                     * rmsnorm(key, None, self.eps) * self.p(pre + "k_weight")[i]) / math.sqrt(d)
            dot = float(np.sum(terms))
            magnitude = float(np.sum(np.abs(terms)))
            if not self.dead[pos] and abs(dot) <= self.tol * magnitude:
                self.near_ties.append(NearTie(pos, layer, "engram_sign", i, -1, dot, self.tol * magnitude))
            out.append(x + engram_gate(dot, self.dead[pos]) * value)
        return out

    # ---------------------------------------------------------------- attention

    def attention(self, layer: int, xs: list[np.ndarray]) -> list[np.ndarray]:
        """The attention output [D] of every position, from the attention inputs xs [S][D]."""
        cfg, pre = self.cfg, f"layers.{layer}.attn."
        heads, hd, window = cfg["num_attention_heads"], cfg["head_dim"], cfg["sliding_window"]
        freqs = self.freqs(layer)
        qrs = [rmsnorm(self.p(pre + "wq_a.weight") @ x, self.p(pre + "q_norm.weight"), self.eps) for x in xs]
        kvs = [rope(rmsnorm(self.p(pre + "wkv.weight") @ x, self.p(pre + "kv_norm.weight"), self.eps), pos, freqs)
               for pos, x in enumerate(xs)]
        if layer in cfg["kv_source_layer_ids"]:
            self.entries[layer] = self.compress(layer, xs)
        if layer in cfg["index_source_layer_ids"]:
            self.index_topk[layer] = [self.indexer(layer, pos, qrs[pos], xs[pos]) for pos in range(len(xs))]
        outs = []
        for pos in range(len(xs)):
            q = self.p(pre + "wq_b.weight") @ qrs[pos]  # [H*hd]
            keys = [kvs[j] for j in range(max(0, pos - window + 1), pos + 1)]
            if self.ratios[layer] > 0:
                entries = self.entries[kv_source(cfg, layer)]
                keys += [entries[g][0] for g in self.index_topk[index_source(cfg, layer)][pos]]
            o_heads = []
            for h in range(heads):
                q_h = rope(q[h * hd:(h + 1) * hd], pos, freqs)
                o_h = attend(q_h, keys, float(self.p(pre + "attn_sink")[h]))
                o_heads.append(rope(o_h, pos, freqs, inverse=True))
            outs.append(self.output_projection(layer, o_heads))
        return outs

    def output_projection(self, layer: int, o_heads: list[np.ndarray], pre: str | None = None) -> np.ndarray:
        """wo_b . concat(u_g), u_g = wo_a[g*ol:(g+1)*ol] . concat(o_h of group g) (block-diagonal wo_a)."""
        cfg, pre = self.cfg, pre or f"layers.{layer}.attn."
        groups, ol = cfg["o_groups"], cfg["o_lora_rank"]
        per_group = len(o_heads) // groups
        wo_a = self.p(pre + "wo_a.weight")  # [og*ol, H*hd/og]
        us = []
        for g in range(groups):
            us.append(wo_a[g * ol:(g + 1) * ol] @ np.concatenate(o_heads[g * per_group:(g + 1) * per_group]))
        return self.p(pre + "wo_b.weight") @ np.concatenate(us)

    def compress(self, layer: int, xs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(ckv_g, ik_g)] for every complete entry g of this kv source (g*r + r - 1 < S)."""
        pre, r = f"layers.{layer}.attn.", self.ratios[layer]
        wgate = self.p(pre + "compressor.wgate.weight") if r == 2 else None
        out = []
        for g in range(len(xs) // r):
            latent = compressor_latent(xs[g * r:(g + 1) * r], self.p(pre + "compressor.wkv.weight"), wgate,
                                       self.p(pre + "compressor.norm.weight"), self.eps)
            ckv = rope(latent, g * r, self.compressed_freqs)
            ik = rope(rmsnorm(self.p(pre + "indexer.wk.weight") @ latent, self.p(pre + "indexer.k_norm.weight"),
                              self.eps), g * r, self.compressed_freqs)
            out.append((ckv, ik))
        return out

    # ---------------------------------------------------------------- indexer

    def indexer(self, layer: int, pos: int, qr: np.ndarray, x: np.ndarray) -> list[int]:
        """topk_l(pos) of an index source: the best index_topk visible entries with a finite score."""
        cfg = self.cfg
        visible = (pos + 1) // self.ratios[layer]
        scores, errors = self.index_scores(layer, pos, qr, x, visible)
        c = cfg["candidate_source_layer_id"]
        if layer == c:
            self.record_candidates(layer, pos, scores, errors)
        elif c != -1 and layer > c:
            allowed = set(self.candidates[pos])
            block = cfg["candidate_block_size"]
            scores = [s if g // block in allowed else -INF for g, s in enumerate(scores)]
        chosen = top_k(scores, cfg["index_topk"])
        self.check_tie_symmetric(pos, layer, "indexer", scores, errors, chosen)
        return chosen

    def index_scores(self, layer: int, pos: int, qr: np.ndarray, x: np.ndarray,
                     visible: int) -> tuple[list[float], list[float]]:
        """s(g) = sum_h w_h ReLU(qi_h . ik_g) for g < visible, with each score's float32 error bound."""
        cfg, pre = self.cfg, f"layers.{layer}.attn.indexer."
        nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        entries = self.entries[kv_source(cfg, layer)]
        q_all = self.p(pre + "wq_b.weight") @ qr  # [nh*ihd]
        proj = self.p(pre + "weights_proj.weight")  # [nh, D]
        scale = 1.0 / math.sqrt(ihd) / math.sqrt(nh)
        qi = [rope(q_all[h * ihd:(h + 1) * ihd], pos, self.freqs(layer)) for h in range(nh)]
        w = [float(proj[h] @ x) * scale for h in range(nh)]
        w_magnitude = [float(np.sum(np.abs(proj[h] * x))) * scale for h in range(nh)]
        scores, errors = [], []
        for g in range(visible):
            ik = entries[g][1]
            score, error = 0.0, 0.0
            for h in range(nh):
                terms = qi[h] * ik
                dot, magnitude = float(np.sum(terms)), float(np.sum(np.abs(terms)))
                score += w[h] * max(dot, 0.0)
                if dot >= -self.tol * magnitude:  # float32 may see a positive ReLU input here
                    error += self.tol * (abs(w[h]) * magnitude + w_magnitude[h] * max(dot, 0.0))
            scores.append(score)
            errors.append(error)
        return scores, errors

    def record_candidates(self, layer: int, pos: int, scores: list[float], errors: list[float]) -> None:
        """Candidate blocks at pos: block score = max of its visible entries, the newest block +inf."""
        cfg = self.cfg
        if self.candidates is None:
            self.candidates = []
        block = cfg["candidate_block_size"]
        n = len(scores)
        num_blocks = (n + block - 1) // block
        block_scores, block_lo, block_hi = [], [], []
        for b in range(num_blocks):
            members = range(b * block, min((b + 1) * block, n))
            block_scores.append(max(scores[g] for g in members))
            block_lo.append(max(scores[g] - errors[g] for g in members))  # the max of what float32 may see
            block_hi.append(max(scores[g] + errors[g] for g in members))
        if num_blocks:
            newest = (n - 1) // block
            block_scores[newest] = block_lo[newest] = block_hi[newest] = INF
        chosen = top_k(block_scores, cfg["candidate_topk_blocks"])
        self.check_tie(pos, layer, "candidate_blocks", block_scores, block_lo, block_hi, chosen)
        self.candidates.append(chosen)

    def check_tie(self, pos: int, layer: int, kind: str, scores: list[float], lo: list[float], hi: list[float],
                  chosen: list[int]) -> None:
        pair = fragile_pair(lo, hi, chosen)
        if pair is not None:
            i, j = pair
            tolerance = (scores[i] - lo[i]) + (hi[j] - scores[j])
            self.near_ties.append(NearTie(pos, layer, kind, i, j, scores[i] - scores[j], tolerance))

    def check_tie_symmetric(self, pos: int, layer: int, kind: str, scores: list[float], errors: list[float],
                            chosen: list[int]) -> None:
        """check_tie with intervals [score - error, score + error]."""
        lo = [s - e for s, e in zip(scores, errors)]
        hi = [s + e for s, e in zip(scores, errors)]
        self.check_tie(pos, layer, kind, scores, lo, hi, chosen)

    # ---------------------------------------------------------------- MoE

    def moe(self, layer: int, pos: int, x: np.ndarray, pre: str | None = None, experts: int | None = None,
            k: int | None = None) -> np.ndarray:
        cfg, pre = self.cfg, pre or f"layers.{layer}.ffn."
        gate, bias = self.p(pre + "gate.weight"), self.p(pre + "gate.bias")
        scores, selection, errors = [], [], []
        for e in range(experts or cfg["n_routed_experts"]):
            z = float(gate[e] @ x)
            score = math.sqrt(softplus(z))
            scores.append(score)
            selection.append(score + float(bias[e]))  # the bias only chooses
            errors.append(self.tol * (float(np.sum(np.abs(gate[e] * x))) + score + abs(float(bias[e]))))
        chosen = top_k(selection, k or cfg["num_experts_per_tok"])
        self.check_tie_symmetric(pos, layer, "router", selection, errors, chosen)
        self.experts.setdefault(layer, []).append(chosen)
        total = sum(scores[e] for e in chosen) if len(chosen) > 1 else 1.0  # one expert: its raw score (the docs)
        out = self.expert(pre + "shared_experts.", x)
        for e in chosen:
            out = out + scores[e] / total * float(cfg["routed_scaling_factor"]) * self.expert(f"{pre}experts.{e}.", x)
        return out

    def expert(self, pre: str, x: np.ndarray) -> np.ndarray:
        hidden = swiglu(self.p(pre + "w1.weight") @ x, self.p(pre + "w3.weight") @ x, float(self.cfg["swiglu_limit"]))
        return self.p(pre + "w2.weight") @ hidden


def reference_forward(config: dict, weights: dict[str, torch.Tensor], token_ids: list[int],
                      engram_hash_ids: dict[int, torch.Tensor] | None = None,
                      dead: list[bool] | None = None, tie_tolerance: float = NEAR_TIE_TOLERANCE,
                      capture: tuple[int, ...] = ()) -> Reference:
    """The float64 forward of one request whose tokens sit at positions 0..S-1.

    config: the text config (flat, or nested under text_config); weights: float tensors under the official
    names (dequantized), a dict or any mapping (read when used: of the routed experts, only those chosen); engram_hash_ids[layer]: [S, (N-1)*H_e] int64 table rows (offsets included), needed
    for every Engram layer; dead[p]: token p is dead (its Engram gate is 0); tie_tolerance: the relative
    error bound of the near-tie report (0 reports only exact ties that float32 could break); capture: layers
    whose input streams' mean (after the Engram gate) goes to `Reference.features`, concatenated in this order."""
    cfg = flat_config(config)
    check_config(cfg)
    forward = _Forward(cfg, weights, token_ids, engram_hash_ids, dead, tie_tolerance)
    forward.capture = tuple(capture)
    return forward.run()


# ------------------------------------------------------------------------------------------------ the DSpark drafter

@dataclass
class DraftReference:
    """One draft's float64 results: logits[j] = z_j [V] (the Markov term included), tokens[j] the token taken as
    prev for j + 1 (the given `chosen`, else the argmax), gaps[j] the argmax's margin over the runner-up,
    confidence[j] the acceptance logit (None without the head); near ties of the draft routers as in `Reference`."""

    logits: torch.Tensor  # [k, V] float64
    tokens: list[int]
    gaps: list[float]
    confidence: list[float] | None
    near_ties: list[NearTie] = field(default_factory=list)


class _Draft(_Forward):
    """The drafter of docs/deepseek_v41.md over the target's features, position by position."""

    def run_draft(self, features: torch.Tensor, last: int, n: int, chosen: list[int] | None) -> DraftReference:
        cfg, eps = self.cfg, self.eps
        k, window, hc = cfg["dspark_block_size"], cfg["sliding_window"], cfg["hc_mult"]
        layers, last_layer = cfg["num_nextn_predict_layers"], f"mtp.{cfg['num_nextn_predict_layers'] - 1}."
        context = {}  # position -> c[p]
        for p in range(max(0, n - window), n):
            f = features[p].detach().to(torch.float64).numpy()
            context[p] = rmsnorm(self.p("mtp.0.main_proj.weight") @ f, self.p("mtp.0.main_norm.weight"), eps)
        ids = [last] + [cfg["dspark_noise_token_id"]] * (k - 1)
        positions = [n + j for j in range(k)]
        streams = [[self.p("embed.weight")[t].copy() for _ in range(hc)] for t in ids]
        pre_prev = [[1.0] + [0.0] * (hc - 1) for _ in range(k)]  # the first sublayer: stream 0 alone
        for i in range(layers):
            pre_prev = self.draft_layer(i, streams, pre_prev, context, positions)
        hidden = [rmsnorm(collapse(streams[j], pre_prev[j]), self.p(last_layer + "norm.weight"), eps) for j in range(k)]
        embed, head = self.p(last_layer + "markov_head.embed.weight"), self.p(last_layer + "markov_head.head.weight")
        has_confidence = last_layer + "confidence_head.proj.weight" in self.weights
        prev, logits, tokens, gaps, confidence = last, [], [], [], []
        for j in range(k):
            z = self.p("head.weight") @ hidden[j] + head @ embed[prev]
            order = sorted(range(len(z)), key=lambda v: (-z[v], v))
            gaps.append(float(z[order[0]] - z[order[1]]))
            if has_confidence:
                confidence.append(float(self.p(last_layer + "confidence_head.proj.weight")[0]
                                        @ np.concatenate([hidden[j], embed[prev]])))
            prev = order[0] if chosen is None else int(chosen[j])
            logits.append(z)
            tokens.append(prev)
        return DraftReference(torch.tensor(np.array(logits), dtype=torch.float64), tokens, gaps,
                              confidence if has_confidence else None, self.near_ties)

    def draft_layer(self, i: int, streams: list[list[np.ndarray]], pre_prev: list[list[float]],
                    context: dict[int, np.ndarray], positions: list[int]) -> list[list[float]]:
        cfg, pre = self.cfg, f"mtp.{i}."
        attn_mix = [self.mhc(-1, "attn", s, pre) for s in streams]
        xs = [rmsnorm(collapse(streams[j], pre_prev[j]), self.p(pre + "attn_norm.weight"), self.eps)
              for j in range(len(streams))]
        outs = self.draft_attention(i, xs, context, positions)
        pre_f_all = []
        for j in range(len(streams)):
            _, post_a, c_a = attn_mix[j]
            streams[j] = mix(streams[j], post_a, c_a, outs[j])
            pre_f, post_f, c_f = self.mhc(-1, "ffn", streams[j], pre)
            x = rmsnorm(collapse(streams[j], attn_mix[j][0]), self.p(pre + "ffn_norm.weight"), self.eps)
            moe = self.moe(cfg["num_hidden_layers"] + i, positions[j], x, pre + "ffn.", cfg["dspark_n_routed_experts"],
                           cfg["dspark_num_experts_per_tok"])
            streams[j] = mix(streams[j], post_f, c_f, moe)
            pre_f_all.append(pre_f)
        return pre_f_all

    def draft_attention(self, i: int, xs: list[np.ndarray], context: dict[int, np.ndarray],
                        positions: list[int]) -> list[np.ndarray]:
        """Every query of the block over the context keys of positions n - W .. n - 1, then the block's own keys."""
        cfg, pre = self.cfg, f"mtp.{i}.attn."
        heads, hd, freqs = cfg["num_attention_heads"], cfg["head_dim"], self.window_freqs

        def key(x: np.ndarray, pos: int) -> np.ndarray:
            return rope(rmsnorm(self.p(pre + "wkv.weight") @ x, self.p(pre + "kv_norm.weight"), self.eps), pos, freqs)

        keys = [key(c, p) for p, c in sorted(context.items())] + [key(x, p) for x, p in zip(xs, positions)]
        outs = []
        for x, pos in zip(xs, positions):
            q = self.p(pre + "wq_b.weight") @ rmsnorm(self.p(pre + "wq_a.weight") @ x, self.p(pre + "q_norm.weight"),
                                                      self.eps)
            o_heads = []
            for h in range(heads):
                o_h = attend(rope(q[h * hd:(h + 1) * hd], pos, freqs), keys, float(self.p(pre + "attn_sink")[h]))
                o_heads.append(rope(o_h, pos, freqs, inverse=True))
            outs.append(self.output_projection(-1, o_heads, pre))
        return outs


def reference_draft(config: dict, weights: dict[str, torch.Tensor], features: torch.Tensor, last_token: int,
                    position: int, chosen: list[int] | None = None,
                    tie_tolerance: float = NEAR_TIE_TOLERANCE) -> DraftReference:
    """The float64 draft of one request: its last sampled token at `position` n, the target's features [S, nL*D]
    of positions 0 .. S - 1 (S >= n; those before n - W are not read); chosen[j]: the token taken as prev for
    position j + 1 (default: the argmax)."""
    cfg = flat_config(config)
    check_config(cfg)
    for name in ("num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                 "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"):
        if name not in cfg:
            raise ValueError(f"config field {name} is missing: the config has no drafter")
    if features.shape[0] < position:
        raise ValueError(f"features cover {features.shape[0]} positions; the draft at {position} reads up to "
                         f"{position - 1}")
    return _Draft(cfg, weights, [], None, None, tie_tolerance).run_draft(features, last_token, position, chosen)
