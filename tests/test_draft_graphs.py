"""The drafter's CPU graphs (runner/draft_graphs.py): a replayed draft has the eager `DSpark.draft`'s bits (tokens,
logits, confidence) on inputs other than the capture's (other tokens, positions and tables, a window reaching before
position 0 or into a null block), greedy and with a pick of the caller's; a row's bits do not depend on its batch
mates. Negative controls: replays that do not reload their inputs, a capture that does not guard its operators."""
from __future__ import annotations

import pytest
import torch

from engram_serve.model.dspark import DSparkState
from engram_serve.model.loader import load_model
from engram_serve.runner import cpu_graphs, draft_graphs
from engram_serve.runner.draft_graphs import DraftGraphs

BLOCK, BLOCKS = 16, 8  # cache block size, blocks a row (positions 0 .. 127)


@pytest.fixture(scope="module")
def loaded():
    lm = load_model()
    if lm.drafter is None or not cpu_graphs.CpuGraphs.available():
        pytest.skip("the built-in model's drafter and the C kernels are needed")
    return lm


def setup_rows(lm, rows: int, seed: int = 0):
    """A state with every position of `rows` rows written (random features); row r owns blocks r*B .. r*B + B - 1."""
    g = torch.Generator().manual_seed(seed)
    d, cfg = lm.drafter, lm.config
    state = DSparkState(cfg, rows * BLOCKS, BLOCK, max_rows=rows)
    tables = torch.arange(rows * BLOCKS).view(rows, BLOCKS)
    pos = torch.arange(BLOCK * BLOCKS)
    feats = torch.randn(rows, pos.shape[0], len(cfg.dspark.dspark_target_layer_ids) * cfg.hidden_size, generator=g)
    with torch.no_grad():
        for r in range(rows):
            d.write_context(state, feats[r], pos, tables[r, pos // BLOCK] * BLOCK + pos % BLOCK)
    return state, tables


def calls(lm, rows: int, seed: int):
    """(last tokens, positions, tables) of four draft calls: a window inside the context, one reaching before
    position 0, one through a null block, another table width kept (the key's)."""
    state, tables = setup_rows(lm, rows, seed)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for case in range(4):
        last = torch.randint(6, lm.config.vocab_size, (rows,), generator=g)
        n = torch.randint(70, 120, (rows,), generator=g)
        t = tables.clone()
        if case == 1:
            n[0] = 3
        if case == 2:
            t[-1, (n[-1] - 20) // BLOCK] = -1
        out.append((last, n, t))
    return state, out


def sampled_pick(seed: int):
    noise = torch.rand(8, 4096, generator=torch.Generator().manual_seed(seed))
    return lambda j, z: (z + noise[j, :z.shape[1]]).argmax(1)


def same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("greedy", [True, False])
def test_replayed_drafts_have_the_eager_bits(loaded, rows, greedy):
    d, graphs = loaded.drafter, DraftGraphs(loaded.drafter, loaded.model)
    state, cases = calls(loaded, rows, seed=rows)
    with torch.no_grad():
        for i in range(3):  # eager, capture, replays
            for last, n, t in cases:
                pick = None if greedy else sampled_pick(i)
                want = d.draft(loaded.model, state, last, n, t, BLOCK, pick)
                assert same(graphs.draft(state, last, n, t, BLOCK, pick), want), (i, n.tolist())
    assert graphs.captures == 1 and graphs.replays >= 5, (graphs.captures, graphs.replays)


def test_a_rows_replayed_bits_do_not_depend_on_its_batch_mates(loaded):
    graphs = DraftGraphs(loaded.drafter, loaded.model)
    state, cases = calls(loaded, 3, seed=5)
    last, n, t = cases[0]
    with torch.no_grad():
        for _ in range(3):
            many = [x.clone() for x in graphs.draft(state, last, n, t, BLOCK) if x is not None]
            one = [x.clone() for x in graphs.draft(state, last[1:2], n[1:2], t[1:2], BLOCK) if x is not None]
    assert graphs.replays >= 2 and all(torch.equal(a[1:2], b) for a, b in zip(many, one))


class NoReload(DraftGraphs):
    reload = False


def test_negative_control_replays_without_reloading_draft_the_capture_inputs(loaded):
    graphs = NoReload(loaded.drafter, loaded.model)
    state, cases = calls(loaded, 1, seed=7)
    with torch.no_grad():
        for last, n, t in cases[:2]:
            graphs.draft(state, last, n, t, BLOCK)  # eager, then the capture
        last, n, t = cases[2]
        got = graphs.draft(state, last, n, t, BLOCK)
        assert graphs.replays == 1 and not same(got, loaded.drafter.draft(loaded.model, state, last, n, t, BLOCK))


def test_negative_control_an_unguarded_capture_misses_the_slot_plan(loaded, monkeypatch):
    """Without the watch's guard the `+` of the positions is not recorded: replays read the capture's positions."""
    monkeypatch.setattr(draft_graphs._DraftWatch, "guard", False)
    graphs = DraftGraphs(loaded.drafter, loaded.model)
    state, cases = calls(loaded, 1, seed=9)
    with torch.no_grad():
        for last, n, t in cases[:2]:
            graphs.draft(state, last, n, t, BLOCK)
        last, n, t = cases[2]
        assert not same(graphs.draft(state, last, n, t, BLOCK),
                        loaded.drafter.draft(loaded.model, state, last, n, t, BLOCK))


def write_contexts(lm, graphs, eager: bool, calls: int = 4) -> list[torch.Tensor]:
    """Each draft layer's window keys after `calls` writes of 3 tokens (other features, positions and slots each
    time, one a padding slot), eager or through `graphs`."""
    state, _ = setup_rows(lm, 1, seed=11)
    g = torch.Generator().manual_seed(12)
    width = len(lm.config.dspark.dspark_target_layer_ids) * lm.config.hidden_size
    with torch.no_grad():
        for i in range(calls):
            feats = torch.randn(3, width, generator=g)
            pos = torch.randint(0, 120, (3,), generator=g)
            slots = torch.tensor([pos[0], -1, pos[2]])
            if eager:
                lm.drafter.write_context(state, feats, pos, slots)
            else:
                graphs.write_context(state, feats, pos, slots)
    return state.window


def test_replayed_context_writes_store_the_eager_keys(loaded):
    graphs = DraftGraphs(loaded.drafter, loaded.model)
    got = write_contexts(loaded, graphs, eager=False)
    assert graphs.replays == 2 and all(torch.equal(a, b) for a, b in zip(got, write_contexts(loaded, None, True)))


def test_negative_control_context_replays_without_reloading_store_the_capture_keys(loaded):
    graphs = NoReload(loaded.drafter, loaded.model)
    got = write_contexts(loaded, graphs, eager=False)
    assert graphs.replays == 2 and not all(torch.equal(a, b) for a, b in zip(got, write_contexts(loaded, None, True)))
