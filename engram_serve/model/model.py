"""The config-driven Engram decoder (docs/contract.md §7, DeepSeek-V4.1 form).

Residual stream h [T, hc_mult, hidden] (hyper-connection branches; hc_mult=1 is a plain transformer).
Per layer:
  (a) Engram layers: h_i += gate_i * value from the staged table rows (engram/layer.py);
  (b) attention on rmsnorm(mean_i h_i), output added to every branch;
  (c) SwiGLU MLP, or a top-k MoE on moe_layer_ids, on rmsnorm(mean_i h_i), added to every branch.
Final hidden = rmsnorm(mean_i h_i); logits = lm_head(hidden) in float32.

`stages(ctx)` is the serving forward of one microbatch as a generator that yields a stage name at each
overlap point; `forward_dense` runs the same layers (same weights, same math) over [B, S] sequences.
Yield points are data-independent, so two microbatches stepped round-robin stay in lock step:
microbatch k finishes layer L's KV writes before microbatch k+1 runs layer L's attention.
"""
from __future__ import annotations

from collections.abc import Callable, Generator

import torch
from torch import nn

from ..config import ModelConfig
from ..engram.layer import EngramGate
from ..errors import StaticBufferError
from . import fused
from .attention import FULL, REUSE, SELECT, Attention, DenseAttention, PagedAttention
from .context import ForwardContext
from .layers import MLP, Linear, MoE, RMSNorm, RotaryTable, linear

STAGE_ENGRAM_GATHER, STAGE_ENGRAM, STAGE_ATTN = "engram_gather", "engram", "attn"
STAGE_MOE_DISPATCH, STAGE_MOE_COMBINE = "moe_dispatch", "moe_combine"
STAGE_MLP = "mlp"  # only under tensor parallelism: the dense MLP's cross-rank sum


def _collective_point(x: torch.Tensor, module, stage: str, ctx: ForwardContext | None
                      ) -> Generator[str, None, torch.Tensor]:
    """Yield `stage`, returning x. If `module` produced x as a per-rank partial sum (tensor parallel:
    it has `launch_reduce`), the cross-rank sum is launched before the yield and awaited after it, so
    it is in flight while the other microbatch runs its next stage; returns the sum."""
    launch = getattr(module, "launch_reduce", None)
    if launch is None:
        yield stage
        return x
    pending = launch(x, ctx)
    yield stage
    return pending.wait()


def _launch_engram_sums(layers, engram_rows, ctx: ForwardContext | None):
    """Tensor parallel only (each `wkv` has `launch_reduce`): an Engram projection depends on the staged
    rows alone, so every Engram layer's partial projection (this rank's table shard) is computed at the
    start of the forward and all are summed across ranks in ONE collective, in flight while both
    microbatches run the layers before the first Engram layer. Returns `kv(engram_index)` (waits on
    the first call), or None (one process, or Engram ablated)."""
    layers = sorted((l for l in layers if l.engram is not None), key=lambda l: l.engram_index)
    if engram_rows is None or not layers or not hasattr(layers[0].engram.wkv, "launch_reduce"):
        return None
    parts = []
    for layer in layers:
        rows = engram_rows(layer.engram_index)  # [N, C, hd]
        if ctx is not None:
            ctx.touch("staging", rows)
        parts.append(layer.engram.project(rows))  # [N, (hc+1)*hidden] partial
    wkv = layers[0].engram.wkv
    pending = wkv.launch_reduce(torch.cat(parts, 1), ctx, wkv.early_buffer)
    width, summed = parts[0].shape[1], []

    def kv(i: int) -> torch.Tensor:
        if not summed:
            summed.append(pending.wait())  # [N, L_e*(hc+1)*hidden]
        return summed[0][:, i * width:(i + 1) * width]
    return kv


