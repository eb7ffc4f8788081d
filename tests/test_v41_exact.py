"""DeepSeek-V4.1's state under every cut, at the model level: a request's logits are bit-identical whether
its tokens run in one forward or in chunks of any size (cuts inside a ratio-2 pair included), beside any
other requests in any order, on any blocks of the paged cache, with windows and selections that really
bite (prompts longer than the window and than index_topk * ratio, a candidate source in use). A forward asked
for some tokens' outputs alone (`keep`) gives those tokens the same bits and leaves the same cache.

Negative controls, each red through the real forward: a compressor that drops the open group at a cut
(pools a token with itself when its partner ran earlier), windows read from slots past the request's own
blocks (ignoring the block table), and hidden states pruned to the read tokens before the last layer."""
from __future__ import annotations

import dataclasses
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
    logits, outs = run_steps(m, seqs, steps, block, seed)[0], [[] for _ in seqs]
    for step, got in zip(steps, logits):
        for (r, k), part in zip(step, got.split([k for _, k in step])):
            outs[r].append(part)
    return [torch.cat(o) for o in outs]


def run_steps(m: DeepseekV41, seqs: list[torch.Tensor], steps: list[list[tuple[int, int]]], block: int = BLOCK,
              seed: int = 0, keeps: list[list[int] | None] | None = None) -> tuple[list[torch.Tensor], PagedState]:
    """`run_schedule`'s steps, each step's forward asked for the logits of its tokens `keeps[i]` alone (None:
    all); returns every step's logits and the cache."""
    cache = PagedState(m.config, 256, block)
    free = list(range(256))
    random.Random(seed).shuffle(free)
    width = 64
    tables = torch.full((len(seqs), width), -1, dtype=torch.long)
    for r, s in enumerate(seqs):
        nb = -(-len(s) // block)
        tables[r, :nb] = torch.tensor([free.pop() for _ in range(nb)])
    done, out = [0] * len(seqs), []
    for i, step in enumerate(steps):
        tb = torch.stack([tables[r] for r, _ in step])
        pos = torch.cat([torch.arange(done[r], done[r] + k) for r, k in step])
        rows = torch.cat([torch.full((k,), j) for j, (_, k) in enumerate(step)])
        ids = torch.cat([seqs[r][done[r]:done[r] + k] for r, k in step])
        st_ = m.make_step(cache, pos, rows, tb, block, tb[rows, pos // block] * block + pos % block)
        keep = None if keeps is None or keeps[i] is None else torch.tensor(keeps[i], dtype=torch.long)
        out.append(m.compute_logits(run_stages(m.forward_stages(ids, None, st_, None, keep))))
        for r, k in step:
            done[r] += k
    return out, cache


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


# The last layer's outputs of tokens no one reads are not computed (`keep`): their keys still are.
LAST_LAYER = {  # the last layer (7) of each model: window only, top-k reused, its own indexer, a compressor
    "window": dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1, 0, 0]),
    "reused top-k": {},
    "indexer": dict(index_source_layer_ids=[1, 3, 4, 6, 7]),
    "compressor": dict(kv_source_layer_ids=[1, 3, 4, 7], index_source_layer_ids=[1, 3, 4, 6, 7]),
    "pair compressor": dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1, 2, 0], kv_source_layer_ids=[1, 3, 4, 7],
                            index_source_layer_ids=[1, 3, 4, 6, 7], candidate_source_layer_id=-1),
}


@pytest.fixture(scope="module")
def last_layer_models() -> dict[str, DeepseekV41]:
    return {name: make_model(**over) for name, over in LAST_LAYER.items()}


def pools(cache: PagedState) -> list[torch.Tensor]:
    return [*cache.window, *cache.entries.values(), *cache.index_keys.values(), *cache.open.values()]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(role=st.sampled_from(sorted(LAST_LAYER)), lens=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_a_forward_of_some_tokens_gives_their_bits_and_stores_every_key(last_layer_models, role, lens, seed):
    """Each step asks for a random subset of its tokens (none, some, all): their logits are those of the whole
    forward bit for bit, and the cache after every step is the same bit for bit (later steps read it)."""
    m, rng = last_layer_models[role], random.Random(seed)
    seqs = [torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(lens)]
    steps = random_schedule(lens, rng)
    sizes = [sum(k for _, k in step) for step in steps]
    keeps = [sorted(rng.sample(range(n), rng.randint(0, n))) for n in sizes]
    whole, cache = run_steps(m, seqs, steps, seed=seed)
    some, cache_some = run_steps(m, seqs, steps, seed=seed, keeps=keeps)
    for i, keep in enumerate(keeps):
        assert torch.equal(some[i], whole[i][keep]), (role, i, keep)
    assert all(torch.equal(a, b) for a, b in zip(pools(cache), pools(cache_some))), role


def test_negative_control_last_layer_pruned_before_its_keys(last_layer_models, monkeypatch):
    """The hidden states pruned to the read tokens before the last layer: the other tokens' last-layer keys are
    never stored, so the read token's own attention (its window) and the next step, which reads them, change."""
    m = last_layer_models["reused top-k"]
    seq = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(3))
    steps, keeps = [[(0, 8)], [(0, 4)]], [[7], None]
    want = run_steps(m, [seq], steps)[0]
    assert all(torch.equal(a, b) for a, b in zip(run_steps(m, [seq], steps, keeps=keeps)[0], [want[0][[7]], want[1]]))
    real = v41.Attention.forward

    def pruned_first(self, x, step, rope_cs, entry_cs, keep=None):
        if keep is None:
            return real(self, x, step, rope_cs, entry_cs)
        pick = (lambda cs: None if cs is None else tuple(c[keep] for c in cs))
        return real(self, x[keep], dataclasses.replace(step, plan=step.plan.rows(keep)), pick(rope_cs), pick(entry_cs))

    monkeypatch.setattr(v41.Attention, "forward", pruned_first)
    got = run_steps(m, [seq], steps, keeps=keeps)[0]
    assert not torch.equal(got[0], want[0][[7]]) and not torch.equal(got[1], want[1])
