"""The built-in model's trained DSpark drafter and what produced it (engram_serve/train_drafter.py,
engram_serve/bench/acceptance.py): the shipped drafter against the float64 reference on held-out code; the
training step lowers the drafter's loss and leaves the target's bits alone (negative control: the target's
embedding and head in the optimizer); the acceptance replay counts an oracle's drafts as k + 1 tokens a verify
step and a drafter that only proposes the noise token as 1."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engram_serve import train as T
from engram_serve.bench import acceptance as A
from engram_serve.config import ModelConfig
from engram_serve.model.checkpoint import CheckpointFiles
from engram_serve.model.deepseek_v41 import DeepseekV41, init_weights
from engram_serve.model.loader import TINY_DIR, load_model, read_weight
from engram_serve.train_drafter import (TINY_DSPARK, DrafterSettings, drafter_loss, make_optimizer, new_drafter,
                                        param_digest, sample_anchors, teacher, train_step)
from test_dspark import agrees, compare
from v41_fixtures import small_v41_config, weight_shapes, with_drafter


@pytest.fixture(scope="module")
def shipped():
    return load_model(pin_tables=False)


def test_the_built_in_checkpoint_ships_the_drafter_its_config_describes(shipped):
    text = json.loads((TINY_DIR / "config.json").read_text())["text_config"]
    assert {k: text[k] for k in TINY_DSPARK} == TINY_DSPARK
    assert shipped.drafter is not None and shipped.drafter.last.confidence_head is not None
    assert shipped.tokenizer.id_to_token(TINY_DSPARK["dspark_noise_token_id"]) == "<|image|>"


def test_shipped_drafts_on_held_out_code_match_the_float64_reference(shipped):
    """Drafts after a snippet of the first held-out file: the dequantized checkpoint through the reference."""
    held = T.split_files(T.source_files())[1]
    ids = T.tokenize_files(shipped.tokenizer, T.stdlib_root(), held[:1])[0][100:124].tolist()
    config = json.loads((TINY_DIR / "config.json").read_text())["text_config"]
    files = CheckpointFiles.open(TINY_DIR)
    tables = {f"layers.{l}.engram.embed.weight": t for l, t in zip(shipped.tables.layer_ids, shipped.tables.tables)}
    weights = {name: tables[name].dequantize() if name in tables else read_weight(files, name, list(shape))[0]
               for name, shape in weight_shapes(config).items()}  # (FP8 Engram rows: the loaded tables' decoder)
    assert agrees(compare(config, weights, ids, shipped.model, shipped.drafter))


# ---- training ---------------------------------------------------------------------------------------------------
SMALL = with_drafter(small_v41_config(), layers=1, block=3, targets=(2, 4), rank=8, experts=2, per_token=1)


def small_run(train_embedding_head: bool):
    """A random float target, a fresh drafter, 6 steps on one fixed batch: (loss before, after, target digest
    before, after)."""
    cfg = ModelConfig.from_dict(SMALL)
    target = init_weights(DeepseekV41(cfg), 3, 0.1).eval().requires_grad_(False)
    s = DrafterSettings(batch_size=2, seq_len=20, anchors=4, lr=1e-2, warmup_steps=1, steps=6,
                        train_embedding_head=train_embedding_head)
    drafter = new_drafter(cfg, s)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, 20), generator=g)
    anchors = torch.from_numpy(sample_anchors(np.random.default_rng(0), 2, 20, drafter.block, 4))
    with torch.no_grad():
        first = float(drafter_loss(target, drafter, x, anchors, teacher(target, x, None), s)[0])
    before = param_digest(target)
    opt = make_optimizer(drafter, target, s)
    for step in range(s.steps):
        train_step(target, drafter, opt, x, anchors, None, s, step)
    with torch.no_grad():
        last = float(drafter_loss(target, drafter, x, anchors, teacher(target, x, None), s)[0])
    return first, last, before, param_digest(target)


def test_a_training_step_lowers_the_drafter_loss_and_leaves_the_target_bits():
    first, last, before, after = small_run(train_embedding_head=False)
    assert last < first - 0.05, (first, last)
    assert after == before


def test_negative_control_with_the_embedding_and_head_trained_the_target_changes():
    *_, before, after = small_run(train_embedding_head=True)
    assert after != before


# ---- the acceptance replay --------------------------------------------------------------------------------------
def test_walk_counts_runs_of_matching_drafts():
    picks = np.arange(20)  # the target's token for position p + 1 is p
    drafts = np.full((20, 3), -1)
    drafts[2] = [2, 3, 9]  # 2 accepted: next step at 5
    drafts[5] = [5, 6, 7]  # all 3: next at 9
    drafts[9] = [0, 0, 0]  # none: next at 10
    w = A.walk(drafts, picks, 2, 3)
    assert w.accepted[:3] == [2, 3, 0] and sum(1 for _ in w.accepted) == 3 + (20 - 10 - 3)
    row = A.summarize([w], 3)
    assert row["steps"] == len(w.accepted) and row["rate@1"] == pytest.approx(2 / len(w.accepted))


def oracle(lm, feats, ids, positions, pick):
    """The drafts a perfect drafter makes: the committed sequence's next k tokens."""
    k, seq = lm.drafter.block, torch.tensor(ids)
    return torch.stack([seq[positions + 1 + j] for j in range(k)], 1)


def noise(lm, feats, ids, positions, pick):
    return torch.full((positions.shape[0], lm.drafter.block), lm.drafter.noise, dtype=torch.int64)


def test_an_oracle_drafter_gets_k_plus_1_and_the_noise_token_gets_1(shipped):
    prompts = A.heldout_prompts(shipped.tokenizer, count=2, length=24, max_files=400)
    k = shipped.config.dspark.dspark_block_size
    for t in (0.0, 0.7):
        best, = A.measure(shipped, prompts, tokens=24, temperatures=(t,), drafts=oracle)
        worst, = A.measure(shipped, prompts, tokens=24, temperatures=(t,), drafts=noise)
        assert best["mean_len"] == k + 1 and best[f"rate@{k}"] == 1.0, best
        assert worst["mean_len"] == 1.0 and worst["rate@1"] == 0.0, worst
