"""Varlen paged attention over the KV cache: cost in proportion to the real work, bit-exact per query.

A microbatch builds one `AttentionPlan` (host-side index arithmetic, once per forward) and every
layer reuses it. Layout, and the batch-invariance rules it follows (spec §9):

  * Query tiles. The query at absolute position p of a row sits in tile (row, p // QT), slot p % QT.
    Tiles are aligned to absolute positions, so a query occupies the same slot of a tile of the same
    shape whatever the cut, the chunk size or the batch mates; a slot without a query this step is a
    zero row whose result is dropped.
  * Key chunks. Keys are read in chunks of KC consecutive absolute positions from position 0. Tile
    (row, b) reads chunks 0 .. (b*QT + QT - 1) // KC: a set fixed by the tile alone (the fixed split
    size of the reduction over keys).
  * One (tile, chunk) pair is one fixed-shape problem: per KV head, scores = [QT*g, hd] @ [hd, KC],
    the chunk max, exp, the sum over KC, then [QT*g, KC] @ [KC, hd]. CPU bmm picks its kernel from the
    item shape, so a pair's bits never depend on how many pairs share the call (tested).
  * Chunks combine per tile in chunk order: `index_add_` on CPU adds its sources in index order, so a
    query's result is a fold over its own chunks only, whatever else is in the step.
  * Cost: one pair per (tile, chunk), so sum over rows of q_len * k_len plus at most QT - 1 query slots
    and KC - 1 keys of padding per tile. Rows never pad to the step's longest query or context.
  * Isolation. A pair reads a row's keys only through that row's block table and only at positions
    < min(seq_len, the tile's end); every other key position reads the cache's zero slot (never
    written), so a NaN in another request's slot, or left in a freed block, cannot reach the row.
    Inside a tile, a query's masked keys are its own request's later tokens of the same tile: masked
    scores multiply their values by 0, so a NaN there reaches the tile's earlier queries, which are the
    same request and (block_size a multiple of QT, checked by the runner) the same KV block, whose
    prefix-cache key holds the offending token. A non-finite value is never masked into a finite
    one: the request that holds it errs.

Index sharing (DeepSeek sparse-attention style): a SELECT layer scores every visible key of a query by
the head-mean of q.k, keeps the `topk` best positions (ties: lower position first; -1 when fewer are
visible) and attends only to those; the next layer (REUSE) attends only to the same positions, read
from the microbatch's own `topk_idx` buffer. Attention over a selection is a fixed-shape problem per
query ([g, hd] @ [hd, topk]), so its cost grows with `topk`, not with the context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

QT = 4  # query tile: positions per tile
KC = 64  # key chunk: positions per chunk

NEG_INF = float("-inf")


@dataclass
class AttentionPlan:
    """Index arithmetic of one microbatch's attention, shared by every layer.

    Invariants: `tok_slot[t] == tile(t) * QT + positions[t] % QT` for the `num_real` real tokens;
    pairs are grouped by tile in chunk order; `pair_slots[p, j]` is the cache slot of key position
    `pair_kpos[p, j]` of the pair's row if that position is < seq_len, else the zero slot.
    """

    num_tokens: int  # T, padding tokens included
    num_real: int  # tokens inside a row (padding tokens come after them)
    num_tiles: int
    tok_slot: torch.Tensor  # [T_real] int64 flat tile slot of each real token
    tok_row: torch.Tensor  # [T_real] int64 row of each real token
    pair_tile: torch.Tensor  # [P] int64
    pair_slots: torch.Tensor  # [P, KC] int64 cache slots
    pair_kpos: torch.Tensor  # [P, KC] int64 absolute key positions
    pair_visible: torch.Tensor  # [P, QT, KC] bool: key visible to the tile's query slot (causal, readable)
    block_tables: torch.Tensor  # [R, B] int64
    block_size: int
    zero_slot: int

    @classmethod
    def build(cls, batch, zero_slot: int, read_past: int = 0) -> "AttentionPlan":
        """The plan of a StepBatch (or microbatch slice). `read_past` widens the readable range past
        seq_len; it exists only for the negative control of the isolation tests."""
        qsl = batch.qsl_host
        dev = batch.input_ids.device
        counts = np.diff(qsl)
        num_real = int(qsl[-1]) if len(qsl) else 0
        computed = batch.num_computed.cpu().numpy()  # CPU: a view; CUDA: one small copy
        row = np.repeat(np.arange(len(counts)), counts)  # [T_real]
        pos = computed[row] + np.arange(num_real) - qsl[:-1][row]
        start = np.ones(num_real, dtype=bool)
        start[1:] = (row[1:] != row[:-1]) | (pos[1:] % QT == 0)
        tile = np.cumsum(start) - 1
        tile_row, tile_base = row[start], pos[start] // QT * QT  # [NT]
        nch = (tile_base + QT - 1) // KC + 1  # chunks each tile reads
        pair_tile = np.repeat(np.arange(len(nch)), nch)
        pair_chunk = np.arange(len(pair_tile)) - np.repeat(np.cumsum(nch) - nch, nch)

        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)  # noqa: E731
        pair_tile_t, bs = to(pair_tile), batch.block_size
        prow = to(tile_row)[pair_tile_t]  # [P]
        kpos = to(pair_chunk)[:, None] * KC + torch.arange(KC, device=dev)  # [P, KC]
        tile_end = to(tile_base + QT)[pair_tile_t]  # a tile never reads past its own last position
        readable = kpos < (torch.minimum(batch.seq_lens[prow], tile_end) + read_past)[:, None]
        tables = batch.block_tables
        col = (kpos // bs).clamp(max=tables.shape[1] - 1)
        blk = tables[prow[:, None], col]
        slots = torch.where(readable & (blk >= 0), blk * bs + kpos % bs, torch.full_like(kpos, zero_slot))
        qpos = to(tile_base)[pair_tile_t][:, None] + torch.arange(QT, device=dev)  # [P, QT]
        visible = (kpos[:, None, :] <= qpos[:, :, None]) & readable[:, None, :]
        return cls(batch.num_tokens, num_real, len(nch), to(tile * QT + pos % QT), to(row), pair_tile_t, slots,
                   kpos, visible, tables, bs, zero_slot)


    @classmethod
    def build_static(cls, batch, zero_slot: int, max_seq_len: int) -> "AttentionPlan":
        """The plan of a decode-only microbatch with fixed shapes and no host reads (CUDA graph capture):
        one tile per token, each reading every chunk below max_seq_len (masked past its own length; the
        extra chunks add exact zeros to the fold, so the bits equal `build`'s)."""
        dev, t, r = batch.input_ids.device, batch.num_tokens, batch.num_rows
        tok = torch.arange(t, device=dev)
        row = torch.searchsorted(batch.qsl[1:], tok, right=True).clamp(max=max(r - 1, 0))
        real = tok < batch.qsl[-1]
        nch = -(-max_seq_len // KC)
        pair_tile = tok[:, None].expand(t, nch).reshape(-1)
        kpos = torch.arange(nch, device=dev).repeat(t)[:, None] * KC + torch.arange(KC, device=dev)  # [P, KC]
        prow = row[pair_tile]
        base = (batch.positions // QT * QT)[pair_tile]
        readable = (kpos < torch.minimum(batch.seq_lens[prow], base + QT)[:, None]) & real[pair_tile][:, None]
        tables, bs = batch.block_tables, batch.block_size
        blk = tables[prow[:, None], (kpos // bs).clamp(max=tables.shape[1] - 1)]
        slots = torch.where(readable & (blk >= 0), blk * bs + kpos % bs, torch.full_like(kpos, zero_slot))
        pos = batch.positions
        qpos = base[:, None] + torch.arange(QT, device=dev)
        visible = (kpos[:, None, :] <= qpos[:, :, None]) & readable[:, None, :]
        return cls(t, t, t, tok * QT + pos % QT, row, pair_tile, slots, kpos, visible, tables, bs, zero_slot)


def _softmax_parts(s: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked scores s [..., K] -> (max m, exp(s - m), sum). A row with no visible key gives m = -inf,
    zeros and 0 (never NaN from the mask itself)."""
    s = s.masked_fill(~visible, NEG_INF)
    m = s.amax(-1)
    p = torch.exp(s - m.masked_fill(m == NEG_INF, 0.0)[..., None])
    return m, p, p.sum(-1)


def _tile_queries(plan: AttentionPlan, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[kvh, P, QT*g, hd] contiguous: each pair's tile of queries, per KV head (zero rows where no query)."""
    heads, hd = q.shape[1], q.shape[2]
    g, nt = heads // kv_heads, plan.num_tiles
    qt = q.new_zeros(nt * QT, heads, hd).index_copy_(0, plan.tok_slot, q[:plan.num_real])
    qt = qt.view(nt, QT, kv_heads, g, hd).permute(2, 0, 1, 3, 4).reshape(kv_heads, nt, QT * g, hd)
    return qt.index_select(1, plan.pair_tile)


def _pair_keys(plan: AttentionPlan, cache: torch.Tensor) -> torch.Tensor:
    """[kvh * P, KC, hd] contiguous: each pair's chunk of a head-major pool [kvh, slots, hd]."""
    kvh, hd = cache.shape[0], cache.shape[2]
    return cache.index_select(1, plan.pair_slots.view(-1)).view(kvh * plan.pair_tile.shape[0], KC, hd)


def visibility(plan: AttentionPlan, kv_heads: int, g: int) -> torch.Tensor:
    """[kvh * P, QT*g, KC] bool, the plan's visibility laid out like the scores."""
    p_ = plan.pair_tile.shape[0]
    return plan.pair_visible[None, :, :, None, :].expand(kv_heads, p_, QT, g, KC).reshape(kv_heads * p_, QT * g, KC)


def attend_full(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
    """Causal attention of the plan's queries q [T, heads, hd] over one layer's head-major pools
    k_cache, v_cache [kvh, slots, hd]; `visible` from `visibility`. Returns [T, heads*hd] (0 for padding).

    Every bmm gets its operands in one fixed layout (queries contiguous, keys as a transposed view of
    a contiguous chunk, values contiguous): torch picks its kernel from layout and item shape, never
    from the batch size, so the bits are fixed too."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g, nt, p_ = heads // kvh, plan.num_tiles, plan.pair_tile.shape[0]
    qp = (_tile_queries(plan, q, kvh) * (1.0 / math.sqrt(hd))).view(kvh * p_, QT * g, hd)
    m, p, l = _softmax_parts(torch.bmm(qp, _pair_keys(plan, k_cache).transpose(1, 2)), visible)  # [B, QT*g, KC]
    o = torch.bmm(p, _pair_keys(plan, v_cache)).view(kvh, p_, QT * g, hd)
    m, l = m.view(kvh, p_, QT * g), l.view(kvh, p_, QT * g)
    big = torch.full((kvh, nt, QT * g), NEG_INF, dtype=m.dtype, device=m.device)
    big = big.scatter_reduce_(1, plan.pair_tile[None, :, None].expand_as(m), m, "amax")
    w = torch.exp(m - big.masked_fill(big == NEG_INF, 0.0).index_select(1, plan.pair_tile))  # 0 where m = -inf
    acc = o.new_zeros(kvh, nt, QT * g, hd).index_add_(1, plan.pair_tile, o * w[..., None])  # chunk order per tile
    den = torch.zeros_like(big).index_add_(1, plan.pair_tile, l * w)
    out = torch.where(den[..., None] == 0, 0.0, acc / den[..., None])  # a NaN stays NaN: its request errs
    out = out.view(kvh, nt, QT, g, hd).permute(1, 2, 0, 3, 4).reshape(nt * QT, heads * hd)
    return _to_tokens(plan, out.index_select(0, plan.tok_slot))


def select_keys(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, topk: int) -> torch.Tensor:
    """[T_real, topk] int64: each query's `topk` visible key positions with the highest head-mean q.k,
    best first (ties: lower position first), -1 padded."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g, nt, p_ = heads // kvh, plan.num_tiles, plan.pair_tile.shape[0]
    qp = _tile_queries(plan, q, kvh).view(kvh * p_, QT * g, hd)
    raw = torch.bmm(qp, _pair_keys(plan, k_cache).transpose(1, 2))  # [B, QT*g, KC]
    score = raw.view(kvh, p_, QT, g, KC).permute(1, 2, 0, 3, 4).reshape(p_, QT, heads, KC).sum(2) / heads
    score = score.masked_fill(~plan.pair_visible, NEG_INF)  # [P, QT, KC]
    kk = min(topk, KC)  # a query's best keys are among its chunks' best
    top, order = score.sort(dim=-1, descending=True, stable=True)  # ties: lower position first
    top, order = top[..., :kk].reshape(-1), order[..., :kk]
    cpos = plan.pair_kpos[:, None, :].expand(p_, QT, KC).gather(-1, order).reshape(-1)  # [P*QT*kk]
    qid = (plan.pair_tile[:, None, None] * QT + torch.arange(QT, device=q.device)[None, :, None]).expand(
        p_, QT, kk).reshape(-1)
    # one stable sort by (query, score descending): candidates arrive in position order among equal scores
    bits = (top + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes +0.0, an equal score
    desc = torch.where(bits < 0, bits, (~bits) & 0x7FFFFFFF) & 0xFFFFFFFF  # larger float -> smaller key
    o = torch.argsort(qid * (1 << 32) + desc, stable=True)
    top, cpos, qid = top[o], cpos[o], qid[o]
    start = torch.ones_like(qid, dtype=torch.bool)
    start[1:] = qid[1:] != qid[:-1]
    idx = torch.arange(qid.shape[0], device=q.device)
    rank = idx - torch.cummax(torch.where(start, idx, 0), 0).values
    keep = (rank < topk) & (top > NEG_INF)
    dump = nt * QT * topk  # one extra entry takes the candidates not kept (no boolean indexing: no sync)
    sel = torch.full((dump + 1,), -1, dtype=torch.int64, device=q.device)
    sel.index_copy_(0, torch.where(keep, qid * topk + rank, dump), cpos)
    return sel[:dump].view(nt * QT, topk).index_select(0, plan.tok_slot)


def attend_selected(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    sel: torch.Tensor) -> torch.Tensor:
    """Attention of each real query only to its selected key positions sel [T_real, topk] (-1 = none).
    Returns [T, heads*hd]."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g, n, topk = heads // kvh, plan.num_real, sel.shape[1]
    bs, tables = plan.block_size, plan.block_tables
    blk = tables[plan.tok_row[:, None], (sel.clamp(min=0) // bs).clamp(max=tables.shape[1] - 1)]
    ok = (sel >= 0) & (blk >= 0)  # [T_real, topk]
    slots = torch.where(ok, blk * bs + sel % bs, torch.full_like(sel, plan.zero_slot)).view(-1)
    k = k_cache.index_select(1, slots).view(kvh * n, topk, hd)
    v = v_cache.index_select(1, slots).view(kvh * n, topk, hd)
    qg = (q[:n] * (1.0 / math.sqrt(hd))).view(n, kvh, g, hd).transpose(0, 1).reshape(kvh * n, g, hd)
    _, p, l = _softmax_parts(torch.bmm(qg, k.transpose(1, 2)), ok[None, :, None, :].expand(
        kvh, n, g, topk).reshape(kvh * n, g, topk))
    out = torch.where(l[..., None] == 0, 0.0, torch.bmm(p, v) / l[..., None])  # [kvh*n, g, hd]
    return _to_tokens(plan, out.view(kvh, n, g, hd).transpose(0, 1).reshape(n, heads * hd))


def _to_tokens(plan: AttentionPlan, real: torch.Tensor) -> torch.Tensor:
    """[T_real, D] -> [T, D], zero rows for padding tokens."""
    pad = plan.num_tokens - plan.num_real
    return real if pad == 0 else torch.cat([real, real.new_zeros(pad, real.shape[1])])
