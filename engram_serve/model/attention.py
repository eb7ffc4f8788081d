"""Grouped-query attention with cross-layer index sharing, and its two backends.

`PagedAttention` (serving) runs one microbatch over the paged KV cache with the varlen, bit-exact
kernels of `attention_kernels.py`. `DenseAttention` (training) runs [B, S] sequences at positions
0..S-1 through torch's fused `scaled_dot_product_attention` in one padded layout:
    q [B, S, heads, hd], k, v [B, S, kv_heads, hd]; key j visible to query i iff j <= i.
Both give the same attention (up to float rounding): causal by absolute position; a SELECT layer keeps,
per query, the `topk` visible keys with the highest head-mean q.k (ties: lower position first) and
attends only to those; the next layer (REUSE) attends only to the same positions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import StaticBufferError
from .context import ForwardContext
from .layers import Linear, apply_rotary, fuse_on_load, split_on_save
from .attention_kernels import (AttentionPlan, attend_full, attend_native, attend_selected, attention_min_rows,
                                native_available, rotate_store, select_keys)

FULL, SELECT, REUSE = "full", "select", "reuse"


def _select_dense(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [B, S, S]: the `topk` best keys per query of scores [B, S, S] (-inf = not visible)."""
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)[..., :topk]  # stable: ties by position
    keep = torch.isfinite(scores.gather(-1, order))
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, keep)


def rotate_and_attend(backend, layer: int, qkv: torch.Tensor, heads: int, cos, sin, mode: str, topk: int,
                      head_mean=None) -> torch.Tensor:
    """Rotary on the q and k heads of qkv [T, heads + 2 kv_heads, hd] (one pass), then `backend.attend`."""
    kvh = (qkv.shape[1] - heads) // 2
    qk = apply_rotary(qkv[:, :heads + kvh], cos, sin)
    return backend.attend(layer, qk[:, :heads], qk[:, heads:], qkv[:, heads + kvh:], mode, topk, head_mean)


