"""The two public DeepSeek-V4.1 implementations agree with each other (tests/reference/peers_v41.py).

Before either peer serves as an oracle for engram-serve's model, they are checked against each
other on the backbone of a small random model that has every layer role: window-only layers
(ratio 0), ratio-2 and ratio-1 kv sources, an index source whose top-k a later layer reuses, a
candidate source and an index source restricted to its candidates, hc_mult 4, routed experts with
a shared expert. The prompt is longer than the window and than index_topk * ratio, and a control
shows that the indexer really selects (changing its weights changes the logits). NeMo with Engram
on one layer must differ from NeMo without (Engram ran).

Skips, with the install command, unless both peers are installed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from peers_v41 import mlx_logits, nemo_logits
from peer_model import PROMPT_LEN, TOKENIZER, prompt_ids, random_weights, small_config

def _logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _clear_positions(logprobs: np.ndarray, margin: float) -> np.ndarray:
    """Positions whose best two tokens are more than `margin` apart (no near tie for greedy)."""
    top2 = np.sort(logprobs, axis=-1)[:, -2:]
    return np.flatnonzero(top2[:, 1] - top2[:, 0] > margin)


@pytest.fixture(scope="module")
def backbone():
    config = small_config()
    return config, random_weights(config, seed=1), prompt_ids(config, seed=2)


@pytest.fixture(scope="module")
def peer_logprobs(backbone):
    config, weights, prompt = backbone
    nemo = _logprobs(nemo_logits(config, weights, prompt, TOKENIZER))
    mlx = _logprobs(mlx_logits(config, weights, prompt))
    return nemo, mlx


def test_nemo_and_mlx_agree_on_the_backbone(peer_logprobs):
    nemo, mlx = peer_logprobs
    assert nemo.shape == mlx.shape == (PROMPT_LEN, 4096)
    delta = np.abs(nemo - mlx).max(-1)                                    # [S]
    clear = _clear_positions(nemo, margin=1e-3)
    print(f"\nmax |dlogprob| {delta.max():.3e} (median over positions {np.median(delta):.3e}); "
          f"{len(clear)}/{PROMPT_LEN} positions clear of a near tie")
    assert delta.max() < 1e-3
    assert len(clear) >= PROMPT_LEN - 2
    np.testing.assert_array_equal(nemo[clear].argmax(-1), mlx[clear].argmax(-1))


def test_the_indexer_selects(backbone, peer_logprobs):
    """Negating one index source's head weights changes the logits: the prompt is long enough
    that every index source's top-k leaves entries out, so the agreement above covers selection."""
    config, weights, prompt = backbone
    _, mlx = peer_logprobs
    for layer in config["index_source_layer_ids"]:
        changed = dict(weights)
        name = f"layers.{layer}.attn.indexer.weights_proj.weight"
        changed[name] = -weights[name]
        moved = np.abs(_logprobs(mlx_logits(config, changed, prompt)) - mlx).max()
        print(f"\nlayer {layer}: indexer weights negated, mlx max |dlogprob| {moved:.3e}")
        assert moved > 1e-2, f"layer {layer}'s indexer selects nothing the prompt could miss"


def test_nemo_engram_changes_the_logits(backbone, peer_logprobs):
    config, weights, prompt = backbone
    nemo, _ = peer_logprobs
    engram_config = small_config(engram_layer_ids=[2])
    engram_weights = {**weights, **{k: v for k, v in random_weights(engram_config, seed=1).items()
                                    if ".engram." in k}}
    with_engram = _logprobs(nemo_logits(engram_config, engram_weights, prompt, TOKENIZER))
    moved = np.abs(with_engram - nemo).max(-1)                            # [S]
    print(f"\nEngram on layer 2: NeMo max |dlogprob| {moved.max():.3e}, min over positions {moved.min():.3e}")
    assert moved.min() > 1e-3


def test_known_difference_fewer_candidates_than_topk(backbone):
    """With one candidate block of 2 entries and index_topk 4, layer 4 has fewer candidate entries
    than picks from position 2 on: NeMo leaves the rest empty (docs/deepseek_v41.md's decision),
    mlx fills them with visible entries outside the candidates. The peers agree before it."""
    config, _, prompt = backbone
    short = small_config(candidate_topk_blocks=1)
    weights = random_weights(short, seed=1)
    delta = np.abs(_logprobs(nemo_logits(short, weights, prompt, TOKENIZER))
                   - _logprobs(mlx_logits(short, weights, prompt))).max(-1)  # [S]
    print(f"\none candidate block: max |dlogprob| {delta[:2].max():.3e} at positions 0-1, "
          f"{delta[2]:.3e} at position 2")
    assert delta[:2].max() < 1e-4
    assert delta[2] > 1e-2
