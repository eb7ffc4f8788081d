"""The token-wise steps of the V4.1 forward as one C call each (`_token_kernel.c`): the same functions, with the
same signatures, as model/ops_torch.py (read that one first: the formulas).

A forward takes this module where model/ops.py `choose` says so (the token kernel loaded, float32 CPU tensors
outside autograd), once per forward, never per call. A condition about the data, not fixed per forward (int64
CPU ids for `gather_rows`, a bool `dead` for `engram_gate`, at most 16 parts for `cat_cols`, a weight the linear
kernel takes for `hc_next`), is checked here, and the torch form runs where it fails. The C form computes each
token alone, in an order fixed per token (see the kernel's header): a token's bits do not depend on its batch
mates, the cut or padding, by construction. The two forms compute the same formula, not the same bits.

The C forms copy a non-contiguous input rather than choosing the form by layout, and return new tensors: inputs
are never modified (but by `rope(in_place=True)`, `expand(in_place=True)`, `hc_next(in_place=True)` and
`store_rows`, whose pool is written in place).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import kernels
from . import capture, ops_torch, products
from .layers import linear


def _kernel():
    """The token kernel module (engram_serve/kernels.py); model/ops.py `choose` checked it is loaded."""
    return kernels.get("token")


def gather_rows(src: torch.Tensor, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """[N, copies, width]: row ids[t] of src [rows, width] on each copy (the embedding, the rotary tables);
    ids [N] int64. An id outside [0, rows) raises (ValueError in C, IndexError in torch)."""
    if ids.dtype != torch.int64 or not ids.is_cpu:
        return ops_torch.gather_rows(src, ids, copies)
    src, ids = src.contiguous(), ids.contiguous()
    out = torch.empty(ids.shape[0], copies, src.shape[1])
    capture.call(_kernel().gather_rows, src=src.data_ptr(), rows=src.shape[0], width=src.shape[1], ids=ids.data_ptr(),
                 n=ids.shape[0], copies=copies, out=out.data_ptr())
    return out


def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                dead: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Engram gate of docs/contract.md §7 (engram/layer.py): h [N, hc, hidden] with gate_i * value added to
    branch i, from the projection kv [N, (hc + 1) * hidden]; dead [N] bool tokens get gate 0."""
    n, hc, dim = h.shape
    if dead is not None and dead.dtype != torch.bool:
        return ops_torch.engram_gate(h, kv, q_w, k_w, dead, eps)
    h, kv, q_w, k_w = h.contiguous(), kv.contiguous(), q_w.contiguous(), k_w.contiguous()
    dead = None if dead is None else dead.contiguous()
    out = torch.empty(n, hc, dim)
    capture.call(_kernel().engram_gate, h=h.data_ptr(), n=n, hc=hc, hidden=dim, kv=kv.data_ptr(), q_w=q_w.data_ptr(),
                 k_w=k_w.data_ptr(), dead=0 if dead is None else dead.data_ptr(), eps=eps, h_out=out.data_ptr())
    return out


def cat_cols(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, 1) of [N, w_i] parts: one C copy of at most 16 parts, else torch.cat."""
    if len(parts) > 16:
        return ops_torch.cat_cols(parts)
    parts = [_c(p) for p in parts]
    n, width = parts[0].shape[0], sum(p.shape[1] for p in parts)
    out = torch.empty(n, width)
    args = [a for p in parts for a in (p.data_ptr(), p.shape[1])]
    capture.call(_kernel().concat_cols, out.data_ptr(), n, width, *args)
    return out


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of [n_i, w] parts: one C copy of at most 16 parts (each part a block of one flat row), else
    torch.cat."""
    if len(parts) > 16:
        return ops_torch.cat_rows(parts)
    flat = cat_cols([p.contiguous().view(1, -1) for p in parts])
    return flat.view(-1, parts[0].shape[1])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1) for x [rows, v] (v >= 1): the first index of each row's maximum, a NaN above every
    number. One C pass per row (torch's CPU argmax is a scalar loop, ~2.5 ns a logit)."""
    return argmax_finite(x)[0]


def argmax_finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`argmax_rows(x)`, torch.isfinite(x).all(dim=1)) for x [rows, v] (v >= 1): in the same C pass."""
    if x.dim() != 2 or x.shape[1] == 0:
        return ops_torch.argmax_finite(x)
    x = x.contiguous()
    out, finite = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0], dtype=torch.bool)
    capture.call(_kernel().argmax_rows, x=x.data_ptr(), rows=x.shape[0], v=x.shape[1], out=out.data_ptr(),
                 finite=finite.data_ptr())
    return out, finite


# ---- V4.1's token-wise steps ---------------------------------------------------------------------------
def _c(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def hc_mix(x: torch.Tensor, mm: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float, hc_eps: float,
           iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) of the mHC mix from the streams x [N, hc, D] and their
    product mm = fn . x [N, (2 + hc) hc] (`hyper_mix`)."""
    n, hc, d = x.shape
    x, mm, scale, base = _c(x), _c(mm), _c(scale), _c(base)
    pre, post, comb = torch.empty(n, hc), torch.empty(n, hc), torch.empty(n, hc, hc)
    capture.call(_kernel().hc_mix, x=x.data_ptr(), mm=mm.data_ptr(), n=n, hc=hc, dim=d, scale=scale.data_ptr(),
                 base=base.data_ptr(), eps=eps, hc_eps=hc_eps, iters=iters, pre=pre.data_ptr(), post=post.data_ptr(),
                 comb=comb.data_ptr())
    return pre, post, comb