class DenseAttention:
    """Causal attention over [B, S] sequences (training). Keeps the SELECT layer's choice for REUSE."""

    def __init__(self, batch: int, seq: int, device: torch.device):
        self.b, self.s = batch, seq
        pos = torch.arange(seq, device=device)
        self.causal = (pos[None, :] <= pos[:, None])[None].expand(batch, seq, seq)  # [B, S, S]
        self.chosen: torch.Tensor | None = None

    def attend_qkv(self, layer: int, qkv, heads: int, cos, sin, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        return rotate_and_attend(self, layer, qkv, heads, cos, sin, mode, topk, head_mean)

    def attend(self, layer: int, q, k, v, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        b, s = self.b, self.s
        heads, hd = q.shape[1], q.shape[2]
        qt, kt, vt = (x.view(b, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [B, heads|kvh, S, hd]
        mask = self.causal
        if mode == SELECT:
            g = heads // kt.shape[1]
            scores = torch.einsum("bhgqd,bhkd->bqk", qt.reshape(b, kt.shape[1], g, s, hd).float(), kt.float())
            scores = scores / heads if head_mean is None else head_mean(scores)  # head-mean over every rank's heads
            self.chosen = _select_dense(scores.masked_fill(~mask, float("-inf")), topk)
        if mode in (SELECT, REUSE):
            mask = mask & self.chosen
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], scale=1.0 / math.sqrt(hd),
                                             enable_gqa=heads != kt.shape[1])  # [B, heads, S, hd]
        return out.transpose(1, 2).reshape(b * s, heads * hd)


class PagedAttention:
    """Attention of one microbatch over the paged KV cache. The plan is built once per forward and
    shared by every layer; the SELECT layer's choice lives in the microbatch's own `bufs.topk_idx`."""

    # what a test subclass swaps to switch a protection of the torch kernels off (negative controls), not
    # options (the C kernel's protections are switched by tests/kernel_hooks.py):
    plan_type = AttentionPlan  # which keys a pair may read (AttentionPlan.readable)
    guard_fresh = True  # zero this step's non-finite values where a masked query would multiply them

    def __init__(self, ctx: ForwardContext):
        self.ctx = ctx
        self.plan: AttentionPlan | None = None  # built at the first layer, when the head counts are known

    def _plan(self, group: int) -> AttentionPlan:
        if self.plan is None:
            b, zero, width = self.ctx.batch, self.ctx.kv.zero_slot, -(-attention_min_rows(self.ctx.kv) // group)
            if self.ctx.max_seq_len is not None:  # static shapes for graph capture
                self.plan = self.plan_type.build_static(b, zero, width, self.ctx.max_seq_len)
            else:
                self.plan = self.plan_type.build(b, zero, width)
        return self.plan

    def _topk_buf(self, topk: int) -> torch.Tensor:
        n, buf = self.ctx.batch.num_tokens, self.ctx.bufs.topk_idx
        if buf is None or buf.shape[0] < n or buf.shape[1] != topk or buf.dtype != torch.int64:
            got = None if buf is None else (tuple(buf.shape), buf.dtype)
            raise StaticBufferError(f"index-sharing buffer 'topk_idx' of microbatch {self.ctx.bufs.microbatch}: "
                                    f"holds {got}; needs at least ({n}, {topk}) int64")
        view = buf[:n]
        self.ctx.touch("topk_idx", view)
        return view

    def attend_qkv(self, layer: int, qkv, heads: int, cos, sin, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        """Attention of qkv [T, heads + 2 kv_heads, hd] (the fused projection, before rotary). On a float32 CPU
        it runs as two C calls (rotary in place and the KV writes, then the attention); elsewhere (CUDA, the
        attention kernel not loaded: engram_serve/kernels.py), and for a selecting layer under tensor
        parallelism (its scores are summed across ranks' heads), through the torch kernels."""
        kv = self.ctx.kv
        kc, vc = kv.layer(layer)
        if not ((head_mean is None or mode != SELECT) and native_available(qkv, kc)):
            return rotate_and_attend(self, layer, qkv, heads, cos, sin, mode, topk, head_mean)
        qkv = qkv.contiguous()  # (a fresh projection: already)
        sel = None if mode == FULL else self._topk_buf(topk)
        b = self.ctx.batch
        rotate_store(qkv, heads, cos, sin, b.slot_mapping, kc, vc, kv.num_slots)  # this microbatch's keys first
        return attend_native(b, qkv[:, :heads], kc, vc, kv.zero_slot, kv.num_slots, mode, sel)

    def attend(self, layer: int, q, k, v, mode: str, topk: int, head_mean=None) -> torch.Tensor:
        kv = self.ctx.kv
        kv.write(layer, self.ctx.batch.slot_mapping, k, v)  # this microbatch's keys first: a row attends to itself
        kc, vc = kv.layer(layer)
        plan = self._plan(q.shape[1] // k.shape[1])
        if mode == FULL:
            return attend_full(plan, q, kc, vc, v if self.guard_fresh else None)
        if mode == SELECT:
            self._topk_buf(topk).copy_(select_keys(plan, q, kc, topk, head_mean))
        return attend_selected(plan, q, kc, vc, self._topk_buf(topk))


class Attention(nn.Module):
    """Grouped-query attention with q, k and v as ONE matmul: `qkv_proj` stacks the q, k and v
    projections by output. Checkpoints keep `q_proj.weight`, `k_proj.weight` and `v_proj.weight`: they
    are stacked when loading and split again by `state_dict()`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size)
        self.head_mean = None  # tensor parallel: set by parallel.shard (q.k mean over every rank's heads)
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
        self.register_load_state_dict_pre_hook(fuse_on_load({"qkv_proj.weight": (names, lambda *w: torch.cat(w))}))
        self.register_state_dict_post_hook(split_on_save({"qkv_proj.weight": (names, self.split_qkv)}))

    def split_qkv(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v parts (by output rows) of a [(heads + 2 kv_heads) * head_dim, ...] tensor."""
        return w.split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, layer: int,
                mode: str = FULL, topk: int = 0) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.heads + 2 * self.kv_heads, self.head_dim)
        return self.o_proj(backend.attend_qkv(layer, qkv, self.heads, cos, sin, mode, topk, self.head_mean))
