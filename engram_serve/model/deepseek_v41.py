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
the cache writes and key gathers) has two forms that compute the same formula, two modules with the same
functions: model/ops_torch.py, the torch operators (the readable formulas), and model/ops_c.py, one call
into the C token kernel each, which computes each token alone in an order fixed per token. `forward_stages`
chooses one per forward (model/ops.py: float32 CPU tensors outside autograd with the kernel loaded, by
devices, dtypes and kernels, never by the batch) and passes it down in `V41Step.ops`. Either way a token's
bits never depend on its batch mates, the cut or padding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from itertools import pairwise
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..engram.layer import EngramGate
from ..errors import StaticBufferError
from .. import kernels
from . import capture, exactness, ops_c, products
from .layers import Linear, RMSNorm, embedding, linear, linear_groups, stacked
from .ops import choose
from .ops_torch import KEY_CHUNK
from .paged_state import SlotPlan, PagedState
from .weights import StoredWeight, HoldsStored, Mxfp4Experts

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
        ops = choose(cos)  # (the tables are float32 whatever the model's dtype)
        return ops.gather_rows(cos, positions)[:, 0], ops.gather_rows(sin, positions)[:, 0]


# ---- the per-forward context --------------------------------------------------------------------------
@dataclass
class V41Step:
    """What one microbatch's forward reads and writes besides activations: the cache, its slot plan, the
    rope tables, and the microbatch's own cross-layer buffers `topk` [T, index_topk] int64 and
    `candidates` [T, candidate_topk_blocks] int64 (block ids, -1 none), owned by this microbatch alone
    (docs/contract.md §5). `touch(name, t)` reports a buffer use to the debug ownership check. `ops`: the form
    every layer of this forward runs its token-wise steps in (`DeepseekV41.forward_stages` chooses it). With
    `capture` (layer ids), `features` [T, nL D] holds, in the columns of capture[i], the mean over the hc streams
    entering layer capture[i], after its Engram gate and for every token (before a `keep`): the DSpark drafter's
    features, written in place by each of those layers."""

    cache: PagedState
    plan: SlotPlan
    topk: torch.Tensor
    candidates: torch.Tensor
    touch: Callable[[str, torch.Tensor], None] = lambda name, t: None
    ctx: object = None  # the runner's ForwardContext (tensor parallelism: its collectives' buffers and tracking)
    rotary: dict = None  # "plain", "comp": (cos, sin) [T, rd / 2] at the positions; ratio r: at each token's entry
    ops: ModuleType = None  # the form of the token-wise steps, ops_c or ops_torch (model/ops.py), chosen per forward
    capture: tuple[int, ...] = ()  # layers whose input streams the forward keeps (the drafter's features); () none
    features: torch.Tensor | None = None  # [T, nL D]: the stream means entering the `capture` layers, side by side


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
        ops = step.ops
        if self.ratio == 1:
            return self.norm(linear(x, self.wkv.w), ops)  # [T, hd]
        row = linear(x, stacked(self.wkv.w, self.wgate.w)).float()  # [T, 2hd]: kv, then gate
        return self.norm(ops.pool_pair(self.partner(row, step, layer), row).to(x.dtype), ops)

    @staticmethod
    def partner(row: torch.Tensor, step: V41Step, layer: int) -> torch.Tensor:
        """Store this microbatch's [kv, gate] rows, then read each token's partner: the row of position
        p - 1 (the open group, when p is odd), from this microbatch or from wherever it ran before."""
        pool = step.cache.open[layer]
        step.ops.store_rows(pool, step.plan.slots, row, step.cache.trash_slot)
        return step.ops.gather_rows(pool, step.plan.prev_slots)[:, 0]  # [T, 2hd]


