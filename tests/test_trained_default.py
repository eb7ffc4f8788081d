"""The shipped tiny checkpoint: it loads with every check, it has learned Python, and Engram matters.

None of these tests trains the shipped model; the last one runs the training loop for 2 steps on a toy config.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch

from engram_serve import train as T
from engram_serve.config import ModelConfig, flatten_config, read_json
from engram_serve.engram.hashing import reference_hash
from engram_serve.engram.layout import build_layout
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.errors import CheckpointMismatch
from engram_serve.model.loader import TINY_DIR, load_model
from v41_fixtures import small_v41_config, with_tiny_tokenizer

SAMPLE_FILES = 6  # the first held-out files (sorted), a small fixed sample
SAMPLE_WINDOWS = 8
SEQ = 256


@pytest.fixture(scope="module")
def shipped():
    return load_model()  # the default path: the built-in model, every check on


@pytest.fixture(scope="module")
def heldout_sample(shipped) -> np.ndarray:
    """[W, SEQ+1] windows from the first held-out files of this Python's stdlib (never trained on)."""
    train_f, held_f = T.split_files(T.source_files(), T.DEFAULT_SEED, T.DEFAULT_HELDOUT_PCT)
    assert held_f and not set(held_f) & set(train_f)
    docs = T.tokenize_files(shipped.tokenizer, T.stdlib_root(), held_f[:SAMPLE_FILES])
    return T.pick_evenly(T.make_windows(docs, SEQ, shipped.config.eos_token_id), SAMPLE_WINDOWS)


def test_shipped_checkpoint_is_trained_and_complete(shipped):
    cfg = shipped.config
    assert cfg == ModelConfig.from_dict(flatten_config(read_json(TINY_DIR / "config.json")))
    assert shipped.tables.rows_per_layer == list(cfg.engram.engram_num_embeddings)
    assert sum(f.stat().st_size for f in TINY_DIR.glob("*.safetensors")) <= 25 * 2**20
    # trained, not the random init: init_weights puts every norm weight at exactly 1
    norms = [p for n, p in shipped.model.named_parameters() if n.endswith("norm.weight")]
    assert any(not torch.all(p == 1.0) for p in norms)


def _corrupt(src, dst, **fields):
    shutil.copytree(src, dst)
    d = read_json(dst / "config.json")
    d["text_config"].update(fields)
    (dst / "config.json").write_text(json.dumps(d))
    return dst


def test_intact_copy_loads(tmp_path):  # the control for the refusals below
    load_model(_corrupt(TINY_DIR, tmp_path / "copy"))


@pytest.mark.parametrize("field, change, named", [
    ("engram_compressed_vocab_size", lambda v: v + 1, "engram_compressed_vocab_size"),
    ("engram_num_embeddings", lambda v: [v[0] + 1, *v[1:]], "engram_num_embeddings"),
    ("engram_num_embeddings", lambda v: v[::-1], "engram_num_embeddings"),
    ("moe_intermediate_size", lambda v: v * 2, r"ffn\.(shared_)?experts.*the config needs"),
])
def test_corrupted_config_is_refused(tmp_path, field, change, named):
    value = read_json(TINY_DIR / "config.json")["text_config"][field]
    bad = _corrupt(TINY_DIR, tmp_path / "bad", **{field: change(value)})
    with pytest.raises(CheckpointMismatch, match=named):
        load_model(bad)


def test_training_hash_is_the_inference_hash(shipped):
    """WindowHasher (training) equals the contract's plain-loop reference for sequences starting at 0."""
    e = shipped.config.engram
    pad_id = int(shipped.token_map[e.engram_pad_token_id])
    hasher = T.WindowHasher(shipped.layout, shipped.token_map, pad_id)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shipped.config.vocab_size, (3, 17), generator=g)
    got = hasher(ids)  # [B, S, L, C]
    tmap = shipped.token_map.tolist()
    for b in range(ids.shape[0]):
        want = reference_hash(ids[b].tolist(), [False] * ids.shape[1], shipped.layout, tmap, pad_id)
        assert got[b].tolist() == want
    # control: the same windows hashed as one long sequence differ (position 0 is not a row start there)
    flat = hasher(ids.reshape(1, -1))[0].view(3, 17, *got.shape[2:])
    assert not torch.equal(flat[1:], got[1:])


