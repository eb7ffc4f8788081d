"""DeepSeek-V4.1's DSpark drafter (`mtp.0` .. `mtp.{n-1}`): one forward proposes `dspark_block_size` tokens at once.

docs/deepseek_v41.md ("The DSpark drafter") is its definition; this module computes it with the target's
building blocks (`layers.linear`, RMSNorm, the MoE, the mHC steps and the attention kernel of the token-wise
forms, model/ops_torch.py or model/ops_c.py, chosen once per call by model/ops.py `choose`), so a row's bits never
depend on its batch mates (docs/exactness.md).

Two calls, both over the paged `DSparkState`:

* `write_context(state, features, positions, slots)`: for committed tokens, the context c[p] = RMSNorm(main_proj .
  f[p]) of their target features (`DeepseekV41.forward_dense(features=True)`, or `ForwardContext.capture_features`
  when serving) and each draft layer's window key RoPE_p(kv_norm(wkv c[p])), stored at the slot of p.
* `draft(target, state, last_tokens, positions, block_tables, block_size, pick)`: the block [last sampled token,
  noise x (k - 1)] at positions n .. n + k - 1 (n = the last sampled token's position) through the draft layers,
  each query attending to its layer's window keys of positions n - W .. n - 1 and to the k keys of its own block;
  then U_j = head(norm(h_j)), z_j = U_j + W2 W1[prev_j] (the Markov head; prev_0 = the last sampled token, then
  each chosen token) and the draft token j + 1 = pick(j, z_j).

Parameter names are the official ones (`mtp.{i}.attn.wq_a.weight`, `mtp.0.main_proj.weight`,
`mtp.{n-1}.markov_head.embed.weight`, ...), the routed experts stacked as the target's (`mtp.{i}.ffn.w13` / `w2`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import StaticBufferError
from .deepseek_v41 import (Attention, DeepseekV41, FirstMix, LayerRole, MoE, RopeTable, add_mhc_params,
                           block_matmul_params, run_stages)
from .layers import Linear, RMSNorm, embedding, linear
from .ops import choose

Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (j, z_j [R, V] float32) -> the draft tokens [R] int64


def greedy(ops: ModuleType) -> Pick:
    """The default pick: the first index of each row's maximum."""
    return lambda j, z: ops.argmax_rows(z)


class DSparkState:
    """The drafter's paged state: per draft layer i, `window[i]` [slots + 2 + scratch, head_dim], the window key of
    position p at the slot of p through the request's block table (`slot = table[p // block_size] * block_size + p %
    block_size`, the target cache's slots: make it with the target cache's num_blocks and block_size).

    Rollback: a key depends on its own position's features alone, and a draft reads the keys of positions n - W ..
    n - 1, all committed; the keys `write_context` stores for tokens the engine later rejects sit at positions >= the
    next draft's n, are never read, and are overwritten when those positions are computed again. Slots trash_slot
    (writes of padding, slot < 0) and zero_slot (never written; reads of a position before 0 or of a null block) as in
    paged_state.py. After them, `max_rows * block` scratch rows: a draft call's own block keys (rows of the call, not
    of any position; one draft call at a time per state)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_rows: int = 256,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_rows", max_rows)):
            if v < 1:
                raise ValueError(f"DSparkState {name}={v}: must be >= 1")
        if not cfg.dspark.enabled:
            raise ValueError(f"DSparkState: the config has no drafter (dspark={cfg.dspark})")
        self.num_blocks, self.block_size, self.max_rows = num_blocks, block_size, max_rows
        self.num_slots = num_blocks * block_size
        self.trash_slot, self.zero_slot, self.scratch = self.num_slots, self.num_slots + 1, self.num_slots + 2
        rows = self.scratch + max_rows * cfg.dspark.dspark_block_size
        self.window = [torch.zeros(rows, cfg.head_dim, dtype=dtype, device=device)
                       for _ in range(cfg.dspark.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.window)


def context_slots(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int, zero_slot: int,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [R, W], ok [R, W]) of positions n - W .. n - 1 for each row's n = positions[r] (row r of block_tables
    [R, B], -1 a null block); the zero slot, not ok, before position 0 or in a null or missing block."""
    wpos = positions[:, None] - window + torch.arange(window, device=positions.device)  # [R, W]
    col = torch.div(wpos, block_size, rounding_mode="floor")
    ok = (wpos >= 0) & (col < block_tables.shape[1])
    block = block_tables.gather(1, torch.where(ok, col, 0))
    ok = ok & (block >= 0)
    return torch.where(ok, block * block_size + wpos % block_size, zero_slot), ok


