"""DeepSeek-V4.1's state under every cut, at the model level: a request's logits are bit-identical whether
its tokens run in one forward or in chunks of any size (cuts inside a ratio-2 pair included), beside any
other requests in any order, on any blocks of the paged cache, with windows and selections that really
bite (prompts longer than the window and than index_topk * ratio, a candidate source in use).

Negative controls, each red through the real forward: a compressor that drops the open group at a cut
(pools a token with itself when its partner ran earlier), and windows read from slots past the
request's own blocks (ignoring the block table)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from engram_serve.config import ModelConfig
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model.deepseek_v41 import DeepseekV41, init_weights, run_stages
from engram_serve.model.paged_state import PagedState
from engram_serve.model.writer import SMALL_TEXT_CONFIG, with_engram_rows
from runner_controls import read_windows_by_position

BLOCK = 4  # even block size; a block of 5 in one case puts block boundaries inside pairs


def make_model(seed: int = 0, **over) -> DeepseekV41:
    text = with_engram_rows(dict(SMALL_TEXT_CONFIG, engram_layer_ids=[], sliding_window=5, index_topk=3, **over))
    return init_weights(DeepseekV41(ModelConfig.from_dict(text)), seed, 0.08).requires_grad_(False)


def alone(m: DeepseekV41, seq: torch.Tensor) -> torch.Tensor:
    return m.forward_dense(seq[None], None)[0]


def run_schedule(m: DeepseekV41, seqs: list[torch.Tensor], steps: list[list[tuple[int, int]]], block: int = BLOCK,
                 seed: int = 0) -> list[torch.Tensor]:
    """Run `steps` (each a list of (request, tokens) in batch order) over one paged cache whose blocks are
    handed out in a shuffled order; returns each request's logits, concatenated."""
    cache = PagedState(m.config, 256, block)
    free = list(range(256))
    random.Random(seed).shuffle(free)
    width = 64
    tables = torch.full((len(seqs), width), -1, dtype=torch.long)
    for r, s in enumerate(seqs):
        nb = -(-len(s) // block)
        tables[r, :nb] = torch.tensor([free.pop() for _ in range(nb)])
    done, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in steps:
        tb = torch.stack([tables[r] for r, _ in step])
        pos = torch.cat([torch.arange(done[r], done[r] + k) for r, k in step])
        rows = torch.cat([torch.full((k,), j) for j, (_, k) in enumerate(step)])
        ids = torch.cat([seqs[r][done[r]:done[r] + k] for r, k in step])
        st_ = m.make_step(cache, pos, rows, tb, block, tb[rows, pos // block] * block + pos % block)
        logits = m.compute_logits(run_stages(m.forward_stages(ids, None, st_, None)))
        off = 0
        for r, k in step:
            outs[r].append(logits[off:off + k])
            off, done[r] = off + k, done[r] + k
    return [torch.cat(o) for o in outs]


def random_schedule(lens: list[int], rng: random.Random) -> list[list[tuple[int, int]]]:
    done, steps = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        step = [(r, rng.randint(1, lens[r] - done[r])) for r in range(len(lens)) if done[r] < lens[r]]
        rng.shuffle(step)
        steps.append(step)
        for r, k in step:
            done[r] += k
    return steps


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    return make_model()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_a_row_alone_equals_the_same_row_in_any_batch_and_chunking(model, lens, seed):
    rng = random.Random(seed)
    seqs = [torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(lens)]
    got = run_schedule(model, seqs, random_schedule(lens, rng), seed=seed)
    for r, s in enumerate(seqs):
        assert torch.equal(got[r], alone(model, s)), f"request {r} (len {len(s)})"


def test_the_hard_cases_are_present_and_exact(model):
    """A prompt longer than the window and than index_topk * 2 (selection selects), with the candidate
    source (layer 4) in use, cut at every offset (inside pairs too), in a block size of 5 too."""
    cfg = model.config
    n = 23
    assert n > cfg.sliding_window and n > 2 * cfg.index_topk and cfg.candidate_source_layer_id == 4
    seq = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(5))
    want = alone(model, seq)
    for cut in range(1, n):
        for block in (BLOCK, 5):
            got = run_schedule(model, [seq], [[(0, cut)], [(0, n - cut)]], block=block)[0]
            assert torch.equal(got, want), (cut, block)


def test_selection_really_selects(model):
    """The compressed attention of a long prompt reads fewer entries than are visible (so the top-k and the
    candidate blocks decide something): the top-k of the last token of a 23-token prompt."""
    cfg = model.config
    seq = torch.randint(0, 4096, (23,), generator=torch.Generator().manual_seed(5))
    step = model.make_step(PagedState(cfg, 8, 32), torch.arange(23), torch.zeros(23, dtype=torch.long),
                           torch.tensor([[0]]), 32, torch.arange(23))
    run_stages(model.forward_stages(seq, None, step, None))
    visible = 23  # ratio-1 entries of the last index source's key source
    picked = step.topk[-1]
    assert (picked >= 0).sum() == cfg.index_topk < visible


def test_negative_control_dropped_open_group(model, monkeypatch):
    """A compressor that forgets the open group at a cut (a token whose partner ran in an earlier forward
    pools with itself) leaves the whole run unchanged and changes a run cut inside a pair."""
    seq = torch.randint(0, 4096, (15,), generator=torch.Generator().manual_seed(7))
    want = alone(model, seq)
    real = v41.Compressor.partner

    def partner_dropped_at_cut(row, step, layer):
        prev = real(row, step, layer)
        here = torch.isin(step.plan.prev_slots, step.plan.slots)
        return torch.where(here[:, None], prev, row)

    monkeypatch.setattr(v41.Compressor, "partner", staticmethod(partner_dropped_at_cut))
    assert torch.equal(run_schedule(model, [seq], [[(0, 15)]])[0], want)  # no cut: nothing to drop
    assert torch.equal(run_schedule(model, [seq], [[(0, 8)], [(0, 7)]])[0], want)  # a cut between pairs
    assert not torch.equal(run_schedule(model, [seq], [[(0, 7)], [(0, 8)]])[0], want)  # a cut inside a pair


def test_negative_control_window_past_own_blocks(model, monkeypatch):
    """Window slots computed without the block table (as if a request owned slots 0..) read another
    request's state: the logits of a request sharing the cache change."""
    seqs = [torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = [alone(model, s) for s in seqs]
    read_windows_by_position(monkeypatch)
    got = run_schedule(model, seqs, [[(0, 12), (1, 12)]])
    assert not all(torch.equal(g, w) for g, w in zip(got, want))
