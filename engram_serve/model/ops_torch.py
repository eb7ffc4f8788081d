"""The token-wise steps of the V4.1 forward in torch: the readable formulas (read these first).

model/ops_c.py has the same functions with the same signatures, each one call into the C token kernel; which
module a forward runs is chosen once per forward (model/ops.py `choose`) and passed down, never per call. The
two compute the same formula, not the same bits. A token's bits here do not depend on its batch mates, the
cut or padding either: transcendental elementwise functions go through `exactness.pointwise`, reductions run
over a fixed-length last dimension or as explicit loops over streams, and the attention and indexer products
are batched matmuls whose per-item shapes are fixed by the config (KEY_CHUNK entries per indexer item). Inputs
are never modified (but by `store_rows`, whose pool is written in place).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .exactness import pointwise
from .layers import linear

KEY_CHUNK = 64  # indexer entries per batched-matmul item: a fixed per-item shape whatever the context
ATTN_TOKENS = 256  # tokens whose keys are gathered at once (bounds a long prefill's gathered keys; a token's keys
# and result do not depend on it)
NEG_INF = float("-inf")


# ---- rows, norms, rotary -----------------------------------------------------------------------------
def gather_rows(src: torch.Tensor, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """[N, copies, width]: row ids[t] of src [rows, width] on each copy (the embedding, the rotary tables);
    ids [N] int64. An id outside [0, rows) raises IndexError."""
    rows = src[ids][:, None, :]
    return rows if copies == 1 else rows.expand(ids.shape[0], copies, src.shape[1]).contiguous()


def cat_cols(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, 1) of [N, w_i] parts."""
    return torch.cat(parts, 1)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of [n_i, w] parts."""
    return torch.cat(parts)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1) for x [rows, v] (v >= 1): the first index of each row's maximum, a NaN above every number."""
    return x.argmax(dim=1)


def argmax_finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`argmax_rows(x)`, torch.isfinite(x).all(dim=1)) for x [rows, v]."""
    return x.argmax(dim=1), torch.isfinite(x).all(dim=1)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim, computed in float32, returned in x's dtype. A
    float32 input is used as is (no `.float()` / `.to()` calls: each is an operator even when it copies nothing)."""
    xf = x if x.dtype == torch.float32 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight if weight.dtype == torch.float32 else weight.float())
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, in_place: bool = False) -> torch.Tensor:
    """Interleaved RoPE of the last rd = 2 * cos.shape[-1] dims of x [N, ..., width]; cos, sin [N, rd / 2].
    (`in_place` allows writing into x; this form never does.)"""
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


# ---- the Engram gate -----------------------------------------------------------------------------------
def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                dead: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Engram gate of docs/contract.md §7 (engram/layer.py): h [N, hc, hidden] with gate_i * value added to
    branch i, from the projection kv [N, (hc + 1) * hidden]; dead [N] tokens get gate 0."""
    g, value = engram_gate_value(h, kv, q_w, k_w, dead, eps)
    return h + g[..., None] * value[:, None, :]  # (not addcmul: a fused multiply-add may round differently
    # in the vectorised body and the scalar tail, which would make a row's bits depend on its place)


def engram_gate_value(h: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                      dead: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate [N, hc] and value [N, hidden] of `engram_gate`, computed in float32; dtype conversions only
    where a dtype differs (each is an operator)."""
    n, hc, dim = h.shape
    keys = kv[:, :hc * dim].view(n, hc, dim)
    value = kv[:, hc * dim:]  # [N, hidden], shared by all branches
    q = rms_norm(h.float() if h.dtype != torch.float32 else h, eps, q_w)  # [N, hc, hidden] float32
    k = rms_norm(keys.float() if keys.dtype != torch.float32 else keys, eps, k_w)
    dot = (q * k).sum(-1) / math.sqrt(dim)  # [N, hc]
    mag = torch.sqrt(dot.abs().clamp(min=1e-6))  # (NaN stays NaN)
    g = pointwise(torch.sigmoid, torch.where(dot < 0, -mag, mag))  # the positive root at dot = +-0
    if dead is not None:
        g = g.masked_fill(dead[:, None], 0.0)
    return (g if g.dtype == h.dtype else g.to(h.dtype)), value