class Indexer(nn.Module):
    """An index source's indexer (docs/deepseek_v41.md, "Indexer"); `wk`/`k_norm` on kv sources only."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(cfg.hidden_size, self.heads)
        self.wk = Linear(cfg.head_dim, self.dim) if owns_keys else None
        self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps) if owns_keys else None

    def scores(self, ops: ModuleType, x: torch.Tensor, qr: torch.Tensor, cos, sin, pool: torch.Tensor,
               slots: torch.Tensor, count: torch.Tensor, width: int, zero_slot: int, cands: torch.Tensor | None,
               block: int) -> torch.Tensor:
        """s [T, width]: sum_h w_h relu(q_h . k_g) for entry g of each token (its key at pool[slots[:, g]],
        slots [T, E], E <= width); -inf where not visible (g >= count) and, with cands [T, nc] (block ids, -1
        none), outside the candidate blocks of `block` entries (`index_scores`). width is a multiple of KEY_CHUNK
        (each batched-matmul item of the torch form is one chunk)."""
        t = x.shape[0]
        q = ops.rope(linear(qr, self.wq_b.w).view(t, self.heads, self.dim), cos, sin, inverse=False,
                     in_place=True)  # [T, nh, ihd]
        w = linear(x, self.weights_proj.w)  # [T, nh]
        wscale = self.dim ** -0.5 * self.heads ** -0.5
        return ops.index_scores(q, w, wscale, pool, slots, count, width, zero_slot, cands, block)


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
        cfg, role, plan, ops = self.cfg, self.role, step.plan, step.ops
        h, hd = self.heads, cfg.head_dim
        kv = ops.rope(self.kv_norm(linear(x, self.wkv.w), ops), *rope_cs, inverse=False, in_place=True)  # [T, hd]
        window = step.cache.window[role.layer]
        ops.store_rows(window, plan.slots, kv, step.cache.trash_slot)  # this microbatch's keys first: a token attends to itself
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
        qr = self.q_norm(linear(x, self.wq_a.w), ops)  # [T, ql]
        q = ops.rope(linear(qr, self.wq_b.w).view(t, h, hd), *rope_cs, inverse=False, in_place=True)  # [T, H, hd]
        entries = eslots = None
        if role.ratio:
            if self.indexer is not None:
                self._select(x, qr, step, plan, rope_cs, topk, cands)
            entries, eslots = step.cache.entries[role.kv_source], plan.entry_slots[role.ratio]
        else:
            topk = None
        o = ops.attend_paged(q, window, plan.window, plan.window_ok, entries, eslots, topk, step.cache.zero_slot,
                             sink=self.attn_sink, scale=hd ** -0.5)  # [T, H, hd]
        return self.project(o, rope_cs, ops)

    def project(self, o: torch.Tensor, rope_cs: tuple[torch.Tensor, torch.Tensor], ops: ModuleType) -> torch.Tensor:
        """The heads' outputs o [T, H, hd] -> [T, D]: the inverse RoPE, the grouped `wo_a`, then `wo_b`."""
        o = ops.rope(o, *rope_cs, inverse=True, in_place=True).reshape(o.shape[0], self.groups, -1)
        return linear(linear_groups(o, self.wo_a, ops), self.wo_b.w)

    def _compress(self, x: torch.Tensor, step: V41Step, entry_cs) -> None:
        """Store the entries (and index keys) completed by this microbatch's tokens."""
        layer, r, plan, ops, trash = self.role.layer, self.role.ratio, step.plan, step.ops, step.cache.trash_slot
        latent = self.compressor.latent(x, step, layer)  # [T, hd]
        ops.store_rows(step.cache.entries[layer], plan.slots, ops.rope(latent, *entry_cs, inverse=False), trash,
                       plan.positions, r)
        ik = ops.rope(self.indexer.k_norm(linear(latent, self.indexer.wk.w), ops), *entry_cs, inverse=False,
                      in_place=True)
        ops.store_rows(step.cache.index_keys[layer], plan.slots, ik, trash, plan.positions, r)

    def _select(self, x: torch.Tensor, qr: torch.Tensor, step: V41Step, plan: SlotPlan, rope_cs, topk: torch.Tensor,
                cands: torch.Tensor) -> None:
        """Score the key source's entries for the tokens of `plan` and write their top-k into `topk` [T, index_topk]
        (and their candidate blocks into `cands`, or read them there)."""
        cfg, role = self.cfg, self.role
        eslots, count = plan.entry_slots[role.ratio], plan.entry_count[role.ratio]  # [T, E], [T]
        unit = math.lcm(KEY_CHUNK, cfg.candidate_block_size)  # whole indexer items and whole candidate blocks
        width = max(1, -(-eslots.shape[1] // unit)) * unit
        s = self.indexer.scores(step.ops, x, qr, *rope_cs, step.cache.index_keys[role.kv_source], eslots, count, width,
                                step.cache.zero_slot, cands if role.uses_candidates else None,
                                cfg.candidate_block_size)  # [T, width]
        if role.publishes_candidates:
            step.ops.candidate_blocks(s, count, cfg.candidate_block_size, cfg.candidate_topk_blocks, out=cands)
        step.ops.topk(s, cfg.index_topk, out=topk)


# ---- MoE -------------------------------------------------------------------------------------------
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
    stored: tuple | None = None  # MXFP4 as stored (`Mxfp4Experts`): w13 / w2 address w1's / w2's codes; the
    # addresses of w1's scales, w3's codes and scales, w2's scales
    words: bool = False  # those codes panel-major (`Mxfp4Experts.panel_major`)
    stored_tiles: bool = False  # those codes on the AMX tiles (`Mxfp4Experts.on_tiles`)
    tiled: bool = False  # those words in the tiles' order (`exactness.tiled_words`, as `panel_major` made them)
    prefetch: bool = False  # those codes read where the map has them, each step's read ahead (`Mxfp4Experts.prefetch`)


class MoE(HoldsStored):
    """Routed experts with sqrt(softplus) scores and a bias that only chooses, plus one shared expert.

    Parameters: `gate.weight` [E, D], `gate.bias` [E]; the experts stacked as `w13` [E, 2I, D] (w1 then w3
    by rows) and `w2` [E, D, I]; `shared_experts.{w1,w2,w3}` (checkpoints keep one tensor per expert:
    `experts.{e}.w{1,2,3}.weight`, stacked when loading). A token's output adds its experts' weighted
    outputs in ascending expert order, then the shared expert's: an order fixed per token.

    Or the routed experts as stored (`stored`, an `Mxfp4Experts`, `use_stored`: model/weights.py `HoldsStored`):
    then `w13` and `w2` are not parameters until something reads them (the torch forms, autograd, sharding,
    `state_dict`, `.to`), which turns them into today's float32 Parameters once (`dense_`)."""

    STORED = ("w13", "w2")

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

    def dense_params(self) -> dict[str, torch.Tensor]:
        w13, w2 = self.stored.dense()
        self._panels = None
        return {"w13": w13, "w2": w2}

    def route(self, x: torch.Tensor, ops: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k] best first, ties to the lower id; their weights [N, k])."""
        cfg = self.cfg
        z = linear(x, self.gate.w)  # [N, E]
        return ops.moe_route(z, self.gate.bias, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def expert(self, e: int, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return linear(ops.swiglu(linear(x, self.w13[e]), self.inter, self.cfg.swiglu_limit), self.w2[e])

    def experts(self, xs: torch.Tensor, counts: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """ys [P, D]: each expert's output for its rows of xs [P, D] (grouped by expert, counts [E] int64 rows
        each). One linear-kernel call where the C matmul serves every expert's weights (`exactness.moe_experts`:
        the very products and SwiGLU of `expert`, so the same bits, and no host read); else `expert` per
        expert with rows, after a host read of the counts."""
        panels = self._expert_panels(xs, counts, ops)
        if panels is not None:
            return exactness.moe_experts(xs, counts, panels.w13, panels.kc13, panels.w2, panels.kc2, self.inter,
                                         self.cfg.swiglu_limit, panels.tiles, panels.stored, panels.words,
                                         panels.stored_tiles, panels.tiled, panels.prefetch)
        capture.refuse("the MoE reads its expert counts on the host")
        parts, start = [], 0
        for e, c in enumerate(counts.tolist()):  # one host read
            if c:
                parts.append(self.expert(e, xs[start:start + c], ops))
            start += c
        return ops.cat_rows(parts) if parts else xs

    def _expert_panels(self, xs: torch.Tensor, counts: torch.Tensor, ops: ModuleType) -> ExpertPanels | None:
        """The `ExpertPanels` of the experts where the C matmul takes every expert's product (model/exactness.py: the
        rules on, every expert's bfloat16 tiles or a probed kc, float32 CPU rows, no autograd) and the SwiGLU takes
        its C form, else None. Cached per weight version. With the experts as stored: their MXFP4 panels where the
        plan of an expert's float weight takes float panels or the AMX tiles (then the same bits), else `dense_` and
        as today."""
        if not (exactness.rules_on() and ops is ops_c and xs.is_contiguous() and counts.is_cpu):
            return None  # (the token kernel's SwiGLU is the one inside: with the token kernel on only)
        if self.stored is not None:
            panels = self._stored_panels()
            if panels is not None:
                return panels
            self.dense_()  # tiles, BLAS, row-wise or padded torch: today's product, over a float copy made once
        w13, w2 = self.w13, self.w2
        key = (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, kernels.get("linear"), torch.get_num_threads())
        cached = getattr(self, "_panels", None)
        if cached is None or cached[0] != key:
            plans13 = [products.plan(w13[e]) for e in range(w13.shape[0])]
            plans2 = [products.plan(w2[e]) for e in range(w2.shape[0])]
            tiles = all(p.is_tiles for p in plans13 + plans2)  # every expert on the bfloat16 tiles
            ok = tiles or all(p.kernel_weight is not None and not p.is_tiles for p in plans13 + plans2)  # (else mixed)
            panels = None if not ok else ExpertPanels(
                torch.tensor([p.kernel_weight.data_ptr() for p in plans13], dtype=torch.int64), plans13[0].kc or 1,
                torch.tensor([p.kernel_weight.data_ptr() for p in plans2], dtype=torch.int64), plans2[0].kc or 1,
                plans13 + plans2, tiles)
            self._panels = cached = (key, panels)
        return cached[1]

    def _stored_panels(self) -> ExpertPanels | None:
        """The `ExpertPanels` of the experts as stored (MXFP4, read in place) at the block sizes of the float path
        (`Mxfp4Experts.kcs`: every expert of a shape has the same plan) or on the AMX tiles (`on_tiles`); else None.
        Cached per kernel, thread count and `prefetch`."""
        key = (kernels.get("linear"), torch.get_num_threads(), self.stored.prefetch)
        cached = getattr(self, "_panels", None)
        if cached is None or cached[0] != key:
            kcs, panels = self.stored.kcs(), None
            tiles = kcs is None and self.stored.on_tiles()
            if kcs is not None or tiles:
                codes1, scales1, codes3, scales3, codes2, scales2 = self.stored.addresses()
                kcs = kcs or (8, 8)  # (unused on the tiles)
                words = self.stored.words is not None
                panels = ExpertPanels(codes1, kcs[0], codes2, kcs[1], [], False, (scales1, codes3, scales3, scales2),
                                      words, tiles, words and exactness.tiled_words(exactness.STORED_MXFP4),
                                      not words and self.stored.prefetch)
            self._panels = cached = (key, panels)
        return cached[1]

    def shared(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        s = self.shared_experts
        gu = linear(x, stacked(s.w1.w, s.w3.w))  # [N, 2I]: w1's outputs, then w3's
        return linear(ops.swiglu(gu, self.inter, self.cfg.swiglu_limit), s.w2.w)

    def stages(self, x: torch.Tensor, ops: ModuleType, ctx=None) -> Generator[str, None, torch.Tensor]:
        """Yields once, before the combine (the expert-parallel overlap point; `ctx`, the runner's
        ForwardContext, is for an expert-parallel shard's collective); returns [N, D]."""
        ids, w = self.route(x, ops)  # [N, k]
        order, counts, tok = ops.moe_group(ids, self.cfg.n_routed_experts)  # (token, pick) pairs by expert
        xs = ops.gather_rows(x, tok)[:, 0]  # [N*k, D]
        ys = self.experts(xs, counts, ops)  # [N*k, D]
        yield STAGE_MOE
        return ops.moe_combine(ys, order, w, lambda: self.shared(x, ops))


# ---- the model -------------------------------------------------------------------------------------
@dataclass
class Streams:
    """The residual streams between two layers: x [T, hc, D] and `pre` [T, hc], the mix that collapses them into
    the next sublayer's input. Where the last layer's expand was fused with the next layer's collapse and mix
    (`Block.expand_into`), `mix` is that layer's attention mix (pre, post, comb) and `h` [T, D] its normed input;
    else both None."""

    x: torch.Tensor
    pre: torch.Tensor
    mix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    h: torch.Tensor | None = None


@dataclass
class EngramInputs:
    """What a forward's Engram layers read: `rows(i)` Engram layer i's staged rows [T, C, hd] (None: Engram
    ablated); `summed(i)` its projection already summed across ranks (tensor parallelism, `engram_sums`; else
    None); `dead` [T] bool tokens whose gate is 0 (None: none)."""

    rows: Callable[[int], torch.Tensor] | None
    summed: Callable[[int], torch.Tensor] | None
    dead: torch.Tensor | None


def add_mhc_params(block: nn.Module, cfg: ModelConfig) -> None:
    """A block's mHC parameters for its two sublayers, official names: `hc_{attn,ffn}_fn` [(2 + hc) hc, hc D],
    `hc_{attn,ffn}_base` [(2 + hc) hc], `hc_{attn,ffn}_scale` [3]."""
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    for s in ("attn", "ffn"):
        block.register_parameter(f"hc_{s}_fn", nn.Parameter(torch.zeros(mix, hc * d)))
        block.register_parameter(f"hc_{s}_base", nn.Parameter(torch.zeros(mix)))
        block.register_parameter(f"hc_{s}_scale", nn.Parameter(torch.ones(3)))


class Block(nn.Module):
    """One V4.1 layer: an Engram gate (on Engram layers), then attention and MoE, each read from the hc residual
    streams through an mHC collapse and written back through an mHC expand."""

    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        e = cfg.engram
        self.cfg, self.role = cfg, role
        self.engram_index = e.engram_layer_ids.index(role.layer) if role.layer in e.engram_layer_ids else None
        self.engram = (EngramGate(d, hc, e.num_columns, e.engram_head_dim, cfg.rms_norm_eps)
                       if self.engram_index is not None else None)
        add_mhc_params(self, cfg)
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, role)
        self.ffn = MoE(cfg)

    def stages(self, s: Streams, next_block: Block | None, step: V41Step, engram: EngramInputs,
               keep: torch.Tensor | None = None, next_keep: torch.Tensor | None = None
               ) -> Generator[str, None, Streams]:
        """This layer over the streams s -> the next layer's streams; yields at its overlap points (the same
        ones in every microbatch). With `keep` [K] (token indices) every token's keys and entries are stored,
        and the rest is computed for the tokens `keep` alone; `next_keep`: the next layer's."""
        cfg, ops, cs = self.cfg, step.ops, step.rotary
        x = s.x  # [T, hc, D]
        if self.engram is not None:
            x = yield from self.gate(x, step, engram)
        if self.role.layer in step.capture:  # (the drafter's features: after the Engram gate, as NeMo's)
            i, d = step.capture.index(self.role.layer), x.shape[2]
            if step.features is None:
                step.features = torch.empty(x.shape[0], len(step.capture) * d, dtype=x.dtype, device=x.device)
            ops.stream_mean(x, out=step.features[:, i * d:(i + 1) * d])
        if s.mix is None:  # the attention's mHC collapse and mix
            h = self.attn_norm(ops.collapse(x, s.pre), ops)  # [T, D]
            if keep is not None:
                x = x[keep]
            pre, post, comb = ops.hyper_mix(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg)
        else:  # made by the last layer's expand (`expand_into`)
            (pre, post, comb), h = s.mix, s.h
        entry_cs = cs.get(self.role.ratio, cs["comp"]) if self.role.ratio else None
        a = self.attn(h, step, cs["comp"] if self.role.ratio else cs["plain"], entry_cs, keep)
        a = yield from collective_point(a, self.attn.wo_b, STAGE_ATTN, step.ctx)
        # the attention's mHC expand, with the MoE's collapse and mix
        x, (pre, post, comb), h = ops.hc_next(a, x, post, comb, pre, self.hc_ffn_fn, self.hc_ffn_base,
                                              self.hc_ffn_scale, self.ffn_norm.weight, self.ffn_norm.eps, cfg,
                                              in_place=True)
        f = yield from self.ffn.stages(h, ops, step.ctx)
        return self.expand_into(next_block, next_keep, ops, f, x, post, comb, pre)  # the MoE's mHC expand

    def gate(self, x: torch.Tensor, step: V41Step, engram: EngramInputs) -> Generator[str, None, torch.Tensor]:
        """The Engram gate on the streams x [T, hc, D]; yields while this microbatch's rows are gathered."""
        if engram.summed is not None:  # tensor parallel: its projection's sum was launched at the start
            return self.engram.apply(x.contiguous(), engram.summed(self.engram_index), engram.dead, step.ops)
        yield STAGE_ENGRAM_GATHER  # the other microbatch computes while this one's gather runs
        if engram.rows is None:
            return x
        rows = engram.rows(self.engram_index)
        step.touch("staging", rows)
        return self.engram(x.contiguous(), rows, engram.dead, step.ops)

    def expand_into(self, next_block: Block | None, next_keep: torch.Tensor | None, ops: ModuleType,
                    f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor
                    ) -> Streams:
        """The MoE's output f [T, D] expanded into the streams x, fused with next_block's attention collapse and
        mix (`hc_next`: one C call over tiles of tokens) where nothing runs between the two (a next layer, no
        Engram gate before it, and not the `keep` boundary: the next layer subsets the tokens in between); else
        the plain expand, the next layer collapsing with `pre`."""
        if next_block is None or next_block.engram is not None or next_keep is not None:
            return Streams(ops.expand(f, x, post, comb, in_place=True), pre)
        nxt = next_block
        x, mix, h = ops.hc_next(f, x, post, comb, pre, nxt.hc_attn_fn, nxt.hc_attn_base, nxt.hc_attn_scale,
                                nxt.attn_norm.weight, nxt.attn_norm.eps, self.cfg, in_place=True)
        return Streams(x, pre, mix, h)