@dataclasses.dataclass
class DraftStep:
    """What every draft layer of one `draft` call reads: the token-wise form `ops`; cos, sin [N, rd / 2] at the N = R k
    query positions; `wslots`, `wok` [N, W] each query's context window (its row's); `bslots` [N] the scratch row of
    each query's own key; `eslots` [N, k] the scratch rows of its block's k keys and `picks` [N, k] = 0 .. k - 1 (the
    attention kernel's entry list: every key of the block, in block order)."""

    ops: ModuleType
    cos: torch.Tensor
    sin: torch.Tensor
    wslots: torch.Tensor
    wok: torch.Tensor
    bslots: torch.Tensor
    eslots: torch.Tensor
    picks: torch.Tensor
    state: DSparkState


class MarkovHead(nn.Module):
    """The rank-r token transition: `embed.weight` [V, r] (W1) and `head.weight` [V, r] (W2)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = embedding(vocab, rank)
        self.head = Linear(rank, vocab)


class ConfidenceHead(nn.Module):
    """An acceptance logit from [norm(h_j), W1[prev_j]]: `proj.weight` [1, D + r] (optional in a checkpoint)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = Linear(hidden + rank, 1)


class DraftLayer(nn.Module):
    """One draft layer: a V4.1 block without Engram, compressor or indexer (its attention reads a window of context
    keys and its own block), with the drafter's MoE. Layer 0 also owns `main_proj` [D, nL D] and `main_norm`; the
    last layer `norm`, `markov_head` and (optionally) `confidence_head`."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        ds, d = cfg.dspark, cfg.hidden_size
        self.cfg = cfg
        add_mhc_params(self, cfg)
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        # layer num_hidden_layers + index of NeMo's schedule: window attention only (ratio 0, no YaRN)
        self.attn = Attention(cfg, LayerRole(cfg.num_hidden_layers + index, 0, None, None, False, False, False, False))
        self.ffn = MoE(dataclasses.replace(cfg, n_routed_experts=ds.dspark_n_routed_experts,
                                           num_experts_per_tok=ds.dspark_num_experts_per_tok))
        if index == 0:
            self.main_proj = Linear(len(ds.dspark_target_layer_ids) * d, d)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if index == ds.num_layers - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, ds.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d, ds.dspark_markov_rank)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, step: DraftStep, index: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams x [N, hc, D] collapsed with `pre` [N, hc] (the previous sublayer's) -> (streams, this layer's
        FFN pre), the lagged mHC of docs/deepseek_v41.md."""
        ops, cfg = step.ops, self.cfg
        h = self.attn_norm(ops.collapse(x, pre), ops)  # [N, D]
        pre_a, post_a, comb_a = ops.hyper_mix(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg)
        a = self.attention(h, step, index)
        x, (pre_f, post_f, comb_f), h = ops.hc_next(a, x, post_a, comb_a, pre_a, self.hc_ffn_fn, self.hc_ffn_base,
                                                    self.hc_ffn_scale, self.ffn_norm.weight, self.ffn_norm.eps, cfg,
                                                    in_place=True)
        f = run_stages(self.ffn.stages(h, ops))  # [N, D]
        return ops.expand(f, x, post_f, comb_f, in_place=True), pre_f

    def attention(self, h: torch.Tensor, step: DraftStep, index: int) -> torch.Tensor:
        """h [N, D] -> [N, D]: each query over its context window's keys, then its block's k keys (non-causal)."""
        a, ops, cfg = self.attn, step.ops, self.cfg
        n, heads, hd = h.shape[0], a.heads, cfg.head_dim
        pool = step.state.window[index]
        kv = ops.rope(a.kv_norm(linear(h, a.wkv.w), ops), step.cos, step.sin, inverse=False, in_place=True)  # [N, hd]
        ops.store_rows(pool, step.bslots, kv, step.state.trash_slot)  # this call's block keys, in the scratch rows
        qr = a.q_norm(linear(h, a.wq_a.w), ops)
        q = ops.rope(linear(qr, a.wq_b.w).view(n, heads, hd), step.cos, step.sin, inverse=False, in_place=True)
        o = ops.attend_paged(q, pool, step.wslots, step.wok, pool, step.eslots, step.picks, step.state.zero_slot,
                             sink=a.attn_sink, scale=hd ** -0.5)  # [N, H, hd]
        return a.project(o, (step.cos, step.sin), ops)