def test_shipped_model_has_learned_and_uses_engram(shipped, heldout_sample):
    on = T.evaluate_loaded(shipped, heldout_sample, batch_size=SAMPLE_WINDOWS)
    off = T.evaluate(shipped.model, None, None, heldout_sample, SAMPLE_WINDOWS, zero_engram=True)
    uniform = math.log(shipped.config.vocab_size)  # 8.32 nats
    assert on < uniform - 3.5, (on, uniform)  # shipped: ~3.96 on this sample
    assert on < off - 0.2, (on, off)  # shipped: ~0.56 apart


def test_baseline_config_matches_parameters():
    cfg = ModelConfig.from_dict(read_json(TINY_DIR / "config.json"))
    base = T.baseline_config(cfg)
    pe, pb = T.count_params(cfg), T.count_params(base)
    assert base.engram.engram_layer_ids == () and pb["engram"] == 0
    assert base.moe_intermediate_size > cfg.moe_intermediate_size and base.moe_intermediate_size % 32 == 0
    assert abs(pb["total"] / pe["total"] - 1) < 0.05, (pe, pb)
    assert pe["engram"] > 0.4 * pe["total"]  # the matching is not trivial: Engram is a big share


def test_heldout_split_is_by_file_and_seeded():
    files = T.source_files()
    tr, he = T.split_files(files, 0, 5.0)
    assert sorted(tr + he) == files and not set(tr) & set(he)
    assert 0.02 < len(he) / len(files) < 0.09
    assert T.split_files(files, 0, 5.0) == (tr, he)
    assert T.split_files(files, 1, 5.0)[1] != he  # the seed matters


def _toy_config(tmp_path):
    """A 5-layer V4.1 config of every layer role, hidden 32, sized for the built-in tokenizer."""
    d = with_tiny_tokenizer(small_v41_config(compress_ratios=[0, 1, 2, 2, 0], num_nextn_predict_layers=0,
                                             engram_layer_ids=[1], sliding_window=8, index_topk=4))
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(d))
    return path


def test_training_loop_smoke(tmp_path):
    s = T.TrainSettings(steps=2, batch_size=2, seq_len=32, warmup_steps=1, eval_every=1, eval_windows=2,
                        max_files=30)
    rep = T.train(tmp_path / "ckpt", s, config_path=_toy_config(tmp_path), report_dir=tmp_path / "docs",
                  progress=False, threads=None, sample_prompt="def f(")
    assert len(rep.engram.train_loss) == 2 and len(rep.baseline.train_loss) == 2
    assert all(math.isfinite(x) for x in rep.engram.eval_loss + rep.baseline.eval_loss + [rep.zeroed_heldout])
    assert abs(rep.baseline.params["total"] / rep.engram.params["total"] - 1) < 0.1  # experts grow by 32 columns
    lm = load_model(tmp_path / "ckpt")
    assert lm.config.engram.engram_layer_ids == (1,)
    assert abs(rep.loaded_heldout - rep.engram.final_heldout) < 1e-3
    assert rep.sample.startswith("def f(")
    assert (tmp_path / "docs" / "TRAINING.md").is_file() and (tmp_path / "docs" / "training_curves.png").is_file()


def test_training_is_reproducible(tmp_path):
    """Same settings: same init, same windows in the same order, same losses; another seed differs."""
    cfg = ModelConfig.from_dict(read_json(_toy_config(tmp_path)))
    rng = np.random.default_rng(0)
    corpus = T.Corpus(rng.integers(0, 4096, (12, 17)), rng.integers(0, 4096, (2, 17)), [], [], 0, 0)
    tmap = build_token_map(load_tokenizer(TINY_DIR / "tokenizer.json"), cfg.engram.engram_compressed_vocab_size)
    hasher = T.WindowHasher(build_layout(cfg.engram), tmap, int(tmap[cfg.engram.engram_pad_token_id]))
    s = T.TrainSettings(steps=3, batch_size=4, seq_len=16, warmup_steps=1, eval_every=3)
    runs = [T.train_model(cfg, corpus, dataclasses.replace(s, seed=seed), "r", hasher, progress=False)[2]
            for seed in (0, 0, 1)]
    assert runs[0].train_loss == runs[1].train_loss
    assert runs[0].train_loss != runs[2].train_loss
