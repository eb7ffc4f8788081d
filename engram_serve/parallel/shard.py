"""`shard_model`: turn a loaded (unsharded) DeepSeek-V4.1 model into rank r's shard of an N-way
tensor-parallel model by module replacement. The model code is untouched and reads the same at any
parallel size:

    attention   heads split (rank r: heads [r*H/N, (r+1)*H/N), their rows of `wq_b` and their sinks) with
                whole output groups (`wo_a`'s blocks); `wo_b` -> RowParallelLinear (cross-rank sum).
                Replicated: the MQA latent (`wq_a`, `q_norm`, `wkv`, `kv_norm`), the compressor and the
                indexer (every rank computes them: their state must be whole on every rank)
    MoE         -> ExpertParallelMoE (routed experts split, the shared expert split by its intermediate
                dimension, router replicated; one cross-rank sum at combine)
    Engram      wkv -> PartialInputLinear; the tables -> ShardedEngramTables (rows split, FP8 kept)
    replicated  embeddings, norms, mHC, head, Engram q_weight / k_weight (small)
"""
from __future__ import annotations

import dataclasses

from ..model.layers import layout_weights_
from ..model.loader import LoadedModel
from .group import ParallelGroup
from .layers import ExpertParallelMoE, PartialInputLinear, shard_attention
from .tables import ShardedEngramTables


def check_divisible(cfg, world: int) -> None:
    """ConfigError naming the field when the model cannot be split `world` ways."""
    from ..errors import ConfigError
    for name in ("num_attention_heads", "o_groups", "n_routed_experts", "moe_intermediate_size"):
        v = getattr(cfg, name)
        if v % world:
            raise ConfigError(f"--tensor-parallel-size {world}: {name}={v} is not divisible by {world}")


def shard_model(loaded: LoadedModel, group: ParallelGroup, pin_tables: bool | None = None) -> LoadedModel:
    check_divisible(loaded.config, group.world)
    model = loaded.model
    for blk in model.layers:
        lid = blk.role.layer
        shard_attention(blk.attn, group, f"layer{lid}.attn")
        blk.ffn = ExpertParallelMoE(blk.ffn, group, f"layer{lid}.moe")
        if blk.engram is not None:
            blk.engram.wkv = PartialInputLinear(blk.engram.wkv, group, f"layer{lid}.engram")
    layout_weights_(model)  # the shards are fresh copies: input-major again (model/exactness.py)
    model.to(group.device)
    tables = ShardedEngramTables(loaded.tables, group.rank, group.world, pin=pin_tables)
    return dataclasses.replace(loaded, model=model, tables=tables)