def hyper_mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) of one sublayer from its streams x [N, hc, D] (`hc_mix` of
    the product by the sublayer's fn)."""
    mm = linear(x.reshape(x.shape[0], -1), fn)  # [N, (2+hc)*hc]
    return hc_mix(x, mm, scale, base, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)


def hc_next(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, mix: torch.Tensor,
            fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor, norm_eps: float, cfg,
            in_place: bool = False):
    """Between two sublayers: the streams x' = expand(o, x, post, comb), the next sublayer's mix of them
    (`hyper_mix` with fn, base, scale) and its input rms_norm(collapse(x', mix)): (x', (pre, post, comb), input).
    One C call over tiles of tokens (`hc_next_packed`) where the linear kernel takes fn (the same bits as the
    calls below), else those calls. `in_place`: x' is written over x (the caller reads x no more)."""
    p = products.plan(fn)  # (fn's product as `linear` computes it: none of the kernel's with the rules off)
    if p.kernel_weight is not None:
        return hc_next_packed(o, x, post, comb, mix, p.kernel_weight, p.kc or 1, scale, base, cfg.rms_norm_eps,
                              cfg.hc_eps, cfg.hc_sinkhorn_iters, norm_w, norm_eps, p.is_tiles, in_place)
    x = expand(o, x, post, comb, in_place)
    return x, hyper_mix(x, fn, base, scale, cfg), rms_norm(collapse(x, mix), norm_eps, norm_w)


def hc_next_packed(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, mix: torch.Tensor,
                   panels: torch.Tensor, kc: int, scale: torch.Tensor, base: torch.Tensor, eps: float, hc_eps: float,
                   iters: int, norm_w: torch.Tensor, norm_eps: float, tiles: bool = False, in_place: bool = False):
    """(x' = expand(o, x, post, comb), hc_mix(x', x' . fn) as (pre, post, comb), rms_norm(collapse(x', mix))) in one
    call, tile by tile (the kernel's header); fn's product through the linear kernel (loaded: the caller checked)
    over its packed panels at block size kc, or over its bfloat16 tiles (`tiles`: exactness.pack_bf16) by
    `linear_bf16`. `in_place`: x' is written over x (the caller reads x no more)."""
    n, hc, d = x.shape
    o, x, post, comb, mix, scale, base, norm_w = (_c(t) for t in (o, x, post, comb, mix, scale, base, norm_w))
    out = x if in_place else torch.empty(n, hc, d)
    pre, post2, comb2, h = torch.empty(n, hc), torch.empty(n, hc), torch.empty(n, hc, hc), torch.empty(n, d)
    tile = min(n, _kernel().HC_TILE)
    mm, y = torch.empty(tile, (2 + hc) * hc), torch.empty(tile, d)  # scratch
    capture.call(_kernel().hc_next, o=o.data_ptr(), x=x.data_ptr(), post=post.data_ptr(), comb=comb.data_ptr(),
                 mix=mix.data_ptr(), n=n, hc=hc, dim=d, matmul=_matmul_entry(kernels.get("linear"), tiles),
                 panels=panels.data_ptr(), kc=kc, scale=scale.data_ptr(), base=base.data_ptr(), eps=eps, hc_eps=hc_eps,
                 iters=iters, norm_w=norm_w.data_ptr(), norm_eps=norm_eps, out=out.data_ptr(), pre=pre.data_ptr(),
                 post2=post2.data_ptr(), comb2=comb2.data_ptr(), h=h.data_ptr(), mm=mm.data_ptr(), y=y.data_ptr())
    return out, (pre, post2, comb2), h


@functools.cache
def _matmul_entry(linear_kernel, tiles: bool) -> int:
    """The address of the linear kernel's raw `linear_packed` entry, or `linear_bf16`'s (whose seven slots are the
    first seven of linear_packed's): what hc_next calls per tile."""
    return kernels.RawKernel(*linear_kernel.raw_kernels()["linear_bf16" if tiles else "linear_packed"]).entry


def collapse(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """[N, D] = sum_i mix[:, i] x[:, i] for x [N, hc, D], mix [N, hc], streams added in order."""
    n, hc, d = x.shape
    x, mix = _c(x), _c(mix)
    out = torch.empty(n, d)
    capture.call(_kernel().collapse, x=x.data_ptr(), mix=mix.data_ptr(), n=n, hc=hc, dim=d, out=out.data_ptr())
    return out


def stream_mean(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, D]: the mean of the streams x [N, hc, D], added in stream order, then divided by hc; into `out` (rows of
    unit stride, e.g. columns of a wider buffer) if given."""
    n, hc, d = x.shape
    x = _c(x)
    out = torch.empty(n, d) if out is None else out
    if out.shape != (n, d) or out.dtype != torch.float32 or (d > 1 and out.stride(1) != 1):
        raise ValueError(f"stream_mean: out {tuple(out.shape)} {out.dtype} strides {out.stride()}, want ({n}, {d}) "
                         f"float32 with unit column stride")
    capture.call(_kernel().stream_mean, x=x.data_ptr(), n=n, hc=hc, dim=d, out=out.data_ptr(), ldo=out.stride(0))
    return out


def expand(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, in_place: bool = False
           ) -> torch.Tensor:
    """[N, hc, D]: stream b = post[:, b] o + sum_a comb[:, a, b] x[:, a], added left to right; `in_place`: written
    over x (the caller reads x no more)."""
    n, hc, d = x.shape
    o, x, post, comb = _c(o), _c(x), _c(post), _c(comb)
    out = x if in_place else torch.empty(n, hc, d)
    capture.call(_kernel().expand, o=o.data_ptr(), x=x.data_ptr(), post=post.data_ptr(), comb=comb.data_ptr(), n=n,
                 hc=hc, dim=d, out=out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim, x [..., dim]."""
    x = _c(x)
    w = None if weight is None else _c(weight)
    out = torch.empty(x.shape)
    capture.call(_kernel().rms_norm, x=x.data_ptr(), rows=x.numel() // max(x.shape[-1], 1), dim=x.shape[-1],
                 w=0 if w is None else w.data_ptr(), eps=eps, out=out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, in_place: bool = False) -> torch.Tensor:
    """Interleaved RoPE of the last 2 * cos.shape[-1] dims of x [N, ..., width]; cos, sin [N, rd / 2]. `in_place`:
    into x (a contiguous x; else into its copy)."""
    x, cos, sin = _c(x), _c(cos), _c(sin)
    n, width = x.shape[0], x.shape[-1]
    out = x if in_place else torch.empty(x.shape)
    capture.call(_kernel().rope, x=x.data_ptr(), n=n, m=x.numel() // max(n * width, 1), width=width,
                 cos=cos.data_ptr(), sin=sin.data_ptr(), half=cos.shape[-1], inverse=inverse, out=out.data_ptr())
    return out


def plan_window(positions: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, block_size: int, zero: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(window slots [T, W], window_ok [T, W] bool, the partner's slot [T]) of tokens at positions [T] in rows [T]
    of tables [R, B] (model/paged_state.py SlotPlan: slot_of, the zero slot where unreadable)."""
    positions, rows, tables = _c(positions), _c(rows), _c(tables)
    n = positions.shape[0]
    win, ok, prev = (torch.empty(n, window, dtype=torch.int64), torch.empty(n, window, dtype=torch.bool),
                     torch.empty(n, dtype=torch.int64))
    capture.call(_kernel().plan_window, positions=positions.data_ptr(), rows=rows.data_ptr(), tables=tables.data_ptr(),
                 n=n, tr=tables.shape[0], tb=tables.shape[1], bs=block_size, zero=zero, window=window,
                 win=win.data_ptr(), win_ok=ok.data_ptr(), prev=prev.data_ptr())
    return win, ok, prev


def plan_entries(positions: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, block_size: int, zero: int,
                 ratio: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [T] = (p + 1) // ratio, entry slots [T, width]: entry g's slot (position g ratio + ratio - 1) for
    g < count, the zero slot beyond) (model/paged_state.py SlotPlan)."""
    positions, rows, tables = _c(positions), _c(rows), _c(tables)
    n = positions.shape[0]
    count, eslots = torch.empty(n, dtype=torch.int64), torch.empty(n, width, dtype=torch.int64)
    capture.call(_kernel().plan_entries, positions=positions.data_ptr(), rows=rows.data_ptr(),
                 tables=tables.data_ptr(), n=n, tr=tables.shape[0], tb=tables.shape[1], bs=block_size, zero=zero,
                 ratio=ratio, width=width, count=count.data_ptr(), eslots=eslots.data_ptr())
    return count, eslots


def store_rows(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, trash: int,
               positions: torch.Tensor | None = None, ratio: int = 1) -> None:
    """pool[slots[t]] = values[t] in place, the `trash` row where slots[t] < 0 or, with positions, where the
    token completes no entry of `ratio` tokens (positions[t] % ratio != ratio - 1). pool [rows, width]
    contiguous (written in place: a copy would lose the writes), values [T, width]."""
    if not pool.is_contiguous():
        raise ValueError(f"store_rows: the pool {tuple(pool.shape)} must be contiguous (it is written in place)")
    slots, values = _c(slots), _c(values)
    positions = None if positions is None else _c(positions)
    capture.call(_kernel().store_rows, pool=pool.data_ptr(), rows=pool.shape[0], width=pool.shape[1],
                 slots=slots.data_ptr(), n=slots.shape[0], values=values.data_ptr(), trash=trash,
                 positions=0 if positions is None else positions.data_ptr(), ratio=ratio)


def attend_paged(q: torch.Tensor, window: torch.Tensor, wslots: torch.Tensor, wok: torch.Tensor,
                 entries: torch.Tensor | None, eslots: torch.Tensor | None, topk: torch.Tensor | None, zero_slot: int,
                 sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with a sink logit, key = value, of q [T, H, hd] over the keys each token reads, in place
    in their pools: window[wslots] with wok [T, W], then with topk [T, K] the picked entries entries[eslots[t, topk]]
    (a pick of -1 is masked); keys without ok are never read (nor the zero slot) -> [T, H, hd]."""
    t, h, hd = q.shape
    w = wslots.shape[1]
    q, window, wslots, wok, sink = _c(q), _c(window), _c(wslots), _c(wok), _c(sink)
    k = 0 if topk is None else topk.shape[1]
    if k:
        entries, eslots, topk = _c(entries), _c(eslots), _c(topk)
    out = torch.empty(t, h, hd)
    capture.call(_kernel().attend_paged, q=q.data_ptr(), window=window.data_ptr(), wslots=wslots.data_ptr(),
                 wok=wok.data_ptr(), n=t, w=w, entries=entries.data_ptr() if k else 0,
                 eslots=eslots.data_ptr() if k else 0, es=eslots.shape[1] if k else 0,
                 topk=topk.data_ptr() if k else 0, k=k, rows=window.shape[0], hd=hd, sink=sink.data_ptr(), h=h,
                 scale=scale, out=out.data_ptr())
    return out


def pool_pair(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """A ratio-2 entry [T, hd] from its two tokens' [kv, gate] rows [T, 2hd]."""
    first, second = _c(first), _c(second)
    n, hd = first.shape[0], first.shape[1] // 2
    out = torch.empty(n, hd)
    capture.call(_kernel().pool_pair, first=first.data_ptr(), second=second.data_ptr(), n=n, hd=hd, out=out.data_ptr())
    return out


def topk(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, k] int64: the k best of each row of x [N, v], higher first, a NaN above every number, ties to the
    lower index, -1 for a pick that is -inf or beyond v; written into `out` (a contiguous [N, k] int64) where given."""
    x = _c(x)
    ids = _ids_out(out, x.shape[0], k)
    capture.call(_kernel().topk_rows, x=x.data_ptr(), rows=x.shape[0], v=x.shape[1], k=k, out=ids.data_ptr())
    return ids


def index_scores(q: torch.Tensor, w: torch.Tensor, wscale: float, pool: torch.Tensor, slots: torch.Tensor,
                 count: torch.Tensor, width: int, zero_slot: int, cands: torch.Tensor | None, block: int
                 ) -> torch.Tensor:
    """s [N, width]: the indexer's score of entry g, sum_h (w_h wscale) relu(q_h . pool[slots[:, g]]), for
    g < count and (with cands [N, nc], block ids) inside a candidate block of `block` entries; -inf
    elsewhere (no key read, nor the zero slot). q [N, nh, ihd], w [N, nh], slots [N, E] int64, count [N] int64."""
    n, nh, ihd = q.shape
    q, w, pool, slots, count = _c(q), _c(w), _c(pool), _c(slots), _c(count)
    cands = None if cands is None else _c(cands)
    out = torch.empty(n, width)
    capture.call(_kernel().index_scores, q=q.data_ptr(), w=w.data_ptr(), wscale=wscale, pool=pool.data_ptr(),
                 slots=slots.data_ptr(), count=count.data_ptr(), n=n, es=slots.shape[1], e=width, nh=nh, ihd=ihd,
                 cands=0 if cands is None else cands.data_ptr(), nc=0 if cands is None else cands.shape[1],
                 block=block, out=out.data_ptr())
    return out


def _ids_out(out: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """Where a kernel writes [n, k] int64 ids: a new tensor, or the caller's buffer `out`, which must be that."""
    if out is None:
        return torch.empty(n, k, dtype=torch.int64)
    if not out.is_contiguous() or out.dtype != torch.int64 or tuple(out.shape) != (n, k):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: must be a contiguous [{n}, {k}] int64 buffer")
    return out


def candidate_blocks(s: torch.Tensor, count: torch.Tensor, block: int, k: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, k] block ids (-1 none): blocks of `block` entries of s [N, E] scored by their max, the newest visible
    block (count - 1) // block +inf, then `topk`; written into `out` (a contiguous [N, k] int64) where given."""
    s, count = _c(s), _c(count)
    ids = _ids_out(out, s.shape[0], k)
    capture.call(_kernel().candidate_blocks, s=s.data_ptr(), count=count.data_ptr(), n=s.shape[0], e=s.shape[1],
                 block=block, k=k, out=ids.data_ptr())
    return ids


def moe_route(z: torch.Tensor, bias: torch.Tensor, k: int, norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k] best first by sqrt(softplus(z)) + bias, ties to the lower id; weights [N, k]) for the router's
    logits z [N, E]."""
    z, bias = _c(z), _c(bias)
    n, e = z.shape
    ids, w = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    capture.call(_kernel().moe_route, z=z.data_ptr(), bias=bias.data_ptr(), n=n, e=e, k=k, norm=norm, scale=scale,
                 ids=ids.data_ptr(), w=w.data_ptr())
    return ids, w


def moe_group(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [N k], counts [experts], tok [N k]) for the expert ids [N, k] of the (token, pick) pairs: the pairs
    (flat index t k + j) sorted by expert, in pair order inside an expert (torch.argsort(stable=True)), the
    pairs per expert (torch.bincount) and each sorted pair's token (order // k)."""
    n, k = ids.shape
    ids = _c(ids)
    order, counts, tok = (torch.empty(n * k, dtype=torch.int64), torch.empty(experts, dtype=torch.int64),
                          torch.empty(n * k, dtype=torch.int64))
    capture.call(_kernel().moe_group, ids=ids.data_ptr(), pairs=n * k, e=experts, k=k, order=order.data_ptr(),
                 counts=counts.data_ptr(), tok=tok.data_ptr())
    return order, counts, tok


def moe_combine(ys: torch.Tensor, order: torch.Tensor, w: torch.Tensor,
                shared: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """[N, D]: per token 0 + w ys of its pairs (in `order`: ascending expert), then + shared() [N, D] (the shared
    expert); ys [P, D] the expert outputs of the pairs `order` [P] lists, w [N, k]."""
    n, k = w.shape
    ys, order, w = _c(ys), _c(order), _c(w)
    shared = None if shared is None else _c(shared())
    out = torch.empty(n, ys.shape[1])
    capture.call(_kernel().moe_combine, ys=ys.data_ptr(), order=order.data_ptr(), w=w.data_ptr(), pairs=order.shape[0],
                 n=n, k=k, dim=ys.shape[1], shared=0 if shared is None else shared.data_ptr(), out=out.data_ptr())
    return out


def swiglu(gu: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) for gu [N, 2 inter] = (g, u); no clamp when L <= 0."""
    gu = _c(gu)
    out = torch.empty(gu.shape[0], inter)
    capture.call(_kernel().swiglu, gu=gu.data_ptr(), n=gu.shape[0], inter=inter, limit=limit, out=out.data_ptr())
    return out
