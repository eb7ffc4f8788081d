"""`shard_model`: turn a loaded (unsharded) model into rank r's shard of an N-way tensor-parallel model
by module replacement. The model code is untouched and reads the same at any parallel size:

    attention   the fused q/k/v projection split by heads (column parallel: rank r has heads
                [r*H/N, (r+1)*H/N) and kv heads [r*KV/N, ...), so each GQA group stays on one rank);
                o_proj -> RowParallelLinear (cross-rank sum); heads / kv_heads set to the local counts;
                index-selecting layers get a head_mean hook (q.k averaged over every rank's heads)
    dense MLP   the fused gate/up projection split by output (column parallel); down_proj -> RowParallelLinear
    MoE         -> ExpertParallelMoE (experts split; router replicated)
    Engram      wkv -> PartialInputLinear; the tables -> ShardedEngramTables (rows split)
    replicated  embeddings, norms, lm_head, Engram q_weight / k_weight (small)

The returned LoadedModel's config carries the LOCAL head counts (the KV cache is sized from it).
"""
from __future__ import annotations

import dataclasses

from ..model.layers import MoE, layout_weights_
from ..model.loader import LoadedModel
from .group import ParallelGroup
from .layers import (ExpertParallelMoE, PartialInputLinear, RowParallelLinear, column_parallel_mlp,
                     column_parallel_qkv, head_mean_hook)
from .tables import ShardedEngramTables


def check_divisible(cfg, world: int) -> None:
    """ConfigError-style ValueError naming the field when the model cannot be split `world` ways."""
    from ..errors import ConfigError
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(cfg, name)
        if v % world:
            raise ConfigError(f"--tensor-parallel-size {world}: {name}={v} is not divisible by {world}")
    if cfg.moe_layer_ids and cfg.n_routed_experts % world:
        raise ConfigError(f"--tensor-parallel-size {world}: n_routed_experts={cfg.n_routed_experts} is not "
                          f"divisible by {world}")


def shard_model(loaded: LoadedModel, group: ParallelGroup, pin_tables: bool | None = None) -> LoadedModel:
    cfg, world, rank = loaded.config, group.world, group.rank
    check_divisible(cfg, world)
    model = loaded.model
    for layer in model.layers:
        at = layer.attn
        column_parallel_qkv(at, rank, world)
        at.o_proj = RowParallelLinear(at.o_proj, group, f"layer{layer.layer_id}.attn")
        if layer.layer_id in cfg.index_layer_ids:
            at.head_mean = head_mean_hook(group, cfg.num_attention_heads)
        if isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, group)
        else:
            column_parallel_mlp(layer.mlp, rank, world)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group, f"layer{layer.layer_id}.mlp")
        if layer.engram is not None:
            layer.engram.wkv = PartialInputLinear(layer.engram.wkv, group, f"layer{layer.layer_id}.engram")
    layout_weights_(model)  # the shards are fresh copies: input-major again (the row rule, model/exactness.py)
    model.to(group.device)
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                                num_key_value_heads=cfg.num_key_value_heads // world)
    tables = ShardedEngramTables(loaded.tables, rank, world, pin=pin_tables)
    return dataclasses.replace(loaded, config=local, model=model, tables=tables)