def run_stages(gen: Generator):
    """Drive a stage generator (a forward, or a layer's `stages`) to completion; returns its value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        e = cfg.engram
        self.layer_id = layer_id
        self.engram_index = e.engram_layer_ids.index(layer_id) if layer_id in e.engram_layer_ids else None
        self.engram = (EngramGate(cfg.hidden_size, cfg.hc_mult, e.num_columns, e.engram_head_dim, cfg.rms_norm_eps)
                       if self.engram_index is not None else None)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = layer_id in cfg.moe_layer_ids
        self.mlp = (MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok)
                    if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size))
        # a selecting layer picks its own keys; the layer after a selecting one reuses them
        if layer_id in cfg.index_layer_ids:
            self.attn_mode = SELECT
        elif layer_id - 1 in cfg.index_layer_ids:
            self.attn_mode = REUSE
        else:
            self.attn_mode = FULL


class EngramModel(nn.Module):
    paged_attention = PagedAttention  # the serving attention backend (a test may swap in a subclass)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta)  # the serving runner ensures max_model_len

    # ---- shared layer loop -------------------------------------------------------------------
    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, dead: torch.Tensor | None, backend,
             engram_rows: Callable[[int], torch.Tensor] | None, ctx: ForwardContext | None
             ) -> Generator[str, None, torch.Tensor]:
        cfg = self.config
        cos, sin = self.rotary(positions)  # once per forward
        h = fused.gather_rows(self.embed_tokens.weight, input_ids, cfg.hc_mult)  # [N, hc, H]
        early = _launch_engram_sums(self.layers, engram_rows, ctx)  # tensor parallel only
        delta = None  # the previous block's output [N, hidden], added to every branch with the next norm
        for layer in self.layers:
            if layer.engram is not None:
                h, delta = fused.add_branches(h, delta), None
                yield STAGE_ENGRAM_GATHER
                if early is not None:
                    h = layer.engram.apply(h, early(layer.engram_index), dead)
                elif engram_rows is not None:  # None: Engram ablated (dense path only)
                    rows = engram_rows(layer.engram_index)  # [N, C, hd]; may wait for the gather
                    if ctx is not None:
                        ctx.touch("staging", rows)
                    h = layer.engram(h, rows, dead)
                yield STAGE_ENGRAM
            h, x = fused.residual_norm(h, delta, layer.attn_norm.weight, layer.attn_norm.eps)
            a = layer.attn(x, cos, sin, backend, layer.layer_id, layer.attn_mode, cfg.index_topk)
            a = yield from _collective_point(a, layer.attn.o_proj, STAGE_ATTN, ctx)
            h, x = fused.residual_norm(h, a, layer.mlp_norm.weight, layer.mlp_norm.eps)
            if layer.is_moe:
                delta = yield from layer.mlp.stages(x, ctx)  # (a view of the microbatch's combine buffer:
                # consumed by the next norm, before the next yield)
            else:
                delta = layer.mlp(x)
                if hasattr(layer.mlp.down_proj, "launch_reduce"):  # tensor parallel: one more overlap point
                    delta = yield from _collective_point(delta, layer.mlp.down_proj, STAGE_MLP, ctx)
        return fused.residual_norm(h, delta, self.norm.weight, self.norm.eps)[1]  # [N, hidden]

    # ---- serving path ------------------------------------------------------------------------
    def stages(self, ctx: ForwardContext) -> Generator[str, None, torch.Tensor]:
        """Forward of one microbatch; yields stage names at overlap points, returns hidden [T, hidden]."""
        b = ctx.batch
        if b.num_tokens > ctx.bufs.capacity:
            raise StaticBufferError(f"staging buffer of microbatch {ctx.bufs.microbatch} holds {ctx.bufs.capacity} "
                                    f"tokens; the microbatch has {b.num_tokens}")
        backend = self.paged_attention(ctx)
        return (yield from self._run(b.input_ids.long(), b.positions.long(), b.dead, backend, ctx.engram_rows, ctx))

    def forward_step(self, ctx: ForwardContext) -> torch.Tensor:
        """Run `stages` to completion; returns hidden [T, hidden]."""
        return run_stages(self.stages(ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, w).float()

    # ---- dense (training / reference) path ---------------------------------------------------
    def forward_dense(self, input_ids: torch.Tensor, engram_rows: list[torch.Tensor] | None,
                      dead: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward over input_ids [B, S] at positions 0..S-1 -> logits [B, S, V] float32.

        engram_rows[i] [B, S, C, hd] are the staged rows of Engram layer i; None zeroes every Engram
        output (ablation). dead [B, S] bool marks dead tokens (gate 0)."""
        b, s = input_ids.shape
        dev = input_ids.device
        positions = torch.arange(s, device=dev).repeat(b)  # [B*S]
        self.rotary.ensure(s, dev)
        rows_fn = None
        if engram_rows is not None:
            if len(engram_rows) != self.config.engram.num_layers:
                raise ValueError(f"forward_dense: {len(engram_rows)} Engram row tensors for "
                                 f"{self.config.engram.num_layers} Engram layers")
            rows_fn = lambda i: engram_rows[i].reshape(b * s, *engram_rows[i].shape[2:])  # noqa: E731
        flat_dead = None if dead is None else dead.reshape(-1)
        hidden = run_stages(self._run(input_ids.reshape(-1).long(), positions, flat_dead, DenseAttention(b, s, dev),
                                      rows_fn, None))
        return self.compute_logits(hidden).view(b, s, -1)

    def forward(self, input_ids: torch.Tensor, engram_rows: list[torch.Tensor] | None = None,
                dead: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_dense(input_ids, engram_rows, dead)


def init_weights(model: EngramModel, seed: int, std: float = 0.02) -> EngramModel:
    """Deterministic random init: norms and Engram q_weight/k_weight at 1, everything else N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".q_weight") or name.endswith(".k_weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
