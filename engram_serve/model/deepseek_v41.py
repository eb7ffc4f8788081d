"""DeepSeek-V4.1's text model, top to bottom (docs/deepseek_v41.md is its definition).

Parameter names are the official checkpoint names (`embed.weight`, `layers.{l}.attn.wq_a.weight`,
`layers.{l}.hc_attn_fn`, `layers.{l}.ffn.experts.{e}.w1.weight` (stacked here as `ffn.w13` / `ffn.w2`),
`layers.{l}.engram.wkv.weight`, `head.weight`, ...), so a checkpoint loads by name.

One forward runs a microbatch of flattened tokens [T] of many requests (positions absolute) over the
paged state of `paged_state.py`; a full-sequence forward (training, scoring) is the same code over a
fresh cache whose block tables give each sequence its own slots (`forward_dense`). `stages` is a
generator that yields a stage name at each overlap point (the executor interleaves microbatches there);
the yield points are data-independent, so microbatches stay in lock step.

Row invariance (docs/contract.md §9): every matmul goes through `layers.linear` (the same bits for a
row whatever the call). Each token-wise step (the mHC mix after its matmul, collapse, expand, RMSNorm,
RoPE, the attention with its sink, the pooling, the indexer's scores, the top-k, the router, the SwiGLU,
the cache writes and key gathers) has two forms that compute the same formula: one call into the C token
kernel (model/fused.py), which computes each token alone in an order fixed per token, taken wherever it
runs (float32 CPU tensors outside autograd with the kernel loaded: a choice by devices, dtypes and
kernels, never by the batch); and the torch operators, where transcendental elementwise functions go
through `exactness.pointwise`, reductions run over a fixed-length last dimension or as explicit loops
over streams, and the attention and indexer products are batched matmuls whose per-item shapes are fixed
by the config (KEY_CHUNK entries per indexer item). Either way a token's bits never depend on its batch
mates, the cut or padding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..engram.layer import EngramGate
from ..errors import StaticBufferError
from .. import kernels
from . import capture, exactness, fused
from .exactness import pointwise
from .layers import Linear, RMSNorm, linear, stacked
from .paged_state import SlotPlan, PagedState

KEY_CHUNK = 64  # indexer entries per batched-matmul item: a fixed per-item shape whatever the context
ATTN_TOKENS = 256  # torch form: tokens whose keys are gathered at once (bounds a long prefill's gathered keys; a token's
# keys and result do not depend on it)
NEG_INF = float("-inf")
# The overlap points. A microbatch yields where something of its own can be in flight while another
# microbatch computes: its Engram gather (one process), its attention output's and its MoE output's
# cross-rank sums (tensor parallelism). Nowhere else: a stage boundary with nothing in flight only
# shortens the compute the other microbatch's in-flight sum hides behind.
STAGE_ENGRAM_GATHER, STAGE_ATTN, STAGE_MOE = "engram_gather", "attn", "moe"


# ---- roles ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerRole:
    """What layer `layer` does, from the config alone. `kv_source`: the layer whose compressed entries it
    reads (None for a window-only layer); `index_source`: the layer whose top-k it attends to (itself
    when it runs the indexer); `key_source`: for an indexer, the layer whose index keys it scores."""

    layer: int
    ratio: int
    kv_source: int | None
    index_source: int | None
    owns_compressor: bool
    runs_indexer: bool
    publishes_candidates: bool
    uses_candidates: bool


def layer_roles(cfg: ModelConfig) -> tuple[LayerRole, ...]:
    """The role of every backbone layer (docs/deepseek_v41.md, "Layer roles")."""
    roles, kv_src, idx_src = [], None, None
    c = cfg.candidate_source_layer_id
    for layer, r in enumerate(cfg.ratios):
        kv_src = layer if layer in cfg.kv_source_layer_ids else kv_src
        idx_src = layer if layer in cfg.index_source_layer_ids else idx_src
        runs = layer in cfg.index_source_layer_ids
        roles.append(LayerRole(layer, r, kv_src if r else None, idx_src if r else None,
                               layer in cfg.kv_source_layer_ids, runs, layer == c, runs and 0 <= c < layer))
    return tuple(roles)


# ---- rotary ----------------------------------------------------------------------------------------
def rope_frequencies(rd: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """f_j [rd / 2] float64, with YaRN's frequency ramp (attention factor 1) where `yarn` is given."""
    f = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64, device="cpu") / rd)  # (not on a meta device)
    if yarn:
        factor, orig = float(yarn.get("factor", 1.0)), float(yarn["original_max_position_embeddings"])
        corr = lambda b: rd * math.log(orig / (b * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        lo = max(math.floor(corr(float(yarn.get("beta_fast", 32)))), 0)
        hi = min(math.ceil(corr(float(yarn.get("beta_slow", 1)))), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64, device="cpu") - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        f = f / factor * ramp + f * (1 - ramp)
    return f


class RopeTable:
    """cos, sin [positions, rd / 2] float32 of angles computed in float64, grown on demand (doubling); a
    token's values depend on its position alone. For each of `shifts`, a copy of the table moved down by
    that many rows (the values at max(p - shift, 0)), so that a lookup at a shifted position is one gather
    at p."""

    def __init__(self, rd: int, theta: float, yarn: dict | None, rows: int = 4096, shifts: Iterable[int] = ()):
        self.freqs, self.initial, self.shifts = rope_frequencies(rd, theta, yarn), rows, tuple(shifts)
        self.cos = self.sin = None
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ensure(self, rows: int, device: torch.device | str = "cpu") -> None:
        have = 0 if self.cos is None else self.cos.shape[0]
        if have >= rows and self.cos.device == torch.device(device):
            return
        ang = torch.arange(max(rows, 2 * have, self.initial), dtype=torch.float64, device="cpu")[:, None] * self.freqs[None, :]
        self.cos, self.sin = ang.cos().float().to(device), ang.sin().float().to(device)
        self.tables = {0: (self.cos, self.sin)}
        for s in self.shifts:
            self.tables[s] = tuple(torch.cat([t[:1].expand(s, -1), t[:-s]]) for t in (self.cos, self.sin))

    def __call__(self, positions: torch.Tensor, top: int | None = None,
                 shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rd / 2] at max(p - shift, 0) for the positions p; `top` bounds p + 1 (default: read
        from the positions on the host)."""
        if top is None:
            top = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < top or self.cos.device != positions.device:
            self.ensure(top, positions.device)
        cos, sin = self.tables[shift]
        return fused.gather_rows(cos, positions)[:, 0], fused.gather_rows(sin, positions)[:, 0]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
         ) -> torch.Tensor:
    """Interleaved RoPE on the last rd = 2 * cos.shape[-1] dims of x [N, ..., width]; cos, sin [N, rd / 2].
    `in_place`: x is the caller's to overwrite (the C form writes into it)."""
    if fused.runs_in_c(x, cos, sin):
        return fused.rope(x, cos, sin, inverse, in_place)
    rd = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    tail = x[..., x.shape[-1] - rd:]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    if inverse:
        y0, y1 = x0 * cos + x1 * sin, x1 * cos - x0 * sin
    else:
        y0, y1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return torch.cat([x[..., : x.shape[-1] - rd], torch.stack([y0, y1], -1).flatten(-2)], -1)


# ---- mHC ---------------------------------------------------------------------------------------------
def hyper_mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) of one sublayer from its streams x [N, hc, D]."""
    n, hc, _ = x.shape
    v = x.reshape(n, -1)  # [N, hc*D]
    mm = linear(v, fn)  # [N, (2+hc)*hc]
    if fused.runs_in_c(v, mm, scale, base):
        return fused.hc_mix(x, mm, scale, base, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    seg = torch.cat([scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc)])
    m = mm * r * seg + base
    pre = pointwise(torch.sigmoid, m[:, :hc]) + cfg.hc_eps
    post = 2 * pointwise(torch.sigmoid, m[:, hc:2 * hc])
    c = m[:, 2 * hc:].reshape(n, hc, hc)
    c = pointwise(torch.exp, c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + cfg.hc_eps
    c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def hc_next(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, mix: torch.Tensor,
            fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: RMSNorm, cfg: ModelConfig,
            in_place: bool = False):
    """Between two sublayers: the streams x' = expand(o, x, post, comb), the next sublayer's mix of them
    (`hyper_mix` with fn, base, scale) and its input norm(collapse(x', mix)): (x', (pre, post, comb), input).
    One C call over tiles of tokens where the linear kernel takes fn (the same bits as the calls below).
    `in_place`: x' may be written over x (the caller reads x no more; the C forms do: one buffer of streams)."""
    if kernels.get("linear") is not None and fused.runs_in_c(o, x, post, comb, mix, fn, norm.weight) \
            and exactness.rules_on():
        p = exactness.plan(fn)
        if p.kernel_weight is not None:  # (fn's product as `linear` computes it)
            return fused.hc_next(o, x, post, comb, mix, p.kernel_weight, p.kc or 1, scale,
                                 base, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, norm.weight, norm.eps,
                                 p.is_tiles, in_place)
    x = expand(o, x, post, comb, in_place)
    return x, hyper_mix(x, fn, base, scale, cfg), norm(collapse(x, mix))


def collapse(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """sum_i mix[:, i] * x[:, i] for x [N, hc, D], mix [N, hc]: [N, D] (streams added in order)."""
    if fused.runs_in_c(x, mix):
        return fused.collapse(x, mix)
    out = mix[:, :1] * x[:, 0]
    for i in range(1, x.shape[1]):
        out = out + mix[:, i:i + 1] * x[:, i]
    return out


def expand(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, in_place: bool = False
           ) -> torch.Tensor:
    """x'[b] = post[b] * o + sum_a comb[a, b] * x[a] for o [N, D], x [N, hc, D]: [N, hc, D]; `in_place`: it may be
    written over x (the C form does)."""
    if fused.runs_in_c(o, x, post, comb):
        return fused.expand(o, x, post, comb, in_place)
    hc = x.shape[1]
    outs = []
    for b in range(hc):
        acc = post[:, b:b + 1] * o
        for a in range(hc):
            acc = acc + comb[:, a, b:b + 1] * x[:, a]
        outs.append(acc)
    return torch.stack(outs, 1)


# ---- top-k with the written tie rule ----------------------------------------------------------------
def topk_first(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The k best of scores [N, n] by value, ties to the lower index, -1 where fewer than k are finite (or
    above -inf): [N, k] int64, in `out` where given."""
    if fused.runs_in_c(scores):
        return fused.topk(scores, k, out)
    n = scores.shape[1]
    if n < k:
        scores = F.pad(scores, (0, k - n), value=NEG_INF)
    vals, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    ids = torch.where(vals[:, :k] != NEG_INF, ids[:, :k], -1)  # (a NaN is kept: its request errs, alone)
    return ids if out is None else out.copy_(ids)


# ---- the per-forward context --------------------------------------------------------------------------
@dataclass
class V41Step:
    """What one microbatch's forward reads and writes besides activations: the cache, its slot plan, the
    rope tables, and the microbatch's own cross-layer buffers `topk` [T, index_topk] int64 and
    `candidates` [T, candidate_topk_blocks] int64 (block ids, -1 none), owned by this microbatch alone
    (docs/contract.md §5). `touch(name, t)` reports a buffer use to the debug ownership check."""

    cache: PagedState
    plan: SlotPlan
    topk: torch.Tensor
    candidates: torch.Tensor
    touch: Callable[[str, torch.Tensor], None] = lambda name, t: None
    ctx: object = None  # the runner's ForwardContext (tensor parallelism: its collectives' buffers and tracking)
    rotary: dict = None  # "plain", "comp": (cos, sin) [T, rd / 2] at the positions; ratio r: at each token's entry


# ---- the paged state: writes and the keys a token reads -------------------------------------------
def store(cache: PagedState, pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
          positions: torch.Tensor | None = None, ratio: int = 1) -> None:
    """cache.write(pool, slots, values); with positions, only the rows of the tokens that complete an entry of
    `ratio` tokens (positions % ratio == ratio - 1): the others go to the trash slot."""
    if fused.runs_in_c(pool, values):
        fused.store_rows(pool, slots, values, cache.trash_slot, positions, ratio)
        return
    if positions is not None:
        slots = torch.where(positions % ratio == ratio - 1, slots, -1)
    cache.write(pool, slots, values)


def attention_keys(window: torch.Tensor, wslots: torch.Tensor, wok: torch.Tensor, entries: torch.Tensor | None,
                   eslots: torch.Tensor | None, topk: torch.Tensor | None, zero_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [T, W + K, hd], ok [T, W + K] bool): the window's keys window[wslots] (wslots, wok [T, W]), then
    (with topk [T, K], -1 none) the entries it picked, their slots from eslots [T, E]; a pick of -1 reads the
    zero slot, masked."""
    keys, ok = window[wslots], wok  # [T, W, hd]
    if topk is None:
        return keys, ok
    picked = eslots.gather(1, topk.clamp(min=0)).masked_fill(topk < 0, zero_slot)  # [T, K]
    return torch.cat([keys, entries[picked]], 1), torch.cat([ok, topk >= 0], 1)


# ---- attention -------------------------------------------------------------------------------------
def attend(q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with a sink logit, key = value. q [N, H, hd], keys [N, K, hd], ok [N, K] bool,
    sink [H] -> [N, H, hd]. Per-item shapes of the two batched matmuls are fixed by the caller."""
    z = torch.bmm(q, keys.transpose(1, 2)) * scale  # [N, H, K]
    z = z.masked_fill(~ok[:, None, :], NEG_INF)
    m = torch.maximum(z.amax(-1), sink[None, :])  # [N, H]
    e = pointwise(torch.exp, z - m[..., None])
    denom = e.sum(-1) + pointwise(torch.exp, sink[None, :] - m)
    return torch.bmm(e, keys) / denom[..., None]


def attend_paged(q: torch.Tensor, window: torch.Tensor, wslots: torch.Tensor, wok: torch.Tensor,
                 entries: torch.Tensor | None, eslots: torch.Tensor | None, topk: torch.Tensor | None, zero_slot: int,
                 sink: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` of q [T, H, hd] over the keys each token reads (`attention_keys`): in C in place in the pools;
    in torch gathered ATTN_TOKENS tokens at a time."""
    if fused.runs_in_c(q, window, entries, sink):
        return fused.attend_paged(q, window, wslots, wok, entries, eslots, topk, sink, scale)
    parts = []
    for a in range(0, q.shape[0], ATTN_TOKENS):
        b = min(q.shape[0], a + ATTN_TOKENS)
        keys, ok = attention_keys(window, wslots[a:b], wok[a:b], entries, None if eslots is None else eslots[a:b],
                                  None if topk is None else topk[a:b], zero_slot)
        parts.append(attend(q[a:b], keys, ok, sink, scale))  # [b - a, H, hd]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def pool_pair(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """A ratio-2 entry from its two tokens' [kv, gate] rows [T, 2hd]: sum of kv weighted by a per-channel
    softmax over the two gates -> [T, hd]."""
    if fused.runs_in_c(first, second):
        return fused.pool_pair(first, second)
    hd = first.shape[1] // 2
    s0, s1 = first[:, hd:], second[:, hd:]
    m = torch.maximum(s0, s1)
    e0, e1 = pointwise(torch.exp, s0 - m), pointwise(torch.exp, s1 - m)
    return (e0 * first[:, :hd] + e1 * second[:, :hd]) / (e0 + e1)


class Compressor(nn.Module):
    """A kv source's compressor (docs/deepseek_v41.md, "Compressor")."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        self.wgate = Linear(cfg.hidden_size, cfg.head_dim) if ratio == 2 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def latent(self, x: torch.Tensor, step: V41Step, layer: int) -> torch.Tensor:
        """The normed latent [T, hd] of the entry each token completes (garbage where it completes none;
        its writes go to the trash slot). Ratio 2 stores every token's [kv, gate] row first, then pools
        each token with the row of position p - 1, wherever that was computed."""
        if self.ratio == 1:
            return self.norm(linear(x, self.wkv.weight))  # [T, hd]
        row = linear(x, stacked(self.wkv.weight, self.wgate.weight)).float()  # [T, 2hd]: kv, then gate
        return self.norm(pool_pair(self.partner(row, step, layer), row).to(x.dtype))


    @staticmethod
    def partner(row: torch.Tensor, step: V41Step, layer: int) -> torch.Tensor:
        """Store this microbatch's [kv, gate] rows, then read each token's partner: the row of position
        p - 1 (the open group, when p is odd), from this microbatch or from wherever it ran before."""
        pool = step.cache.open[layer]
        store(step.cache, pool, step.plan.slots, row)
        return fused.gather_rows(pool, step.plan.prev_slots)[:, 0]  # [T, 2hd]


class Indexer(nn.Module):
    """An index source's indexer (docs/deepseek_v41.md, "Indexer"); `wk`/`k_norm` on kv sources only."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(cfg.hidden_size, self.heads)
        self.wk = Linear(cfg.head_dim, self.dim) if owns_keys else None
        self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps) if owns_keys else None

    def scores(self, x: torch.Tensor, qr: torch.Tensor, cos, sin, pool: torch.Tensor, slots: torch.Tensor,
               count: torch.Tensor, width: int, zero_slot: int, cands: torch.Tensor | None, block: int) -> torch.Tensor:
        """s [T, width]: sum_h w_h relu(q_h . k_g) for entry g of each token (its key at pool[slots[:, g]],
        slots [T, E], E <= width); -inf where not visible (g >= count) and, with cands [T, nc] (block ids, -1
        none), outside the candidate blocks of `block` entries. width is a multiple of KEY_CHUNK (each batched-
        matmul item of the torch form is one chunk)."""
        t = x.shape[0]
        q = rope(linear(qr, self.wq_b.weight).view(t, self.heads, self.dim), cos, sin, in_place=True)  # [T, nh, ihd]
        w = linear(x, self.weights_proj.weight)  # [T, nh]
        wscale = self.dim ** -0.5 * self.heads ** -0.5
        if fused.runs_in_c(q, w, pool):
            return fused.index_scores(q, w, wscale, pool, slots, count, width, cands, block)
        w = w * wscale
        keys = pool[F.pad(slots, (0, width - slots.shape[1]), value=zero_slot)]  # [T, width, ihd]
        ok = torch.arange(width, device=x.device)[None, :] < count[:, None]
        e = width
        c = e // KEY_CHUNK
        qc = q[:, None].expand(t, c, self.heads, self.dim).reshape(t * c, self.heads, self.dim)
        dots = torch.bmm(qc, keys.view(t * c, KEY_CHUNK, self.dim).transpose(1, 2))  # [T*C, nh, CH]
        wc = w[:, None, :, None].expand(t, c, self.heads, 1).reshape(t * c, self.heads, 1)
        s = (torch.relu(dots) * wc).transpose(1, 2).contiguous().sum(-1).view(t, e)  # heads summed per entry
        s = s.masked_fill(~ok, NEG_INF)
        if cands is not None:
            nb = width // block
            chosen = torch.zeros(t, nb + 1, dtype=torch.bool, device=x.device)
            chosen.scatter_(1, torch.where(cands < 0, nb, cands), True)  # [T, blocks + 1]: the last column is "none"
            s = s.masked_fill(~chosen[:, :nb].repeat_interleave(block, 1), NEG_INF)
        return s


def candidate_blocks(s: torch.Tensor, count: torch.Tensor, block: int, k: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The candidate source's blocks [T, k] (ids, -1 none), in `out` where given: block scores are the max of
    their entries' scores s [T, E] (E a multiple of `block`), the newest visible block (count - 1) // block is
    +inf."""
    if fused.runs_in_c(s):
        return fused.candidate_blocks(s, count, block, k, out)
    t, e = s.shape
    bs = s.view(t, e // block, block).amax(-1)  # [T, B]
    newest = torch.where(count > 0, torch.div(count - 1, block, rounding_mode="floor"), -1)
    bs = bs.masked_fill(torch.arange(bs.shape[1], device=s.device)[None, :] == newest[:, None], float("inf"))
    return topk_first(bs, k, out)


class Attention(nn.Module):
    """One layer's attention (docs/deepseek_v41.md, "Attention"), with its compressor and indexer."""

    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        self.cfg, self.role = cfg, role
        h, hd, og = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.heads, self.groups = h, og  # this module's heads and output groups (a tensor-parallel shard's own)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * hd)
        self.wkv = Linear(cfg.hidden_size, hd)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = Linear(h * hd // og, og * cfg.o_lora_rank)  # block-diagonal: group g is rows g*ol .. (g+1)*ol
        self.wo_b = Linear(og * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.compressor = Compressor(cfg, role.ratio) if role.owns_compressor else None
        self.indexer = Indexer(cfg, role.owns_compressor) if role.runs_indexer else None

    def forward(self, x: torch.Tensor, step: V41Step, rope_cs: tuple[torch.Tensor, torch.Tensor],
                entry_cs: tuple[torch.Tensor, torch.Tensor] | None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]. rope_cs: this layer kind's cos, sin at the tokens' positions; entry_cs: at the
        first position of the entry each token completes (compressed layers). With `keep` [K] (token
        indices) every token's keys and entries are stored, but only the tokens `keep` attend: -> [K, D]."""
        cfg, role, plan = self.cfg, self.role, step.plan
        h, hd = self.heads, cfg.head_dim
        kv = rope(self.kv_norm(linear(x, self.wkv.weight)), *rope_cs, in_place=True)  # [T, hd]
        window = step.cache.window[role.layer]
        store(step.cache, window, plan.slots, kv)  # this microbatch's keys first: a token attends to itself
        if role.ratio and self.compressor is not None:
            self._compress(x, step, entry_cs)
        topk, cands = step.topk[:x.shape[0]], step.candidates[:x.shape[0]]
        if role.ratio:
            step.touch("topk", topk)
            if self.indexer is not None and (role.uses_candidates or role.publishes_candidates):
                step.touch("candidates", cands)
        if keep is not None:  # the other tokens' top-k and candidates are read by no later layer
            x, rope_cs, plan = x[keep], tuple(c[keep] for c in rope_cs), plan.rows(keep)
            topk, cands = topk[keep], cands[keep]
        t = x.shape[0]
        qr = self.q_norm(linear(x, self.wq_a.weight))  # [T, ql]
        q = rope(linear(qr, self.wq_b.weight).view(t, h, hd), *rope_cs, in_place=True)  # [T, H, hd]
        entries = eslots = None
        if role.ratio:
            if self.indexer is not None:
                self._select(x, qr, step, plan, rope_cs, topk, cands)
            entries, eslots = step.cache.entries[role.kv_source], plan.entry_slots[role.ratio]
        else:
            topk = None
        o = attend_paged(q, window, plan.window, plan.window_ok, entries, eslots, topk, step.cache.zero_slot,
                         sink=self.attn_sink, scale=hd ** -0.5)  # [T, H, hd]
        o = rope(o, *rope_cs, inverse=True, in_place=True).reshape(t, self.groups, h * hd // self.groups)
        ol = cfg.o_lora_rank
        u = fused.cat_cols([linear(o[:, g], self.wo_a.weight[g * ol:(g + 1) * ol]) for g in range(self.groups)])
        return linear(u, self.wo_b.weight)

    def _compress(self, x: torch.Tensor, step: V41Step, entry_cs) -> None:
        """Store the entries (and index keys) completed by this microbatch's tokens."""
        layer, r, plan = self.role.layer, self.role.ratio, step.plan
        latent = self.compressor.latent(x, step, layer)  # [T, hd]
        store(step.cache, step.cache.entries[layer], plan.slots, rope(latent, *entry_cs), plan.positions, r)
        ik = rope(self.indexer.k_norm(linear(latent, self.indexer.wk.weight)), *entry_cs, in_place=True)
        store(step.cache, step.cache.index_keys[layer], plan.slots, ik, plan.positions, r)

    def _select(self, x: torch.Tensor, qr: torch.Tensor, step: V41Step, plan: SlotPlan, rope_cs, topk: torch.Tensor,
                cands: torch.Tensor) -> None:
        """Score the key source's entries for the tokens of `plan` and write their top-k into `topk` [T, index_topk]
        (and their candidate blocks into `cands`, or read them there)."""
        cfg, role = self.cfg, self.role
        eslots, count = plan.entry_slots[role.ratio], plan.entry_count[role.ratio]  # [T, E], [T]
        unit = math.lcm(KEY_CHUNK, cfg.candidate_block_size)  # whole indexer items and whole candidate blocks
        width = max(1, -(-eslots.shape[1] // unit)) * unit
        s = self.indexer.scores(x, qr, *rope_cs, step.cache.index_keys[role.kv_source], eslots, count, width,
                                step.cache.zero_slot, cands if role.uses_candidates else None,
                                cfg.candidate_block_size)  # [T, width]
        if role.publishes_candidates:
            candidate_blocks(s, count, cfg.candidate_block_size, cfg.candidate_topk_blocks, out=cands)
        topk_first(s, cfg.index_topk, out=topk)


# ---- MoE -------------------------------------------------------------------------------------------
def swiglu(gu: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) for gu [N, 2 * inter] = (g, u); no clamp when L <= 0."""
    if fused.runs_in_c(gu):
        return fused.swiglu(gu, inter, limit)
    g, u = gu[:, :inter], gu[:, inter:]
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return pointwise(F.silu, g.contiguous()) * u


class ExpertPanels(NamedTuple):
    """What the experts' one linear-kernel call reads (`exactness.moe_experts`): the addresses [E] int64 of each
    expert's packed w13 and w2 (their strategies' `kernel_weight`), their block sizes, the strategies kept alive,
    and whether the addresses are of bfloat16 tiles."""

    w13: torch.Tensor
    kc13: int
    w2: torch.Tensor
    kc2: int
    plans: list
    tiles: bool


class MoE(nn.Module):
    """Routed experts with sqrt(softplus) scores and a bias that only chooses, plus one shared expert.

    Parameters: `gate.weight` [E, D], `gate.bias` [E]; the experts stacked as `w13` [E, 2I, D] (w1 then w3
    by rows) and `w2` [E, D, I]; `shared_experts.{w1,w2,w3}` (checkpoints keep one tensor per expert:
    `experts.{e}.w{1,2,3}.weight`, stacked when loading). A token's output adds its experts' weighted
    outputs in ascending expert order, then the shared expert's: an order fixed per token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg, self.inter = cfg, i
        self.gate = Linear(d, e)
        self.gate.register_parameter("bias", nn.Parameter(torch.zeros(e)))  # chooses experts, never weighs them
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = nn.Module()
        self.shared_experts.w1, self.shared_experts.w3 = Linear(d, i), Linear(d, i)
        self.shared_experts.w2 = Linear(i, d)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k] best first, ties to the lower id; their weights [N, k])."""
        cfg = self.cfg
        z = linear(x, self.gate.weight)  # [N, E]
        if fused.runs_in_c(z, self.gate.bias):
            return fused.moe_route(z, self.gate.bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                   cfg.routed_scaling_factor)
        score = torch.sqrt(pointwise(F.softplus, z))
        ids = topk_first(score + self.gate.bias, cfg.num_experts_per_tok)
        w = score.gather(1, ids)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:  # (one expert: its raw score, as the peers do)
            w = w / w.sum(-1, keepdim=True)
        return ids, w * cfg.routed_scaling_factor

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(swiglu(linear(x, self.w13[e]), self.inter, self.cfg.swiglu_limit), self.w2[e])

    def experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """ys [P, D]: each expert's output for its rows of xs [P, D] (grouped by expert, counts [E] int64 rows
        each). One linear-kernel call where the C matmul serves every expert's weights (`exactness.moe_experts`:
        the very products and SwiGLU of `expert`, so the same bits, and no host read); else `expert` per
        expert with rows, after a host read of the counts."""
        panels = self._expert_panels(xs, counts)
        if panels is not None:
            return exactness.moe_experts(xs, counts, panels.w13, panels.kc13, panels.w2, panels.kc2, self.inter,
                                         self.cfg.swiglu_limit, panels.tiles)
        capture.refuse("the MoE reads its expert counts on the host")
        parts, start = [], 0
        for e, c in enumerate(counts.tolist()):  # one host read
            if c:
                parts.append(self.expert(e, xs[start:start + c]))
            start += c
        return fused.cat_rows(parts) if parts else xs

    def _expert_panels(self, xs: torch.Tensor, counts: torch.Tensor) -> ExpertPanels | None:
        """The `ExpertPanels` of the experts where the C matmul takes every expert's product (model/exactness.py: the
        rules on, every expert's bfloat16 tiles or a probed kc, float32 CPU rows, no autograd) and the SwiGLU takes
        its C form, else None. Cached per weight version."""
        w13, w2 = self.w13, self.w2
        if not (exactness.rules_on() and fused.runs_in_c(xs, w13, w2) and xs.is_contiguous() and counts.is_cpu):
            return None  # (the token kernel's SwiGLU is the one inside: with the token kernel on only)
        key = (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, kernels.get("linear"), torch.get_num_threads())
        cached = getattr(self, "_panels", None)
        if cached is None or cached[0] != key:
            plans13 = [exactness.plan(w13[e]) for e in range(w13.shape[0])]
            plans2 = [exactness.plan(w2[e]) for e in range(w2.shape[0])]
            tiles = all(p.is_tiles for p in plans13 + plans2)  # every expert on the bfloat16 tiles
            ok = tiles or all(p.kernel_weight is not None and not p.is_tiles for p in plans13 + plans2)  # (else mixed)
            panels = None if not ok else ExpertPanels(
                torch.tensor([p.kernel_weight.data_ptr() for p in plans13], dtype=torch.int64), plans13[0].kc or 1,
                torch.tensor([p.kernel_weight.data_ptr() for p in plans2], dtype=torch.int64), plans2[0].kc or 1,
                plans13 + plans2, tiles)
            self._panels = cached = (key, panels)
        return cached[1]

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shared_experts
        gu = linear(x, stacked(s.w1.weight, s.w3.weight))  # [N, 2I]: w1's outputs, then w3's
        return linear(swiglu(gu, self.inter, self.cfg.swiglu_limit), s.w2.weight)

    def stages(self, x: torch.Tensor, ctx=None) -> Generator[str, None, torch.Tensor]:
        """Yields once, before the combine (the expert-parallel overlap point; `ctx`, the runner's
        ForwardContext, is for an expert-parallel shard's collective); returns [N, D]."""
        k, experts = self.cfg.num_experts_per_tok, self.cfg.n_routed_experts
        ids, w = self.route(x)
        in_c = fused.runs_in_c(x, w)
        if in_c:
            order, counts, tok = fused.moe_group(ids, experts)
            xs = fused.gather_rows(x, tok)[:, 0]  # [N*k, D]
        else:
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept inside
            counts = torch.bincount(flat, minlength=experts)
            tok = torch.div(order, k, rounding_mode="floor")
            xs = x[tok]  # [N*k, D]
        ys = self.experts(xs, counts)  # [N*k, D]
        yield STAGE_MOE
        if in_c:
            return fused.moe_combine(ys, order, w, self.shared(x))
        routed = torch.zeros_like(x).index_add_(0, tok, ys * w.reshape(-1)[order][:, None])
        return routed + self.shared(x)


# ---- the model -------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        e = cfg.engram
        self.role = role
        self.engram_index = e.engram_layer_ids.index(role.layer) if role.layer in e.engram_layer_ids else None
        self.engram = (EngramGate(d, hc, e.num_columns, e.engram_head_dim, cfg.rms_norm_eps)
                       if self.engram_index is not None else None)
        mix = (2 + hc) * hc
        for s in ("attn", "ffn"):
            self.register_parameter(f"hc_{s}_fn", nn.Parameter(torch.zeros(mix, hc * d)))
            self.register_parameter(f"hc_{s}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{s}_scale", nn.Parameter(torch.ones(3)))
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, role)
        self.ffn = MoE(cfg)


class DeepseekV41(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.roles = layer_roles(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, role) for role in self.roles)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope_plain = RopeTable(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        self.rope_comp = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling,
                                   shifts=sorted({r - 1 for r in cfg.ratios if r > 1}))
        self._stream0 = torch.zeros(0, cfg.hc_mult)  # rows (1, 0, .., 0): layer 0's attention reads stream 0 alone

    def stages(self, ctx) -> Generator[str, None, torch.Tensor]:
        """The serving forward of one microbatch (a ForwardContext: its StepBatch slice, the cache, its own
        buffers, its staged Engram rows) -> hidden [T, D], or of the tokens `ctx.keep` alone; yields at overlap
        points."""
        step = self.prepare(ctx)
        return (yield from self.forward_stages(ctx.batch.input_ids, ctx.batch.dead, step, ctx.engram_rows, ctx.keep))

    def prepare(self, ctx, rows_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> V41Step:
        """The V41Step of one microbatch: its slot plan over its rows' block tables, its own buffers, its rotary
        lookups. `rows_tables`: `plan_rows(ctx)`, where the caller has it already."""
        b, bufs = ctx.batch, ctx.bufs
        if b.num_tokens > bufs.capacity:
            raise StaticBufferError(f"buffers of microbatch {bufs.microbatch} hold {bufs.capacity} tokens; "
                                    f"the microbatch has {b.num_tokens}")
        rows, tables = rows_tables or plan_rows(ctx)
        step = self.make_step(ctx.kv, b.positions, rows, tables, b.block_size, b.slot_mapping, bufs.topk_idx,
                              bufs.candidates, ctx.touch, None if ctx.max_seq_len is None else ctx.max_seq_len - 1)
        step.ctx = ctx
        return step

    def rotary(self, pos: torch.Tensor, top: int | None = None) -> dict:
        """The cos, sin [T, rd / 2] a forward reads: "plain" (window-only layers) and "comp" (compressed layers)
        at the positions pos [T], and per ratio r > 1 at the first position of the entry each token completes;
        `top` bounds the positions + 1 (default: read on the host)."""
        out = {"plain": self.rope_plain(pos, top), "comp": self.rope_comp(pos, top)}
        for r in sorted({r for r in self.config.ratios if r > 1}):
            out[r] = self.rope_comp(pos, top, shift=r - 1)
        return out

    def forward_stages(self, ids: torch.Tensor, dead: torch.Tensor | None, step: V41Step,
                       engram_rows: Callable[[int], torch.Tensor] | None, keep: torch.Tensor | None = None
                       ) -> Generator[str, None, torch.Tensor]:
        """The forward of one microbatch: ids [T] -> final hidden [T, D]; yields at overlap points.
        `engram_rows(i)` gives Engram layer i's staged rows [T, C, hd] (None: Engram ablated). With `keep` [K]
        (increasing token indices) -> the final hidden of those tokens alone [K, D]: the last layer stores every
        token's keys and entries, and computes the rest for those tokens only, which no other token reads."""
        if keep is not None and not len(keep):  # one token still runs every stage (microbatches keep in step)
            return (yield from self.forward_stages(ids, dead, step, engram_rows, keep.new_zeros(1)))[:0]
        cfg, cs = self.config, step.rotary
        x = fused.gather_rows(self.embed.weight, ids, cfg.hc_mult)  # [T, hc, D]: the embedding on every stream
        early = engram_sums(self.layers, engram_rows, step.ctx)  # tensor parallel only
        pre = self._first_mix(ids.shape[0], ids.device)
        ahead = None  # this layer's attention mix and input, made with the last layer's expand (`hc_next`)
        for i, blk in enumerate(self.layers):
            role, last = blk.role, keep if blk is self.layers[-1] else None
            if early is not None and blk.engram is not None:  # its sum was launched at the start
                x = blk.engram.apply(x.contiguous(), early(blk.engram_index), dead)
            elif blk.engram is not None:
                yield STAGE_ENGRAM_GATHER  # the other microbatch computes while this one's gather runs
                if engram_rows is not None:
                    rows = engram_rows(blk.engram_index)
                    step.touch("staging", rows)
                    x = blk.engram(x.contiguous(), rows, dead)
            if ahead is not None:
                (pre_a, post_a, comb_a), h = ahead
            else:
                h = blk.attn_norm(collapse(x, pre))
                if last is not None:
                    x = x[last]
                pre_a, post_a, comb_a = hyper_mix(x, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, cfg)
            rope_cs = cs["comp"] if role.ratio else cs["plain"]
            a = blk.attn(h, step, rope_cs, cs.get(role.ratio, cs["comp"]) if role.ratio else None, last)
            a = yield from collective_point(a, blk.attn.wo_b, STAGE_ATTN, step.ctx)
            x, (pre_f, post_f, comb_f), h = hc_next(a, x, post_a, comb_a, pre_a, blk.hc_ffn_fn, blk.hc_ffn_base,
                                                    blk.hc_ffn_scale, blk.ffn_norm, cfg, in_place=True)
            f = yield from blk.ffn.stages(h, step.ctx)
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if nxt is None or nxt.engram is not None or (keep is not None and nxt is self.layers[-1]):
                x, ahead = expand(f, x, post_f, comb_f, in_place=True), None  # (an Engram gate or `keep` between)
            else:
                x, *ahead = hc_next(f, x, post_f, comb_f, pre_f, nxt.hc_attn_fn, nxt.hc_attn_base, nxt.hc_attn_scale,
                                    nxt.attn_norm, cfg, in_place=True)
            pre = pre_f
        return self.norm(collapse(x, pre))

    def _first_mix(self, t: int, device: torch.device) -> torch.Tensor:
        """[t, hc] rows (1, 0, .., 0), a view of one constant grown on demand: no operator per forward (a CPU
        graph replays none)."""
        if self._stream0.shape[0] < t or self._stream0.device != device:
            self._stream0 = torch.zeros(max(t, 2 * self._stream0.shape[0]), self.config.hc_mult, device=device)
            self._stream0[:, 0] = 1.0
        return self._stream0[:t]

    def ensure_positions(self, n: int, device: torch.device | str = "cpu") -> None:
        """Rope tables for positions 0 .. n - 1 on `device` (grown once, before serving)."""
        self.rope_plain.ensure(n, device)
        self.rope_comp.ensure(n, device)

    def matmul_params(self):
        """(module, parameter name, input dims) of every weight `linear` multiplies by (layers.layout_weights_)."""
        for m in self.modules():
            if isinstance(m, Linear):
                yield m, "weight", 1
            elif isinstance(m, MoE):
                yield m, "w13", 1
                yield m, "w2", 1
            elif isinstance(m, Block):
                yield m, "hc_attn_fn", 1
                yield m, "hc_ffn_fn", 1

    def matmul_weights(self) -> list[torch.Tensor]:
        """The 2-D weights `linear` multiplies by, as the forward views them (layers.pad_rows)."""
        out, ol = [], self.config.o_lora_rank
        for m, name, _ in self.matmul_params():
            w = getattr(m, name)
            if isinstance(m, MoE):
                out += [w[0]]
            elif name == "weight" and m is not None and any(a.wo_a is m for a in self._attentions()):
                out += [w[:ol]]
            else:
                out.append(w)
        return out

    def _attentions(self):
        return [b.attn for b in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, vocab] float32."""
        w = self.embed.weight if self.head is None else self.head.weight
        return linear(hidden, w).float()

    def forward_dense(self, input_ids: torch.Tensor, engram_rows: list[torch.Tensor] | None,
                      dead: torch.Tensor | None = None) -> torch.Tensor:
        """Full sequences input_ids [B, S] at positions 0..S-1 -> logits [B, S, V] float32, through the
        serving code over a fresh cache (sequence b owns slots b*S .. b*S + S - 1). engram_rows[i]
        [B, S, C, hd] (None: Engram ablated); dead [B, S] bool."""
        b, s = input_ids.shape
        dev = input_ids.device
        cache = PagedState(self.config, b, s, device=dev, dtype=self.embed.weight.dtype)
        positions = torch.arange(s, device=dev).repeat(b)
        rows = torch.arange(b, device=dev).repeat_interleave(s)
        step = self.make_step(cache, positions, rows, torch.arange(b, device=dev)[:, None], s,
                              rows * s + positions)
        fn = None if engram_rows is None else (lambda i: engram_rows[i].reshape(b * s, *engram_rows[i].shape[2:]))
        gen = self.forward_stages(input_ids.reshape(-1), None if dead is None else dead.reshape(-1), step, fn)
        hidden = run_stages(gen)
        return self.compute_logits(hidden).view(b, s, -1)

    def make_step(self, cache: PagedState, positions: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor,
                  block_size: int, slots: torch.Tensor, topk: torch.Tensor | None = None,
                  candidates: torch.Tensor | None = None, touch=None, max_position: int | None = None) -> V41Step:
        """A V41Step over `cache` for tokens at `positions` of `rows` of `block_tables` (fresh cross-layer
        buffers unless given)."""
        cfg, t, dev = self.config, positions.shape[0], positions.device
        plan = SlotPlan.build(positions, rows, block_tables, block_size, slots, cache.zero_slot, cfg.sliding_window,
                              cfg.ratios, max_position)
        topk = topk if topk is not None else torch.full((t, cfg.index_topk), -1, dtype=torch.int64, device=dev)
        if candidates is None:
            candidates = torch.full((t, cfg.candidate_topk_blocks), -1, dtype=torch.int64, device=dev)
        top = None if max_position is None else max_position + 1
        return V41Step(cache, plan, topk, candidates, touch or (lambda name, x: None),
                       rotary=self.rotary(positions, top))


def plan_rows(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [T], tables [R + 1, W]) of one microbatch: the row of each token in its block tables, which gain an
    extra null row for the padding tokens (past qsl[-1]: every read of theirs is the zero slot). With a bound
    on the positions (`ctx.max_seq_len`), W is the bound's blocks at least, so that W stays the same from one
    step to the next while the bound does (a CPU graph's key)."""
    b = ctx.batch
    t, r = b.num_tokens, b.num_rows
    width = b.block_tables.shape[1]
    if ctx.max_seq_len is not None:
        width = max(width, -(-ctx.max_seq_len // b.block_size))
    if b.qsl.device.type == "cpu":  # numpy: a few us instead of ~40 of torch operators
        tables = np.full((r + 1, width), -1, dtype=np.int64)
        tables[:r, :b.block_tables.shape[1]] = b.block_tables.numpy()
        rows = np.searchsorted(b.qsl_host[1:r + 1], np.arange(t), side="right")
        return torch.from_numpy(rows), torch.from_numpy(tables)
    rows = torch.searchsorted(b.qsl[1:r + 1], torch.arange(t, device=b.qsl.device), right=True)
    tables = b.block_tables.new_full((r + 1, width), -1)
    tables[:r, :b.block_tables.shape[1]] = b.block_tables
    return rows, tables


def collective_point(x: torch.Tensor, module, stage: str, ctx) -> Generator[str, None, torch.Tensor]:
    """Yield `stage`, returning x. Under tensor parallelism `module` produced x as this rank's partial sum
    (it has `launch_reduce`): the cross-rank sum is launched before the yield and awaited after it, so it
    is in flight while the other microbatch runs its next stage; returns the sum."""
    launch = getattr(module, "launch_reduce", None)
    if launch is None:
        yield stage
        return x
    pending = launch(x, ctx)
    yield stage
    return pending.wait()


def engram_sums(blocks, engram_rows, ctx):
    """Tensor parallelism only (each Engram `wkv` has `launch_reduce`): a projection depends on the staged
    rows alone, so every Engram layer's partial projection (this rank's table shard) is computed at the
    start of the forward and all are summed across ranks in ONE collective, in flight while the microbatches
    run the layers before the first Engram layer. Returns `kv(engram_index)` (waits at its first call), or
    None (one process, or Engram ablated)."""
    blocks = sorted((b for b in blocks if b.engram is not None), key=lambda b: b.engram_index)
    if engram_rows is None or not blocks or not hasattr(blocks[0].engram.wkv, "launch_reduce"):
        return None
    parts = [b.engram.project(engram_rows(b.engram_index)) for b in blocks]  # [T, (hc+1)*D] partials
    wkv = blocks[0].engram.wkv
    pending = wkv.launch_reduce(torch.cat(parts, 1), ctx, wkv.early_buffer)
    width, summed = parts[0].shape[1], []

    def kv(i: int) -> torch.Tensor:
        if not summed:
            summed.append(pending.wait())
        return summed[0][:, i * width:(i + 1) * width]
    return kv


def run_stages(gen: Generator):
    """Drive a stage generator to completion; returns its value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def init_weights(model: DeepseekV41, seed: int, std: float = 0.02) -> DeepseekV41:
    """Deterministic random init: norms, mHC scales and Engram q/k weights at 1; mHC bases, sinks and the
    router bias at 0; embeddings N(0, 1); every other matrix N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    ones = ("norm.weight", "_scale", ".q_weight", ".k_weight")
    zeros = ("_base", "attn_sink", "gate.bias")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ones):
                p.fill_(1.0)
            elif name.endswith(zeros):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "embed.weight" else std))
    return model
