"""DeepSeek-V4.1's per-request state through the runner (the serving path: step batches, microbatch cuts,
per-microbatch buffers, padding), with three protections switched off one at a time; each goes red
through the real forward, and the same comparison passes with the protection on.

  * the shared top-k race (vLLM's failure under dual-batch overlap): ONE top-k buffer for both
    microbatches. The executor runs microbatch 0's index source, then microbatch 1's, which overwrites the
    shared top-k before microbatch 0's consumer layers read it: wrong logits. With `debug_ownership` the
    OwnershipTracker names the buffer ('topk') and both microbatches.
  * a compressor that drops the open group at a cut: a token whose ratio-2 partner ran in the microbatch
    before pools with itself. A cut inside a pair changes the logits; the whole step and a cut between
    pairs do not.
  * windows read past the request's own blocks (slots computed without the block table): a request whose
    blocks are not the first ones reads another request's keys.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_serve.errors import OwnershipError
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model.loader import load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from runner_controls import SharedTopk, read_windows_by_position

LENS = [60, 10, 12]  # the long row first: microbatch 0 sees more entries than microbatch 1 (its ids stay in range)
BLOCK = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    lm = load_model(make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=2))
    cfg = lm.config
    assert LENS[0] > 2 * cfg.index_topk and 2 in cfg.ratios  # the top-k selects; ratio-2 pairs exist
    return lm


def runner_and_batch(loaded, runner_cls=ModelRunner, tables=None, **kw):
    """A runner with two microbatches and one step: prompts of LENS tokens, all sampled. `tables`: each
    row's blocks (default: shuffled, none of them at slot = position)."""
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, num_blocks=32,
                       block_size=BLOCK, microbatch=MicrobatchConfig(2, "tokens", 0, 0, when="always"), **kw)
    r = runner_cls(loaded, cfg)
    rng = np.random.default_rng(0)
    slots = np.array([r.store.add(rng.integers(6, 4096, n).tolist()) for n in LENS])
    if tables is None:
        tables = 31 - np.arange(12).reshape(3, 4)  # blocks handed out from the end of the pool
    b = r.build(slots, np.zeros(3, int), np.array(LENS), tables, np.ones(3, bool))
    return r, b


def test_a_topk_buffer_shared_by_both_microbatches_gives_wrong_logits_and_is_named(loaded):
    r, b = runner_and_batch(loaded)
    whole = r.execute(b, [0, b.num_tokens]).logits
    cut = [0, LENS[0], b.num_tokens]  # microbatch 0: the long row; microbatch 1: the two short ones
    assert torch.equal(r.execute(b, cut).logits, whole)  # own buffers: the cut changes nothing
    bad, b2 = runner_and_batch(loaded, SharedTopk)
    assert torch.equal(bad.execute(b2, [0, b2.num_tokens]).logits, whole)  # one microbatch: nothing shared
    wrong = bad.execute(b2, cut).logits
    assert not torch.equal(wrong[0], whole[0])  # microbatch 0's row read microbatch 1's top-k
    assert torch.equal(wrong[1:], whole[1:])  # microbatch 1 read its own (it wrote last)
    named, b3 = runner_and_batch(loaded, SharedTopk, debug_ownership=True)
    with pytest.raises(OwnershipError, match="buffer 'topk' is owned by microbatch 0 .* touched by microbatch 1"):
        named.execute(b3, cut)


def partner_dropped_at_cut(real):
    """Compressor.partner that pools a token with itself where its partner ran in an earlier forward."""
    def partner(row, step, layer):
        prev = real(row, step, layer)
        here = torch.isin(step.plan.prev_slots, step.plan.slots)  # the partner ran in this forward
        return torch.where(here[:, None], prev, row)
    return staticmethod(partner)


def test_a_dropped_open_group_at_a_cut_inside_a_pair_changes_the_logits(loaded, monkeypatch):
    r, b = runner_and_batch(loaded)
    whole = r.execute(b, [0, b.num_tokens]).logits
    inside, between = [0, 31, b.num_tokens], [0, 30, b.num_tokens]  # token 31 closes the pair {30, 31}
    assert torch.equal(r.execute(b, inside).logits, whole)  # the open group kept: the cut changes nothing
    monkeypatch.setattr(v41.Compressor, "partner", partner_dropped_at_cut(v41.Compressor.partner))
    assert torch.equal(r.execute(b, [0, b.num_tokens]).logits, whole)  # no cut: nothing to drop
    assert torch.equal(r.execute(b, between).logits, whole)  # a cut between pairs: nothing open
    assert not torch.equal(r.execute(b, inside).logits[0], whole[0])


def test_windows_read_past_the_requests_own_blocks_leak_another_requests_keys(loaded, monkeypatch):
    """Request 0 owns the first blocks (its slots are its positions), the others do not: ignoring the block
    table leaves request 0 alone and hands the others request 0's keys."""
    tables = np.arange(12).reshape(3, 4)
    r, b = runner_and_batch(loaded, tables=tables)
    want = r.execute(b, [0, LENS[0], b.num_tokens]).logits
    read_windows_by_position(monkeypatch)
    r2, b2 = runner_and_batch(loaded, tables=tables)
    got = r2.execute(b2, [0, LENS[0], b2.num_tokens]).logits
    assert torch.equal(got[0], want[0])  # its own blocks are slots 0..: reading by position is reading its own
    assert not torch.equal(got[1], want[1]) and not torch.equal(got[2], want[2])
