"""The attention kernels over the paged KV cache (model/attention.py `PagedAttention` calls them): cost
in proportion to the real work, bit-exact per query.

On a float32 CPU the C kernel runs (`attend_native`, `rotate_store`: the attention kernel of
engram_serve/kernels.py, one query at a time over its own keys 0..p, so it has no shape rule to keep).
Elsewhere (CUDA, the kernel not loaded, a selecting layer under tensor parallelism) the torch kernels
below run. For them a microbatch builds one `AttentionPlan` (host-side index arithmetic, once per
forward) and every layer reuses it. Layout, and the batch-invariance rules it follows (docs/contract.md §9):

  * Pairs. Keys are read in chunks of KC consecutive absolute positions from position 0 (the fixed
    split size of the reduction over keys). A row with queries at positions a..b in this step makes
    one pair per chunk 0 .. b // KC; a pair holds the row's queries (padded with empty slots to the
    group width) and the chunk's KC keys, each key gathered once. Cost: sum over rows of
    q_len * k_len, plus at most KC - 1 keys and a doubling of query slots of padding per row.
    Rows never pad to the step's longest query or context.
  * Groups. Pairs are grouped by width (the row's query count rounded up to a power of two, at
    least `attention_min_rows` / g), one bmm per group, an item per (KV head, pair): scores =
    [W*g, hd] @ [hd, KC], the chunk max, exp, the sum over KC, then [W*g, KC] @ [KC, hd]. CPU bmm
    gives a row the same bits whatever the number of items and the row's place, and whatever the
    rows' count from a threshold on (measured per CPU: 2 on an AVX-512 Xeon); every call hands it
    one fixed layout (queries contiguous, keys and values contiguous per item, straight from the
    head-major KV pool), so a query's per-chunk bits are fixed.
  * Chunks combine per query in chunk order: `index_add_` on CPU adds its sources in index order,
    so a query's result is a fold over its own chunks only, whatever else is in the step.
  * Isolation. A pair reads its row's keys only through the row's block table and only at positions
    < seq_len; every other key position reads the cache's zero slot (never written), so a NaN in
    another request's slot, or left in a freed block, cannot reach the row. A pair also holds keys
    written in this step that are later than some of its queries: masked scores multiply their
    values by 0, so a non-finite value among them is zeroed first (`where`, not a product), and a
    query that may see such a key is set to NaN explicitly. A non-finite value is never masked into
    a finite one: the request that holds it errs, and nothing else does.

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

from .. import kernels
from . import capture
from .exactness import MIN_ROWS, bmm_min_rows

KC = 64  # key chunk: positions per chunk
NEG_INF = float("-inf")


def attention_min_rows(kv) -> int:
    """Rows (queries x heads per KV head) a pair's bmm calls need for a row's bits not to depend on them:
    the scores [rows, hd] @ [hd, KC] (keys transposed) and the values [rows, KC] @ [KC, hd], measured on
    this CPU (model/exactness.py); MIN_ROWS off the CPU."""
    if kv.device.type != "cpu":
        return MIN_ROWS
    return max(bmm_min_rows(kv.head_dim, KC, True, kv.dtype), bmm_min_rows(KC, kv.head_dim, False, kv.dtype))


@dataclass
class Group:
    """Pairs whose rows hold at most `width` queries this step. Invariants: `slots[p, j]` is the cache
    slot of key position `kpos[p, j]` of the pair's row if that position is < seq_len, else the zero
    slot; `query[p, i]` is the token of the row's i-th query this step, or T (no query)."""

    width: int
    multi: bool  # some row holds more than one query (so some query has masked keys of this step)
    slots: torch.Tensor  # [P, KC] int64
    kpos: torch.Tensor  # [P, KC] int64 absolute key positions
    fresh_tok: torch.Tensor  # [P, KC] int64: the token of this step that wrote the key, else T
    query: torch.Tensor  # [P, W] int64
    visible: torch.Tensor  # [P, W, KC] bool: causal and readable