class Draft(NamedTuple):
    """One draft: `tokens` [R, k] int64 (token j is the guess for position n + 1 + j), `logits` [R, k, V] float32
    (z_j, the Markov term included), `confidence` [R, k] float32 acceptance logits (None without the head)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None


class DSpark(nn.Module):
    """The drafter: `mtp` [num_nextn_predict_layers] DraftLayers (so its state dict holds the official `mtp.*` names).
    It shares the target's embedding and head (`draft` takes the target), as NeMo's frozen copies of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.dspark.enabled:
            raise ValueError(f"DSpark: the config has no drafter (dspark={cfg.dspark})")
        self.config, ds = cfg, cfg.dspark
        self.block, self.noise, self.window = ds.dspark_block_size, ds.dspark_noise_token_id, cfg.sliding_window
        self.mtp = nn.ModuleList(DraftLayer(cfg, i) for i in range(ds.num_layers))
        self.rope = RopeTable(cfg.qk_rope_head_dim, cfg.rope_theta, None)  # the window layers' rope: no YaRN
        self._first_mix = FirstMix(cfg.hc_mult)  # the first sublayer reads stream 0 alone

    @property
    def first(self) -> DraftLayer:
        return self.mtp[0]

    @property
    def last(self) -> DraftLayer:
        return self.mtp[-1]

    def drop_confidence(self) -> None:
        """Without a confidence head (a checkpoint that has none)."""
        self.last.confidence_head = None

    def context(self, features: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """c [T, D] = RMSNorm(main_proj . features) of features [T, nL D]."""
        return self.first.main_norm(linear(features, self.first.main_proj.w), ops)

    def write_context(self, state: DSparkState, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, top: int | None = None) -> None:
        """Store each draft layer's window keys of tokens at `positions` [T] (their target features [T, nL D]) at
        their cache `slots` [T] (the target step's slot mapping; < 0: padding, to the trash slot). `top`: a bound on
        the positions + 1 (default: read from them on the host)."""
        ops = choose(features, self.first.attn_norm.weight)
        c = self.context(features, ops)
        cos, sin = self.rope(positions, top)
        for i, layer in enumerate(self.mtp):
            a = layer.attn
            kv = ops.rope(a.kv_norm(linear(c, a.wkv.w), ops), cos, sin, inverse=False, in_place=True)  # [T, hd]
            ops.store_rows(state.window[i], slots, kv, state.trash_slot)

    def draft(self, target: DeepseekV41, state: DSparkState, last_tokens: torch.Tensor, positions: torch.Tensor,
              block_tables: torch.Tensor, block_size: int, pick: Pick | None = None) -> Draft:
        """R rows' drafts: last_tokens [R] int64 each row's last sampled token, at positions [R] (n: the target has
        computed 0 .. n - 1, whose keys `write_context` stored); block_tables [R, B] int64 (-1 a null block) with
        the cache's block_size. `pick(j, z_j [R, V]) -> [R] int64` chooses draft token j + 1 of each row (default:
        greedy), which is the Markov head's prev for j + 1. Rows are computed alone: a row's bits do not depend on
        the others."""
        r, k, cfg = last_tokens.shape[0], self.block, self.config
        if r > state.max_rows:
            raise StaticBufferError(f"DSparkState holds the block keys of {state.max_rows} rows; the draft has {r}")
        ops = choose(target.embed.weight, self.first.attn_norm.weight)
        dev = last_tokens.device
        ids = torch.cat([last_tokens[:, None], last_tokens.new_full((r, k - 1), self.noise)], 1).reshape(-1)  # [N]
        pos = (positions[:, None] + torch.arange(k, device=dev)).reshape(-1)  # [N]
        wslots, wok = context_slots(positions, block_tables, block_size, state.zero_slot, self.window)  # [R, W]
        step = DraftStep(ops, *self.rope(pos), wslots.repeat_interleave(k, 0), wok.repeat_interleave(k, 0),
                         *self.block_keys(state, r, dev), state)
        u, h = self.forward_block(target, step, ids, self._first_mix(r * k, dev))
        return self.markov(u, h, last_tokens, ops, pick or greedy(ops))

    def block_keys(self, state: DSparkState, r: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DraftStep's (bslots [N], eslots [N, k], picks [N, k]) for R rows of k queries: each query's own key in a
        scratch row, and its block's k keys in block order."""
        k = self.block
        bslots = state.scratch + torch.arange(r * k, device=device)
        picks = torch.arange(k, device=device).expand(r * k, k).contiguous()
        return bslots, bslots.view(r, k).repeat_interleave(k, 0), picks

    def forward_block(self, target: DeepseekV41, step: DraftStep, ids: torch.Tensor, pre: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks ids [N = R k] through the draft layers -> (u [R, k, V] the head's logits, h [R, k, D] the
        normed hidden); `pre` [N, hc] rows (1, 0, .., 0): the first sublayer reads stream 0 alone (NeMo's pre_mix)."""
        ops, k = step.ops, self.block
        x = self.streams(target, ids, ops)  # [N, hc, D]
        for i, layer in enumerate(self.mtp):
            x, pre = layer(x, pre, step, i)
        h = self.last.norm(ops.collapse(x, pre), ops)  # [N, D]
        r = ids.shape[0] // k
        return target.compute_logits(h).view(r, k, -1), h.view(r, k, -1)

    def streams(self, target: DeepseekV41, ids: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """[N, hc, D]: the target's embedding of ids [N] on every stream."""
        return ops.gather_rows(target.embed.weight, ids, self.config.hc_mult)

    def markov(self, u: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, ops: ModuleType, pick: Pick) -> Draft:
        """The Markov chain over the k positions: u [R, k, V] the head's logits, h [R, k, D] the normed hidden,
        prev [R] the last sampled token."""
        mh, conf = self.last.markov_head, self.last.confidence_head
        r, k, v = u.shape
        tokens = torch.empty(r, k, dtype=torch.int64, device=u.device)  # written in place (a CPU graph records it)
        zs, cs = [], []
        for j in range(k):  # sequential: each step reads the token chosen at the step before
            e = ops.gather_rows(mh.embed.weight, prev)[:, 0]  # [R, r]
            zs.append(u[:, j] + linear(e, mh.head.w).float())  # [R, V]
            if conf is not None:  # (one product a position: training's gradients sum as they always have)
                cs.append(linear(ops.cat_cols([h[:, j], e]), conf.proj.w).float())  # [R, 1]
            prev = pick(j, zs[-1])
            tokens[:, j].copy_(prev)
        return Draft(tokens, ops.cat_cols(zs).view(r, k, v), ops.cat_cols(cs) if cs else None)

    def matmul_params(self):
        """(module, parameter name, input dims) of every weight `linear` multiplies by (layers.layout_weights_)."""
        return block_matmul_params(self, DraftLayer)
