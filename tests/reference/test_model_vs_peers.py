"""engram-serve's DeepSeek-V4.1 model against the public implementations (tests/reference/peers_v41.py), on random
scaled-down checkpoints with every layer role: mlx-lm 0.32.2 on the backbone (it has no Engram) and NeMo
Automodel 0.7.0 with Engram on two layers, both in float32 with their cache-quantization emulation
switched off. Acceptance: max |d logprob| <= 1e-4 at every position (the configs keep top-k boundaries
clear of ties: 8 index heads) and equal greedy tokens. Skips with the install line without the peers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_serve.config import ModelConfig
from engram_serve.engram.hashing import hash_step
from engram_serve.engram.layout import build_layout
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.model.deepseek_v41 import DeepseekV41
from engram_serve.model.loader import model_state_from_official
from peers_v41 import mlx_logits, nemo_logits
from peer_model import TOKENIZER, prompt_ids, random_weights, small_config

TOL = 1e-4


def ours(config: dict, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Our model's logits [S, V] for weights under the official names (hash ids from our hash)."""
    cfg = ModelConfig.from_dict(config)
    model = DeepseekV41(cfg)
    model.load_state_dict(model_state_from_official(model, weights))
    model.requires_grad_(False)
    rows = None
    if cfg.engram.engram_layer_ids:
        tm = build_token_map(load_tokenizer(TOKENIZER), cfg.engram.engram_compressed_vocab_size)
        h = hash_step(torch.tensor(ids), torch.tensor([0, len(ids)]), torch.full((1, cfg.engram.history_len), -1),
                      build_layout(cfg.engram), tm, int(tm[cfg.engram.engram_pad_token_id]))
        rows = [weights[f"layers.{l}.engram.embed.weight"][h[:, i]][None]
                for i, l in enumerate(cfg.engram.engram_layer_ids)]
    return model.forward_dense(torch.tensor([ids]), rows)[0]


def logprobs(x) -> torch.Tensor:
    return torch.log_softmax(torch.as_tensor(np.asarray(x)).double(), -1)


def compare(a: torch.Tensor, b) -> tuple[float, bool]:
    a, b = logprobs(a), logprobs(b)
    return (a - b).abs().max().item(), bool((a.argmax(-1) == b.argmax(-1)).all())


@pytest.mark.parametrize("seed", [0, 1])
def test_backbone_agrees_with_mlx_lm(seed):
    config = small_config()
    weights, ids = random_weights(config, seed), prompt_ids(config, seed)
    peer = mlx_logits(config, weights, ids)
    diff, greedy = compare(ours(config, weights, ids), peer)
    assert diff <= TOL and greedy, (diff, greedy)


@pytest.mark.parametrize("seed", [0, 1])
def test_with_engram_agrees_with_nemo(seed):
    config = small_config(engram_layer_ids=[2, 4])
    weights, ids = random_weights(config, seed), prompt_ids(config, seed)
    peer = nemo_logits(config, weights, ids, TOKENIZER)
    diff, greedy = compare(ours(config, weights, ids), peer)
    assert diff <= TOL and greedy, (diff, greedy)
