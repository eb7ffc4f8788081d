"""Grouped-query attention over a paged KV cache, with cross-layer index sharing.

Both the serving (paged) path and the dense reference path put queries and keys into one padded
layout and call the same `attend_padded`:
    q [R, Qm, heads, hd]  (row r's query slot o holds its o-th token of this batch; q_pos -1 = none)
    k, v [R, Km, kv_heads, hd]  (key slot j of row r IS absolute position j of row r's request)
Key j is visible to query (r, o) iff j <= q_pos[r, o] and j < k_len[r] (causal by absolute position).

Index sharing (DeepSeek sparse-attention style): a SELECT layer scores every visible key by the
head-mean of q.k, keeps the `topk` best absolute positions (ties: lower position first; -1 padding
when fewer are visible) and attends only to those; the next layer (REUSE) attends only to the same
positions. Between layers the choice lives in the microbatch's own `bufs.topk_idx[:T]`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import StaticBufferError
from .context import ForwardContext
from .layers import Linear, apply_rotary

FULL, SELECT, REUSE = "full", "select", "reuse"


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[R, Qm, topk] int64 key positions with the highest scores [R, Qm, Km] (-inf = not visible), -1 padded."""
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)[..., :topk]  # stable: ties by position
    top = scores.gather(-1, order)
    sel = torch.where(torch.isneginf(top), torch.full_like(order, -1), order)
    if sel.shape[-1] < topk:
        sel = F.pad(sel, (0, topk - sel.shape[-1]), value=-1)
    return sel


def positions_mask(sel: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [R, Qm, num_keys]: True at the key positions listed in sel [R, Qm, k] (-1 ignored)."""
    idx = torch.where(sel < 0, torch.full_like(sel, num_keys), sel).clamp(max=num_keys)
    m = torch.zeros(*sel.shape[:-1], num_keys + 1, dtype=torch.bool, device=sel.device)
    return m.scatter_(-1, idx, True)[..., :num_keys]


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor,
                  mode: str = FULL, sel_in: torch.Tensor | None = None, topk: int = 0, head_mean=None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention in the padded layout (module docstring). Returns out [R, Qm, heads*hd] (0 for query slots
    that see no key) and, for SELECT, the chosen positions [R, Qm, topk]. `head_mean` (tensor parallel:
    this rank holds some heads) turns this rank's sum of q.k over its heads into the mean over all heads."""
    r, qm, heads, hd = q.shape
    km, kv_heads = k.shape[1], k.shape[2]
    kpos = torch.arange(km, device=q.device)
    mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < k_len[:, None, None])  # [R, Qm, Km]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [R, heads, Qm|Km, hd]
    sel = None
    if mode == SELECT:
        qg = qt.reshape(r, kv_heads, heads // kv_heads, qm, hd).float()
        scores = torch.einsum("rhgqd,rhkd->rqk", qg, kt.float())  # sum of q.k over (this rank's) heads
        scores = scores / heads if head_mean is None else head_mean(scores)  # head-mean of q.k
        sel = select_topk(scores.masked_fill(~mask, float("-inf")), topk)
        mask = mask & positions_mask(sel, km)
    elif mode == REUSE:
        mask = mask & positions_mask(sel_in, km)
    no_key = ~mask.any(-1)  # padding query slots: give them key 0 so softmax stays finite, zero them after
    mask = mask | (no_key[..., None] & (kpos == 0)[None, None, :])
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], scale=1.0 / math.sqrt(hd),
                                         enable_gqa=heads != kv_heads)  # [R, heads, Qm, hd]
    out = out.transpose(1, 2).reshape(r, qm, heads * hd).masked_fill(no_key[..., None], 0.0)
    return out, sel