class FirstMix:
    """`(t, device)` -> [t, hc] rows (1, 0, .., 0), the collapse of a first sublayer that reads stream 0 alone: a
    view of one constant grown on demand, so no operator per forward (a CPU graph replays none)."""

    def __init__(self, hc: int):
        self.rows = torch.zeros(0, hc)

    def __call__(self, t: int, device: torch.device) -> torch.Tensor:
        if self.rows.shape[0] < t or self.rows.device != device:
            self.rows = torch.zeros(max(t, 2 * self.rows.shape[0]), self.rows.shape[1], device=device)
            self.rows[:, 0] = 1.0
        return self.rows[:t]


def block_matmul_params(model: nn.Module, block: type):
    """(module, parameter name, input dims) of every weight `linear` multiplies by in `model` whose blocks (the
    owners of the mHC's `hc_attn_fn` / `hc_ffn_fn`) are of type `block`: weights as stored are laid out as stored."""
    for m in model.modules():
        if isinstance(m, Linear) and m.stored is None:
            yield m, "weight", 1
        elif isinstance(m, MoE) and m.stored is None:
            yield m, "w13", 1
            yield m, "w2", 1
        elif isinstance(m, block):
            yield m, "hc_attn_fn", 1
            yield m, "hc_ffn_fn", 1


