"""The DSpark drafter (model/dspark.py) against the float64 reference (tests/reference/reference_v41.py
`reference_draft`): the target's features (the streams entering the target layers, after an Engram gate), the
context written through the paged state, the block through the draft layers, the Markov chain over the chosen
tokens. Acceptance: max |d logit| <= 1e-4 on every draft position, random configs (a target layer an Engram layer
included) and random checkpoints stored in FP8 / MXFP4; a row's draft bits do not depend on its batch mates.
Negative controls through the real forward: the Markov term dropped, the embedding on stream 0 alone (the
stream-0 collapse of the first sublayer cannot be seen: see CONTROLS)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from engram_serve.config import ModelConfig, read_json
from engram_serve.errors import ConfigError
from engram_serve.model import dspark as dspark_module
from engram_serve.model.checkpoint import CheckpointFiles
from engram_serve.model.deepseek_v41 import DeepseekV41
from engram_serve.model.dspark import DSpark, DSparkState
from engram_serve.model.loader import load_model, model_state_from_official, read_weight
from engram_serve.model.writer import SMALL_TEXT_CONFIG, Quant, random_v41_checkpoint
from reference_v41 import reference_draft, reference_forward
from v41_fixtures import (FIXED, engram_hash_ids, random_v41_weights, small_v41_config, v41_configs,
                          weight_shapes, with_drafter)

TOL = 1e-4
FLASH = "tests/data/deepseek_v41_flash_config.json"


# ---- config ---------------------------------------------------------------------------------------------
def test_published_config_describes_the_drafter_and_defaults_mean_none():
    cfg = ModelConfig.from_dict(read_json(FLASH))
    ds = cfg.dspark
    assert ds.enabled and ds.num_layers == 3 and ds.dspark_block_size == 5 and ds.dspark_noise_token_id == 128799
    assert ds.dspark_target_layer_ids == (37, 38, 39) and ds.dspark_markov_rank == 256
    assert (ds.dspark_n_routed_experts, ds.dspark_num_experts_per_tok) == (128, 3)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert not ModelConfig.from_dict(small_v41_config()).dspark.enabled  # draft layers named, no target layers
    assert DeepseekV41(ModelConfig.from_dict(small_v41_config())).state_dict().keys().isdisjoint({"mtp.0.attn_norm.weight"})


@pytest.mark.parametrize("edit, pattern", [
    (dict(dspark_block_size=0), r"dspark_block_size=0"),
    (dict(dspark_noise_token_id=48), r"dspark_noise_token_id=48"),
    (dict(dspark_target_layer_ids=[1, 5]), r"dspark_target_layer_ids=\[1, 5\]"),
    (dict(dspark_target_layer_ids=[3, 1]), r"dspark_target_layer_ids=\[3, 1\]"),
    (dict(dspark_target_layer_ids="3"), r"dspark_target_layer_ids='3'"),
    (dict(dspark_num_experts_per_tok=5), r"dspark_num_experts_per_tok=5"),
    (dict(dspark_markov_rank=0), r"dspark_markov_rank=0"),
    (dict(compress_ratios=[0, 1, 2, 2, 0, 0, 1]), r"compress_ratios=.*draft layers"),
    (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers=-1"),
])
def test_bad_drafter_fields_name_field_and_value(edit, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_dict({**with_drafter(small_v41_config()), **edit})


# ---- helpers ----------------------------------------------------------------------------------------------
def build(config: dict, weights: dict) -> tuple[DeepseekV41, DSpark]:
    cfg = ModelConfig.from_dict(config)
    model, drafter = DeepseekV41(cfg), DSpark(cfg)
    for m in (model, drafter):
        m.load_state_dict(model_state_from_official(m, weights))
        m.requires_grad_(False)
    return model, drafter


def features_of(config: dict, model: DeepseekV41, weights: dict, ids: list[int]) -> torch.Tensor:
    hashes = engram_hash_ids(config, ids)
    rows = [weights[f"layers.{l}.engram.embed.weight"][hashes[l]][None] for l in config["engram_layer_ids"]]
    return model.forward_dense(torch.tensor([ids]), rows or None, features=True)[1][0]  # [S, nL D]


def draft_one(model, drafter, features: torch.Tensor, last: int, pick=None, block_size: int = 4):
    """Write the context of positions 0 .. S - 1 (one request, blocks in order) and draft at n = S."""
    n = features.shape[0]
    blocks = -(-(n + drafter.block) // block_size)
    state = DSparkState(drafter.config, blocks, block_size, max_rows=1)
    pos = torch.arange(n)
    drafter.write_context(state, features, pos, pos)
    return drafter.draft(model, state, torch.tensor([last]), torch.tensor([n]), torch.arange(blocks)[None],
                         block_size, pick)


def compare(config, weights, ids, model, drafter, pick=None) -> tuple[float, bool] | None:
    """(max |d logit| (and |d confidence|) of our draft after ids against the reference's (its own features, our chosen tokens), whether
    greedy tokens are the reference's argmax but where its margin is within the tolerance); None where a near tie
    of the reference could flip a float32 choice."""
    ref = reference_forward(config, weights, ids, engram_hash_ids(config, ids),
                            capture=tuple(config["dspark_target_layer_ids"]))
    if ref.tainted(len(ids) - 1):
        return None
    ours = features_of(config, model, weights, ids)
    assert (ours.double() - ref.features).abs().max().item() <= TOL
    last = int(ref.logits[-1].argmax())
    out = draft_one(model, drafter, ours, last, pick)
    rd = reference_draft(config, weights, ref.features, last, len(ids), chosen=out.tokens[0].tolist())
    if rd.near_ties:
        return None
    greedy = pick is not None or all(t == int(rd.logits[j].argmax()) or rd.gaps[j] <= TOL
                                     for j, t in enumerate(out.tokens[0].tolist()))
    diff = (out.logits[0].double() - rd.logits).abs().max().item()
    if rd.confidence is not None:  # the acceptance logits too
        diff = max([diff] + [abs(a - b) for a, b in zip(out.confidence[0].tolist(), rd.confidence)])
    return diff, greedy


def agrees(result) -> bool:
    assert result is not None, "a near tie: pick another seed"
    return result[0] <= TOL and result[1]


# ---- against the reference ------------------------------------------------------------------------------
@st.composite
def drafter_configs(draw):
    base = draw(v41_configs())
    n = base["num_hidden_layers"]
    targets = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
    return with_drafter(base, layers=draw(st.integers(1, 3)), block=draw(st.integers(1, 5)), targets=targets,
                        rank=draw(st.sampled_from([4, 8])), experts=draw(st.integers(2, 4)), per_token=2)


@settings(max_examples=12, deadline=None)
@given(config=drafter_configs(), seed=st.integers(0, 2**16), length=st.integers(1, 14))
def test_draft_matches_the_float64_reference(config, seed, length):
    weights = random_v41_weights(config, seed)
    model, drafter = build(config, weights)
    ids = torch.randint(0, config["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    result = compare(config, weights, ids, model, drafter)
    assume(result is not None)
    assert agrees(result), result


ENGRAM_TARGET = with_drafter(small_v41_config(), layers=3, block=5, targets=(1, 3, 4))  # layers 1, 3: Engram


def test_engram_target_layer_and_a_chosen_pick():
    """Target layers 1 and 3 are Engram layers (the features are taken after their gate); a pick that is not the
    argmax drives the Markov chain (the reference takes the same tokens as prev)."""
    weights = random_v41_weights(ENGRAM_TARGET, 5)
    model, drafter = build(ENGRAM_TARGET, weights)
    ids = torch.randint(0, 48, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    assert agrees(compare(ENGRAM_TARGET, weights, ids, model, drafter))
    argmin = lambda j, z: z.argmin(1)  # noqa: E731
    assert agrees(compare(ENGRAM_TARGET, weights, ids, model, drafter, argmin))


@pytest.mark.parametrize("quant", [Quant(linears=True, experts="fp4", tables=False, bf16=True),
                                   Quant(linears=True, experts="fp8", tables=False)], ids=["mxfp4", "fp8"])
def test_quantized_checkpoint_drafter_matches_the_reference(tmp_path, quant):
    """A random checkpoint with `mtp.*` in the stored formats, loaded as stored, against the reference over the
    dequantized tensors."""
    text = with_drafter(dict(SMALL_TEXT_CONFIG), layers=2, block=4, targets=(3, 6, 7), rank=32, experts=4)
    path = random_v41_checkpoint(tmp_path / "ckpt", text, seed=2, quant=quant, std=0.2)
    loaded = load_model(path, pin_tables=False)
    assert loaded.drafter is not None and loaded.drafter.last.confidence_head is not None
    config = json.loads((path / "config.json").read_text())["text_config"]
    files = CheckpointFiles.open(path)
    weights = {name: read_weight(files, name, list(shape))[0] for name, shape in weight_shapes(config).items()}
    ids = torch.randint(3, 4096, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    result = compare(config, weights, ids, loaded.model, loaded.drafter)
    assert agrees(result), result
    assert load_model(path, pin_tables=False, drafter=False).drafter is None


# ---- batch invariance -----------------------------------------------------------------------------------------
def test_a_rows_draft_bits_do_not_depend_on_its_batch_mates():
    config = ENGRAM_TARGET
    weights = random_v41_weights(config, 7)
    model, drafter = build(config, weights)
    g = torch.Generator().manual_seed(7)
    lengths, bs = [9, 3, 14, 6], 4
    state = DSparkState(drafter.config, 32, bs, max_rows=4)
    tables = torch.full((4, 8), -1, dtype=torch.int64)
    for r, n in enumerate(lengths):  # row r's blocks: 8r .. (reversed, so slots are not in position order)
        need = -(-(n + drafter.block) // bs)
        tables[r, :need] = torch.arange(8 * r + need - 1, 8 * r - 1, -1)
        ids = torch.randint(0, 48, (n,), generator=g).tolist()
        pos = torch.arange(n)
        drafter.write_context(state, features_of(config, model, weights, ids), pos,
                              tables[r, pos // bs] * bs + pos % bs)
    last, positions = torch.tensor([5, 17, 30, 2]), torch.tensor(lengths)
    together = drafter.draft(model, state, last, positions, tables, bs)
    for r in range(4):
        alone = drafter.draft(model, state, last[r:r + 1], positions[r:r + 1], tables[r:r + 1], bs)
        assert torch.equal(alone.logits[0], together.logits[r]) and torch.equal(alone.tokens[0], together.tokens[r])
    order = torch.tensor([2, 0, 3, 1])
    mixed = drafter.draft(model, state, last[order], positions[order], tables[order], bs)
    assert torch.equal(mixed.logits, together.logits[order])


# ---- negative controls ----------------------------------------------------------------------------------------
CONTROLS = {
    "markov term": lambda mp, d: mp.setattr(d.last.markov_head.head.weight, "data",
                                            torch.zeros_like(d.last.markov_head.head.weight)),
    # The first sublayer's stream-0 collapse itself is invisible: every stream holds the embedding, so any collapse
    # is a multiple of it, and the RMSNorm after it removes the factor. What the streams hold is visible:
    "embedding on every stream": lambda mp, d: mp.setattr(d, "streams", lambda target, ids, ops: torch.cat(
        [target.embed.weight[ids][:, None], target.embed.weight.new_zeros(len(ids), d.config.hc_mult - 1,
                                                                          d.config.hidden_size)], 1)),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_drafter_component_is_seen_by_the_reference(name, monkeypatch):
    config = with_drafter(small_v41_config(hc_mult=3), layers=2, block=4, targets=(2, 4))
    weights = random_v41_weights(config, 3)
    model, drafter = build(config, weights)
    ids = torch.randint(0, 48, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    assert agrees(compare(config, weights, ids, model, drafter))  # intact: green
    CONTROLS[name](monkeypatch, drafter)
    assert compare(config, weights, ids, model, drafter)[0] > 1e-3, name