# ---- mHC -----------------------------------------------------------------------------------------------
def hc_mix(x: torch.Tensor, mm: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float, hc_eps: float,
           iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) of the mHC mix from the streams x [N, hc, D] and their
    product mm = fn . x [N, (2 + hc) hc]: sigmoid gates, and comb by `iters` Sinkhorn normalisations."""
    return _mix(x.reshape(x.shape[0], -1), mm, x.shape[1], scale, base, eps, hc_eps, iters)


def _mix(v: torch.Tensor, mm: torch.Tensor, hc: int, scale: torch.Tensor, base: torch.Tensor, eps: float,
         hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mix` from the streams flattened, v [N, hc*D] (one view of them, shared with the product's input: one
    autograd path into the streams)."""
    n = v.shape[0]
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    seg = torch.cat([scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc)])
    m = mm * r * seg + base
    pre = pointwise(torch.sigmoid, m[:, :hc]) + hc_eps
    post = 2 * pointwise(torch.sigmoid, m[:, hc:2 * hc])
    c = m[:, 2 * hc:].reshape(n, hc, hc)
    c = pointwise(torch.exp, c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


def hyper_mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) of one sublayer from its streams x [N, hc, D] (`hc_mix` of
    the product by the sublayer's fn)."""
    v = x.reshape(x.shape[0], -1)  # [N, hc*D]
    return _mix(v, linear(v, fn), x.shape[1], scale, base, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)


def collapse(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """sum_i mix[:, i] * x[:, i] for x [N, hc, D], mix [N, hc]: [N, D] (streams added in order)."""
    out = mix[:, :1] * x[:, 0]
    for i in range(1, x.shape[1]):
        out = out + mix[:, i:i + 1] * x[:, i]
    return out


def stream_mean(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, D]: the mean of the streams x [N, hc, D], added in stream order, then divided by hc (into `out` if
    given)."""
    mean = x[:, 0]
    for i in range(1, x.shape[1]):
        mean = mean + x[:, i]
    mean = mean / x.shape[1]
    return mean if out is None else out.copy_(mean)


def expand(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, in_place: bool = False
           ) -> torch.Tensor:
    """x'[b] = post[b] * o + sum_a comb[a, b] * x[a] for o [N, D], x [N, hc, D]: [N, hc, D]. (`in_place` allows
    writing over x; this form never does.)"""
    hc = x.shape[1]
    outs = []
    for b in range(hc):
        acc = post[:, b:b + 1] * o
        for a in range(hc):
            acc = acc + comb[:, a, b:b + 1] * x[:, a]
        outs.append(acc)
    return torch.stack(outs, 1)


def hc_next(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, mix: torch.Tensor,
            fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor, norm_eps: float, cfg,
            in_place: bool = False):
    """Between two sublayers: the streams x' = expand(o, x, post, comb), the next sublayer's mix of them
    (`hyper_mix` with fn, base, scale) and its input rms_norm(collapse(x', mix)): (x', (pre, post, comb), input)."""
    x = expand(o, x, post, comb, in_place)
    return x, hyper_mix(x, fn, base, scale, cfg), rms_norm(collapse(x, mix), norm_eps, norm_w)


# ---- top-k with the written tie rule ---------------------------------------------------------------------
def topk(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The k best of x [N, v] by value, ties to the lower index, -1 where fewer than k are finite (or above
    -inf): [N, k] int64, in `out` where given."""
    n = x.shape[1]
    if n < k:
        x = F.pad(x, (0, k - n), value=NEG_INF)
    vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
    ids = torch.where(vals[:, :k] != NEG_INF, ids[:, :k], -1)  # (a NaN is kept: its request errs, alone)
    return ids if out is None else out.copy_(ids)


# ---- the paged state: writes and attention ---------------------------------------------------------------
def store_rows(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, trash: int,
               positions: torch.Tensor | None = None, ratio: int = 1) -> None:
    """pool[slots[t]] = values[t] in place, the `trash` row where slots[t] < 0 or, with positions, where the
    token completes no entry of `ratio` tokens (positions[t] % ratio != ratio - 1) (no boolean indexing, no sync)."""
    if positions is not None:
        slots = torch.where(positions % ratio == ratio - 1, slots, -1)
    pool.index_copy_(0, torch.where(slots < 0, trash, slots), values.to(pool.dtype))


def attention_keys(window: torch.Tensor, wslots: torch.Tensor, wok: torch.Tensor, entries: torch.Tensor | None,
                   eslots: torch.Tensor | None, topk: torch.Tensor | None, zero_slot: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [T, W + K, hd], ok [T, W + K] bool): the window's keys window[wslots] (wslots, wok [T, W]), then
    (with topk [T, K], -1 none) the entries it picked, their slots from eslots [T, E]; a pick of -1 reads the
    zero slot, masked."""
    keys, ok = window[wslots], wok  # [T, W, hd]
    if topk is None:
        return keys, ok
    picked = eslots.gather(1, topk.clamp(min=0)).masked_fill(topk < 0, zero_slot)  # [T, K]
    return torch.cat([keys, entries[picked]], 1), torch.cat([ok, topk >= 0], 1)


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
    """`attend` of q [T, H, hd] over the keys each token reads (`attention_keys`), gathered ATTN_TOKENS tokens at
    a time."""
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
    hd = first.shape[1] // 2
    s0, s1 = first[:, hd:], second[:, hd:]
    m = torch.maximum(s0, s1)
    e0, e1 = pointwise(torch.exp, s0 - m), pointwise(torch.exp, s1 - m)
    return (e0 * first[:, :hd] + e1 * second[:, :hd]) / (e0 + e1)


# ---- the indexer -------------------------------------------------------------------------------------------
def index_scores(q: torch.Tensor, w: torch.Tensor, wscale: float, pool: torch.Tensor, slots: torch.Tensor,
                 count: torch.Tensor, width: int, zero_slot: int, cands: torch.Tensor | None, block: int
                 ) -> torch.Tensor:
    """s [T, width]: sum_h (w_h wscale) relu(q_h . k_g) for entry g of each token (its key at pool[slots[:, g]],
    slots [T, E], E <= width); -inf where not visible (g >= count) and, with cands [T, nc] (block ids, -1 none),
    outside the candidate blocks of `block` entries. q [T, nh, ihd], w [T, nh]; width a multiple of KEY_CHUNK
    (each batched-matmul item is one chunk)."""
    t, heads, dim = q.shape
    w = w * wscale
    keys = pool[F.pad(slots, (0, width - slots.shape[1]), value=zero_slot)]  # [T, width, ihd]
    ok = torch.arange(width, device=q.device)[None, :] < count[:, None]
    e = width
    c = e // KEY_CHUNK
    qc = q[:, None].expand(t, c, heads, dim).reshape(t * c, heads, dim)
    dots = torch.bmm(qc, keys.view(t * c, KEY_CHUNK, dim).transpose(1, 2))  # [T*C, nh, CH]
    wc = w[:, None, :, None].expand(t, c, heads, 1).reshape(t * c, heads, 1)
    s = (torch.relu(dots) * wc).transpose(1, 2).contiguous().sum(-1).view(t, e)  # heads summed per entry
    s = s.masked_fill(~ok, NEG_INF)
    if cands is not None:
        nb = width // block
        chosen = torch.zeros(t, nb + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(1, torch.where(cands < 0, nb, cands), True)  # [T, blocks + 1]: the last column is "none"
        s = s.masked_fill(~chosen[:, :nb].repeat_interleave(block, 1), NEG_INF)
    return s


def candidate_blocks(s: torch.Tensor, count: torch.Tensor, block: int, k: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The candidate source's blocks [T, k] (ids, -1 none), in `out` where given: block scores are the max of
    their entries' scores s [T, E] (E a multiple of `block`), the newest visible block (count - 1) // block is
    +inf."""
    t, e = s.shape
    bs = s.view(t, e // block, block).amax(-1)  # [T, B]
    newest = torch.where(count > 0, torch.div(count - 1, block, rounding_mode="floor"), -1)
    bs = bs.masked_fill(torch.arange(bs.shape[1], device=s.device)[None, :] == newest[:, None], float("inf"))
    return topk(bs, k, out)


# ---- MoE -------------------------------------------------------------------------------------------------
def moe_route(z: torch.Tensor, bias: torch.Tensor, k: int, norm: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k] best first by sqrt(softplus(z)) + bias, ties to the lower id; weights [N, k]: the scores,
    renormalised where `norm` and k > 1, times `scale`) for the router's logits z [N, E]."""
    score = torch.sqrt(pointwise(F.softplus, z))
    ids = topk(score + bias, k)
    w = score.gather(1, ids)
    if norm and k > 1:  # (one expert: its raw score, as the peers do)
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scale


def moe_group(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [N k], counts [experts], tok [N k]) for the expert ids [N, k] of the (token, pick) pairs: the pairs
    sorted by expert, in pair order inside an expert, the pairs per expert and each sorted pair's token."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept inside
    counts = torch.bincount(flat, minlength=experts)
    tok = torch.div(order, ids.shape[1], rounding_mode="floor")
    return order, counts, tok


def moe_combine(ys: torch.Tensor, order: torch.Tensor, w: torch.Tensor,
                shared: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """[N, D]: per token 0 + w ys of its pairs, then + shared() [N, D] (the shared expert, computed after the routed
    sum: the order autograd's backward follows); ys [P, D] the expert outputs of the pairs `order` [P] lists,
    w [N, k]."""
    n, k = w.shape
    tok = torch.div(order, k, rounding_mode="floor")
    routed = torch.zeros(n, ys.shape[1], dtype=ys.dtype, device=ys.device).index_add_(
        0, tok, ys * w.reshape(-1)[order][:, None])
    return routed if shared is None else routed + shared()


def swiglu(gu: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) for gu [N, 2 * inter] = (g, u); no clamp when L <= 0."""
    g, u = gu[:, :inter], gu[:, inter:]
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return pointwise(F.silu, g.contiguous()) * u