class DenseBackend:
    """Plain causal attention over [B, S] sequences at positions 0..S-1 (training / reference)."""

    def __init__(self, batch: int, seq: int, device: torch.device):
        self.b, self.s = batch, seq
        self.q_pos = torch.arange(seq, device=device).expand(batch, seq)
        self.k_len = torch.full((batch,), seq, dtype=torch.int64, device=device)
        self.sel: torch.Tensor | None = None

    def attend(self, layer: int, q, k, v, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        b, s = self.b, self.s
        out, sel = attend_padded(q.view(b, s, *q.shape[1:]), k.view(b, s, *k.shape[1:]), v.view(b, s, *v.shape[1:]),
                                 self.q_pos, self.k_len, mode, self.sel, topk, head_mean)
        if sel is not None:
            self.sel = sel
        return out.reshape(b * s, -1)


class PagedBackend:
    """Paged attention for one microbatch. The padded layout is planned once per forward, used by every layer."""

    def __init__(self, ctx: ForwardContext):
        b = ctx.batch
        self.ctx = ctx
        t, r = b.num_tokens, b.num_rows
        dev = b.input_ids.device
        self.t, self.r = t, r
        self.qm = ctx.max_query_len if ctx.max_query_len is not None else self._max_query_len(b)
        if ctx.max_seq_len is not None:
            self.km = ctx.max_seq_len
        elif b.seq_lens.device.type == "cpu":  # no device sync to read it
            self.km = int(b.seq_lens.max()) if r else 0
        else:  # static bound: no sync, graph-safe
            self.km = b.block_tables.shape[1] * b.block_size
        tok = torch.arange(t, device=dev)
        row = torch.searchsorted(b.qsl[1:].long(), tok, right=True)  # [T]
        valid = row < r
        rowc = row.clamp(max=max(r - 1, 0))
        off = tok - b.qsl.long()[rowc]
        dummy = r * self.qm  # one extra slot absorbs tokens outside every row (padding)
        self.flat = torch.where(valid, rowc * self.qm + off, torch.full_like(tok, dummy))  # [T]
        q_pos = torch.full((dummy + 1,), -1, dtype=torch.int64, device=dev)
        q_pos.index_copy_(0, self.flat, torch.where(valid, b.positions.long(), torch.full_like(tok, -1)))
        self.q_pos = q_pos[:dummy].view(r, self.qm)  # [R, Qm]
        self.k_len = b.seq_lens.long()
        self.slots = ctx.kv.slots_for(b.block_tables.long(), self.km)  # [R, Km]

    @staticmethod
    def _max_query_len(b) -> int:
        host = getattr(b, "qsl_host", None)
        if host is None and b.qsl.device.type == "cpu":
            host = b.qsl
        if host is None:
            return b.num_tokens  # static bound: no device sync
        return int((host[1:] - host[:-1]).max()) if len(host) > 1 else 0

    def _to_padded(self, x: torch.Tensor, fill: float | int) -> torch.Tensor:
        """[T, ...] token-major -> [R, Qm, ...] padded layout."""
        out = torch.full((self.r * self.qm + 1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        out.index_copy_(0, self.flat, x)
        return out[:-1].view(self.r, self.qm, *x.shape[1:])

    def _to_tokens(self, x: torch.Tensor, fill: float | int) -> torch.Tensor:
        """[R, Qm, ...] padded layout -> [T, ...] token-major (fill for tokens outside every row)."""
        flat = x.reshape(self.r * self.qm, *x.shape[2:])
        flat = torch.cat([flat, torch.full((1, *flat.shape[1:]), fill, dtype=x.dtype, device=x.device)])
        return flat[self.flat]

    def _topk_buf(self, topk: int) -> torch.Tensor:
        buf = self.ctx.bufs.topk_idx
        if buf is None or buf.shape[0] < self.t or buf.shape[1] != topk or buf.dtype != torch.int64:
            got = None if buf is None else (tuple(buf.shape), buf.dtype)
            raise StaticBufferError(f"index-sharing buffer 'topk_idx' of microbatch {self.ctx.bufs.ubatch}: "
                                    f"holds {got}; needs at least ({self.t}, {topk}) int64")
        view = buf[:self.t]
        self.ctx.touch("topk_idx", view)
        return view

    def attend(self, layer: int, q, k, v, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        b, kv = self.ctx.batch, self.ctx.kv
        kv.write(layer, b.slot_mapping, k, v)  # this microbatch's keys first: a row attends to itself
        kp, vp = kv.gather(layer, self.slots)  # [R, Km, kv_heads, hd]
        sel_in = self._to_padded(self._topk_buf(topk), -1) if mode == REUSE else None
        out, sel = attend_padded(self._to_padded(q, 0.0), kp.to(q.dtype), vp.to(q.dtype), self.q_pos, self.k_len,
                                 mode, sel_in, topk, head_mean)
        if sel is not None:
            self._topk_buf(topk).copy_(self._to_tokens(sel, -1))
        return self._to_tokens(out, 0.0)  # [T, heads*hd]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size)
        self.head_mean = None  # tensor parallel: set by parallel.shard (mean over every rank's heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, layer: int,
                mode: str = FULL, topk: int = 0) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        return self.o_proj(backend.attend(layer, q, k, v, mode, topk, self.head_mean))