class DeepseekV41(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.roles = layer_roles(cfg)
        self.embed = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, role) for role in self.roles)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope_plain = RopeTable(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        self.rope_comp = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling,
                                   shifts=sorted({r - 1 for r in cfg.ratios if r > 1}))
        self._first_mix = FirstMix(cfg.hc_mult)  # layer 0's attention reads stream 0 alone

    def stages(self, ctx) -> Generator[str, None, torch.Tensor]:
        """The serving forward of one microbatch (a ForwardContext: its StepBatch slice, the cache, its own
        buffers, its staged Engram rows) -> hidden [T, D], or of the tokens `ctx.keep` alone; yields at overlap
        points. With `ctx.capture_features`, the drafter's features of every token go to `ctx.features`."""
        step = self.prepare(ctx)
        if ctx.capture_features:
            step.capture = tuple(self.config.dspark.dspark_target_layer_ids)
        hidden = yield from self.forward_stages(ctx.batch.input_ids, ctx.batch.dead, step, ctx.engram_rows, ctx.keep)
        if ctx.capture_features:
            ctx.features = step.features
        return hidden

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
        token's keys and entries, and computes the rest for those tokens only, which no other token reads.
        The form of the token-wise steps is chosen here, once (model/ops.py `choose`), into step.ops."""
        if keep is not None and not len(keep):  # one token still runs every stage (microbatches keep in step)
            return (yield from self.forward_stages(ids, dead, step, engram_rows, keep.new_zeros(1)))[:0]
        ops = step.ops = choose(self.embed.weight)
        engram = EngramInputs(engram_rows, engram_sums(self.layers, engram_rows, step.ctx), dead)
        x = ops.gather_rows(self.embed.weight, ids, self.config.hc_mult)  # [T, hc, D]: the embedding on every stream
        s = Streams(x, self._first_mix(ids.shape[0], ids.device))
        last = self.layers[-1]
        for block, next_block in pairwise([*self.layers, None]):
            s = yield from block.stages(s, next_block, step, engram, keep if block is last else None,
                                        keep if next_block is last else None)
        return self.norm(ops.collapse(s.x, s.pre), ops)

    def ensure_positions(self, n: int, device: torch.device | str = "cpu") -> None:
        """Rope tables for positions 0 .. n - 1 on `device` (grown once, before serving)."""
        self.rope_plain.ensure(n, device)
        self.rope_comp.ensure(n, device)

    def matmul_params(self):
        """(module, parameter name, input dims) of every weight `linear` multiplies by (layers.layout_weights_)."""
        return block_matmul_params(self, Block)

    def matmul_weights(self) -> list[torch.Tensor]:
        """The 2-D weights `linear` multiplies by, as the forward views them (layers.pad_rows)."""
        out, ol = [], self.config.o_lora_rank
        out += [w for m in self.modules() if isinstance(m, MoE) and m.stored is not None for w in m.stored.probes()]
        wo_a = {id(a.wo_a) for a in self._attentions()}
        for m in self.modules():
            if isinstance(m, Linear) and m.stored is not None:  # (as stored: the float weight of its plan)
                w = m.rows(0, ol) if id(m) in wo_a else m.w
                out.append(w.probe() if isinstance(w, StoredWeight) else w)
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
        w = self.embed.weight if self.head is None else self.head.w
        return linear(hidden, w).float()

    def forward_dense(self, input_ids: torch.Tensor, engram_rows: list[torch.Tensor] | None,
                      dead: torch.Tensor | None = None, features: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Full sequences input_ids [B, S] at positions 0..S-1 -> logits [B, S, V] float32, through the
        serving code over a fresh cache (sequence b owns slots b*S .. b*S + S - 1). engram_rows[i]
        [B, S, C, hd] (None: Engram ablated); dead [B, S] bool. With `features` (a config with a drafter),
        (logits, the drafter's features [B, S, nL D])."""
        b, s = input_ids.shape
        dev = input_ids.device
        cache = PagedState(self.config, b, s, device=dev, dtype=self.embed.weight.dtype)
        positions = torch.arange(s, device=dev).repeat(b)
        rows = torch.arange(b, device=dev).repeat_interleave(s)
        step = self.make_step(cache, positions, rows, torch.arange(b, device=dev)[:, None], s,
                              rows * s + positions)
        fn = None if engram_rows is None else (lambda i: engram_rows[i].reshape(b * s, *engram_rows[i].shape[2:]))
        if features:
            step.capture = tuple(self.config.dspark.dspark_target_layer_ids)
        gen = self.forward_stages(input_ids.reshape(-1), None if dead is None else dead.reshape(-1), step, fn)
        logits = self.compute_logits(run_stages(gen)).view(b, s, -1)
        return (logits, step.features.view(b, s, -1)) if features else logits

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
                       rotary=self.rotary(positions, top), ops=choose(self.embed.weight))


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


INIT_ONES = ("norm.weight", "_scale", ".q_weight", ".k_weight")  # parameters a random model starts at 1
INIT_ZEROS = ("_base", "attn_sink", "gate.bias")  # and at 0 (`init_weights`, model/random_writer.py)


def init_weights(model: DeepseekV41, seed: int, std: float = 0.02) -> DeepseekV41:
    """Deterministic random init: norms, mHC scales and Engram q/k weights at 1; mHC bases, sinks and the
    router bias at 0; embeddings N(0, 1); every other matrix N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(INIT_ONES):
                p.fill_(1.0)
            elif name.endswith(INIT_ZEROS):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "embed.weight" else std))
    return model