@dataclass
class AttentionPlan:
    num_tokens: int  # T, padding tokens included
    groups: list[Group]  # rows' pairs in chunk order inside each group
    tok_row: torch.Tensor  # [T] int64 row of each token (padding tokens: any row; they select nothing)
    block_tables: torch.Tensor  # [R, B] int64
    block_size: int
    zero_slot: int

    @classmethod
    def build(cls, batch, zero_slot: int, min_width: int) -> "AttentionPlan":
        """The plan of a StepBatch (or microbatch slice)."""
        qsl, t = batch.qsl_host, batch.num_tokens
        dev = batch.input_ids.device
        counts = np.diff(qsl)
        computed = batch.num_computed.cpu().numpy()  # CPU: a view; CUDA: one small copy
        live = counts > 0
        width = np.maximum(1 << np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64), min_width)
        nch = (computed + counts - 1) // KC + 1
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)  # noqa: E731
        groups = []
        for w in np.unique(width[live]):  # a few powers of two: not a loop per row
            rows = np.flatnonzero(live & (width == w))
            pr = np.repeat(rows, nch[rows])
            pc = np.arange(len(pr)) - np.repeat(np.cumsum(nch[rows]) - nch[rows], nch[rows])
            j = np.arange(w)
            query = np.where(j < counts[pr][:, None], qsl[pr][:, None] + j, t)
            groups.append(cls._group(batch, int(w), bool(counts[rows].max() > 1), to(pr), to(pc), to(query),
                                     to(computed[pr][:, None] + j), zero_slot))
        row = np.repeat(np.arange(len(counts)), counts)
        row = np.concatenate([row, np.zeros(t - len(row), dtype=np.int64)])
        return cls(t, groups, to(row), batch.block_tables, batch.block_size, zero_slot)

    @classmethod
    def build_static(cls, batch, zero_slot: int, min_width: int, max_seq_len: int) -> "AttentionPlan":
        """The plan of a decode-only microbatch with fixed shapes and no host reads (CUDA graph capture):
        one row per token, each reading every chunk below max_seq_len (masked past its own length; the
        extra chunks add exact zeros to the fold, so the bits equal `build`'s)."""
        dev, t, r = batch.input_ids.device, batch.num_tokens, batch.num_rows
        tok = torch.arange(t, device=dev)
        row = torch.searchsorted(batch.qsl[1:], tok, right=True).clamp(max=max(r - 1, 0))
        nch = -(-max_seq_len // KC)
        ptok = tok[:, None].expand(t, nch).reshape(-1)
        pc = torch.arange(nch, device=dev).repeat(t)
        j = torch.arange(min_width, device=dev)
        real = (ptok < batch.qsl[-1])[:, None]
        query = torch.where((j == 0) & real, ptok[:, None], t)
        group = cls._group(batch, min_width, False, row[ptok], pc, query, batch.positions[ptok][:, None] + j,
                           zero_slot)
        return cls(t, [group], row, batch.block_tables, batch.block_size, zero_slot)

    @staticmethod
    def readable(kpos: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """bool [P, KC]: the key positions kpos [P, KC] a pair may read, those below its row's seq_len
        seq [P, 1] (a protection: a test subclass widens it, the negative control of the isolation tests)."""
        return kpos < seq

    @classmethod
    def _group(cls, batch, width: int, multi: bool, prow, pchunk, query, qpos, zero_slot: int) -> Group:
        """One group from its pairs' rows [P], chunks [P], query tokens [P, W] and query positions [P, W]."""
        kpos = pchunk[:, None] * KC + torch.arange(KC, device=prow.device)  # [P, KC]
        seq = batch.seq_lens[prow][:, None]
        readable = cls.readable(kpos, seq)
        tables, bs = batch.block_tables, batch.block_size
        blk = tables[prow[:, None], (kpos // bs).clamp(max=tables.shape[1] - 1)]
        slots = torch.where(readable & (blk >= 0), blk * bs + kpos % bs, torch.full_like(kpos, zero_slot))
        first = batch.num_computed[prow][:, None]
        fresh = (kpos >= first) & (kpos < seq)  # written by this microbatch: the row's tokens from qsl[row]
        fresh_tok = torch.where(fresh, batch.qsl[prow][:, None] + kpos - first, batch.num_tokens)
        visible = (kpos[:, None, :] <= qpos[:, :, None]) & readable[:, None, :] & (query < batch.num_tokens)[:, :, None]
        return Group(width, multi, slots, kpos, fresh_tok, query, visible)


def _softmax_parts(s: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked scores s [..., K] -> (max m, exp(s - m), sum). A row with no visible key gives m = -inf,
    zeros and 0 (never NaN from the mask itself)."""
    s = s.masked_fill(~visible, NEG_INF)
    m = s.amax(-1)
    p = torch.exp(s - m.masked_fill(m == NEG_INF, 0.0)[..., None])
    return m, p, p.sum(-1)


def _head_batched_queries(grp: Group, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[kvh * P, W * g, hd]: each (KV head, pair)'s queries, one bmm item each (zero rows for empty slots)."""
    t, heads, hd = q.shape
    p_, w = grp.query.shape
    qz = torch.cat([q, q.new_zeros(1, heads, hd)]).index_select(0, grp.query.view(-1))  # [P*W, heads, hd]
    return qz.view(p_, w, kv_heads, heads // kv_heads, hd).permute(2, 0, 1, 3, 4).reshape(kv_heads * p_, -1, hd)


def _head_batched(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[kvh * P, K, hd]: the keys or values at slots [P, K] of a pool [kvh, slots, hd], one bmm item per
    (KV head, pair), in one contiguous layout straight from the gather."""
    kvh, _, hd = cache.shape
    return cache.index_select(1, slots.view(-1)).view(kvh * slots.shape[0], slots.shape[1], hd)


def _per_query(x: torch.Tensor, p_: int, kvh: int, w: int) -> torch.Tensor:
    """[kvh * P, W * g, ...] (a result per bmm item row) -> [P * W, heads, ...] (per query slot)."""
    x = x.view(kvh, p_, w, -1, *x.shape[2:]).permute(1, 2, 0, 3, *range(4, x.dim() + 2))
    return x.reshape(p_ * w, -1, *x.shape[4:])


def attend_full(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                v_new: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of q [T, heads, hd] over one layer's pools k_cache, v_cache [kvh, slots, hd];
    v_new [T, kvh, hd] are this step's values, checked for non-finite ones only where a row holds
    several queries (None skips the guard: the negative control of the isolation tests).
    Returns [T, heads*hd] (0 for padding tokens)."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g = heads // kvh
    if not plan.groups:  # padding only
        return q.new_zeros(t, heads * hd)
    guarded = [grp.multi and v_new is not None for grp in plan.groups]
    if any(guarded):  # [T + 1] this step's tokens whose new value is not finite (the extra entry: none)
        bad_tok = torch.cat([~torch.isfinite(v_new).view(t, -1).all(-1), v_new.new_zeros(1, dtype=torch.bool)])
    toks, ms, ls, os_, flags = [], [], [], [], []
    qs = q * (1.0 / math.sqrt(hd))
    for grp, guard in zip(plan.groups, guarded):
        p_, w = grp.query.shape
        k, v = _head_batched(k_cache, grp.slots), _head_batched(v_cache, grp.slots)  # [kvh*P, KC, hd]
        if guard:  # a non-finite key of this step, masked for the row's earlier queries: never 0 * NaN
            bad = bad_tok[grp.fresh_tok]  # [P, KC]
            v = v.view(kvh, p_, KC, hd).masked_fill(bad[None, :, :, None], 0.0).view(kvh * p_, KC, hd)
            flags.append((grp.visible & bad[:, None, :]).any(-1).view(-1))
        qg = _head_batched_queries(grp, qs, kvh)  # [kvh*P, W*g, hd]
        vis = grp.visible[None, :, :, None, :].expand(kvh, p_, w, g, KC).reshape(kvh * p_, w * g, KC)
        m, pr, l = _softmax_parts(torch.bmm(qg, k.transpose(1, 2)), vis)
        toks.append(grp.query.view(-1))
        ms.append(_per_query(m, p_, kvh, w))  # [P*W, heads]
        ls.append(_per_query(l, p_, kvh, w))
        os_.append(_per_query(torch.bmm(pr, v), p_, kvh, w))  # [P*W, heads, hd]
    tok, m, l, o = torch.cat(toks), torch.cat(ms), torch.cat(ls), torch.cat(os_)
    big = torch.full((t + 1, heads), NEG_INF, dtype=m.dtype, device=m.device)
    big = big.scatter_reduce_(0, tok[:, None].expand_as(m), m, "amax")
    wgt = torch.exp(m - big.masked_fill(big == NEG_INF, 0.0).index_select(0, tok))  # 0 where m = -inf
    acc = o.new_zeros(t + 1, heads, hd).index_add_(0, tok, o * wgt[..., None])  # chunk order per query
    den = torch.zeros_like(big).index_add_(0, tok, l * wgt)
    out = torch.where(den[..., None] == 0, 0.0, acc / den[..., None])  # a NaN stays NaN: its request errs
    if flags:  # a query that may see such a key gets NaN itself
        ftok = torch.cat([grp.query.view(-1) for grp, guard in zip(plan.groups, guarded) if guard])
        flagged = torch.zeros(t + 1, dtype=o.dtype, device=o.device).index_add_(0, ftok, torch.cat(flags).to(o.dtype))
        out = torch.where(flagged[:, None, None] > 0, float("nan"), out)
    return out[:t].reshape(t, heads * hd)


def select_keys(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, topk: int,
                head_mean=None) -> torch.Tensor:
    """[T, topk] int64: each query's `topk` visible key positions with the highest head-mean q.k,
    best first (ties: lower position first), -1 padded (all -1 for padding tokens). `head_mean`
    (tensor parallel): turns this rank's sum over its own heads into the mean over every rank's heads
    (an elementwise cross-rank sum, one per group: the plan is the same on every rank)."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g = heads // kvh
    kk = min(topk, KC)  # a query's best keys are among its chunks' best
    if not plan.groups:  # padding only
        return torch.full((t, topk), -1, dtype=torch.int64, device=q.device)
    tops, poss, qids = [], [], []
    for grp in plan.groups:
        p_, w = grp.query.shape
        raw = torch.bmm(_head_batched_queries(grp, q, kvh), _head_batched(k_cache, grp.slots).transpose(1, 2))
        score = _per_query(raw, p_, kvh, w).view(p_, w, heads, KC).sum(2)  # heads summed in head order
        score = score / heads if head_mean is None else head_mean(score)
        score = score.masked_fill(~grp.visible, NEG_INF)  # [P, W, KC]
        top, order = score.sort(dim=-1, descending=True, stable=True)  # ties: lower position first
        tops.append(top[..., :kk].reshape(-1))
        poss.append(grp.kpos[:, None, :].expand(p_, w, KC).gather(-1, order[..., :kk]).reshape(-1))
        qids.append(grp.query[:, :, None].expand(p_, w, kk).reshape(-1))
    top, cpos, qid = torch.cat(tops), torch.cat(poss), torch.cat(qids)
    # one stable sort by (query, score descending): candidates arrive in position order among equal scores
    bits = (top + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes +0.0, an equal score
    desc = torch.where(bits < 0, bits, (~bits) & 0x7FFFFFFF) & 0xFFFFFFFF  # larger float -> smaller key
    o = torch.argsort(qid * (1 << 32) + desc, stable=True)
    top, cpos, qid = top[o], cpos[o], qid[o]
    start = torch.ones_like(qid, dtype=torch.bool)
    start[1:] = qid[1:] != qid[:-1]
    idx = torch.arange(qid.shape[0], device=q.device)
    rank = idx - torch.cummax(torch.where(start, idx, 0), 0).values
    keep = (rank < topk) & (top > NEG_INF) & (qid < t)
    dump = t * topk  # one extra entry takes the candidates not kept (no boolean indexing: no sync)
    sel = torch.full((dump + 1,), -1, dtype=torch.int64, device=q.device)
    sel.index_copy_(0, torch.where(keep, qid * topk + rank, dump), cpos)
    return sel[:dump].view(t, topk)


def attend_selected(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    sel: torch.Tensor) -> torch.Tensor:
    """Attention of each query only to its selected key positions sel [T, topk] (-1 = none), over one
    layer's pools [kvh, slots, hd]. Returns [T, heads*hd]."""
    t, heads, hd = q.shape
    kvh, topk = k_cache.shape[0], sel.shape[1]
    g = heads // kvh
    bs, tables = plan.block_size, plan.block_tables
    blk = tables[plan.tok_row[:, None], (sel.clamp(min=0) // bs).clamp(max=tables.shape[1] - 1)]
    ok = (sel >= 0) & (blk >= 0)  # [T, topk]
    slots = torch.where(ok, blk * bs + sel % bs, torch.full_like(sel, plan.zero_slot))
    k, v = _head_batched(k_cache, slots), _head_batched(v_cache, slots)  # [kvh*T, topk, hd]
    qg = (q * (1.0 / math.sqrt(hd))).view(t, kvh, g, hd).transpose(0, 1).reshape(kvh * t, g, hd)
    vis = ok[None, :, None, :].expand(kvh, t, g, topk).reshape(kvh * t, g, topk)
    _, p, l = _softmax_parts(torch.bmm(qg, k.transpose(1, 2)), vis)
    out = torch.where(l[..., None] == 0, 0.0, torch.bmm(p, v) / l[..., None])  # [kvh*T, g, hd]
    return out.view(kvh, t, g, hd).transpose(0, 1).reshape(t, heads * hd)


NATIVE_MODES = {"full": 0, "select": 1, "reuse": 2}


def native_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `attend_native` can run: the attention kernel loaded (engram_serve/kernels.py), and float32
    CPU tensors."""
    return (kernels.loaded("attention") and q.device.type == "cpu" and k_cache.device.type == "cpu"
            and q.dtype == torch.float32 and k_cache.dtype == torch.float32)


def rotate_store(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, num_slots: int) -> None:
    """Through the C kernel: rotary (model/layers.py apply_rotary's arithmetic, the same bits) on the q and
    k heads of qkv [T, heads + 2 kvh, hd] in place, then each token's k and v stored at its slot of one
    layer's pools [kvh, slots, hd] (slot -1: nowhere). qkv contiguous, cos/sin [T, 1, hd] contiguous."""
    t, width, hd = qkv.shape
    kvh = (width - heads) // 2
    slots = slot_mapping.contiguous()
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == (t, 1, hd) and sin.shape == cos.shape) \
            or slots.dtype != torch.int64 or slots.shape != (t,) or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or k_cache.shape != (kvh, k_cache.shape[1], hd):
        raise ValueError(f"rotate_store: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, slots {tuple(slots.shape)} "
                         f"{slots.dtype}, pools {tuple(k_cache.shape)}: layouts the kernel cannot read")
    capture.call(kernels.get("attention").rotate_store, qkv.data_ptr(), t, heads, kvh, hd, cos.data_ptr(), sin.data_ptr(),
                 slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), num_slots)


def attend_native(batch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, zero_slot: int, num_slots: int,
                  mode: str, sel: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [T, heads, hd] over one layer's pools [kvh, slots, hd] through the C kernel
    (`_attention_kernel.c`): one query at a time, in a fixed order per query, so a query's bits do not
    depend on its batch mates, the cut, the chunk or padding by construction, and a query reads its own
    row's key positions <= its own only. mode "select" writes each query's chosen positions into
    sel [T, topk] int64 and attends to them, "reuse" attends to those in sel. Returns [T, heads*hd]
    (0 for padding tokens).

    Checks the layouts the kernel reads (it takes addresses): head rows of q contiguous, pools
    contiguous, block-table rows contiguous, int64 row fields; the kernel refuses a block outside the
    pool's `num_slots` slots (ValueError)."""
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    if q.stride(2) != 1 or q.stride(1) != hd or not k_cache.is_contiguous() or not v_cache.is_contiguous() \
            or v_cache.shape != k_cache.shape or k_cache.shape[2] != hd:
        raise ValueError(f"attend_native: q {tuple(q.shape)} strides {q.stride()}, pools {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}: need head rows of q contiguous and contiguous pools of head_dim {hd}")
    tables = batch.block_tables
    if tables.stride(1) != 1 and tables.shape[1] > 1:
        tables = tables.contiguous()
    qsl, computed = batch.qsl.contiguous(), batch.num_computed.contiguous()
    for name, x in (("block_tables", tables), ("qsl", qsl), ("num_computed", computed)):
        if x.dtype != torch.int64 or x.device.type != "cpu":
            raise ValueError(f"attend_native: {name} is {x.dtype} on {x.device}; needs int64 on the CPU")
    topk = 0 if sel is None else sel.shape[1]
    if mode != "full" and (sel is None or sel.shape[0] < t or not sel.is_contiguous() or sel.dtype != torch.int64):
        raise ValueError(f"attend_native: mode {mode} needs a contiguous int64 sel of at least {t} rows")
    out = torch.empty(t, heads * hd)
    capture.call(kernels.get("attention").attend, NATIVE_MODES[mode], q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                 v_cache.data_ptr(), k_cache.stride(0), tables.data_ptr(), tables.stride(0), tables.shape[1],
                 batch.block_size, zero_slot, num_slots, qsl.data_ptr(), computed.data_ptr(), batch.num_rows, t,
                 heads, kvh, hd, 1.0 / math.sqrt(hd), out.data_ptr(), 0 if sel is None else sel.data_ptr(), topk)
    return out
