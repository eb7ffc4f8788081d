"""Isolation (docs/contract.md §9) on DeepSeek-V4.1: a non-finite value in one request never reaches another.

200 seeded trials. Each batches good requests with one poisoned request (or with poisoned padding)
under forced microbatch cuts, a small KV pool (so freed blocks are reused at once) and, for padding,
static (graph) buffers. Kinds of poison:
  * embedding: the poisoned prompt holds a token whose embedding row is NaN;
  * kv: after its first step, every slot of the poisoned request's blocks in every pool of the paged
    state (each layer's window, each kv source's compressed entries, index keys and open-group rows) is
    set to NaN or Inf; the blocks are freed with it and handed to later requests with the NaN still
    there (its prompt is its own, so no mate shares those blocks through the prefix cache);
  * engram: the poisoned request's staged Engram rows are NaN;
  * padding: every pool's trash slot, every unallocated block and the static buffers' padding staging
    rows hold NaN (no request is poisoned).
Each trial checks that every good request's tokens equal its run alone, that the poisoned one ends
with `error`, and that the KV pool is empty afterwards. Negative controls, each a slot plan that reads a
slot its token has not written (the stale NaN left in a reused block reaches good requests): windows
one position past the token; compressed entries visible one past the complete ones.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import paged_state
from engram_serve.model.loader import load_model
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from engram_serve.sampling_params import SamplingParams

POISON_TOKEN = 5  # its embedding row is NaN; good prompts never hold it (their ids start at 6)
KINDS = ("embedding", "kv", "engram", "padding")
GEN = 4
CFG = RunnerConfig(max_num_seqs=6, max_model_len=64, max_num_batched_tokens=64, num_blocks=12, block_size=8,
                   microbatch=MicrobatchConfig(2, "tokens", 0, 0, when="always"))
PARAMS = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
POOL = [np.random.default_rng(1000 + i).integers(6, 4096, size=int(n)).tolist()
        for i, n in enumerate(np.random.default_rng(7).integers(1, 40, size=24))]


@pytest.fixture(scope="module")
def loaded():
    lm = load_model()
    with torch.no_grad():
        lm.model.embed.weight[POISON_TOKEN] = float("nan")  # a private copy-on-write page
    return lm


@pytest.fixture(scope="module")
def alone(loaded):
    """Each pool prompt's greedy tokens, run alone."""
    out = []
    for p in POOL:
        engine = LLMEngine(loaded, CFG)
        engine.add_request("a", p, PARAMS)
        toks = []
        while engine.has_unfinished():
            toks += [ev.token for ev in engine.step().events if ev.token is not None]
        engine.close()
        out.append(toks)
    return out


class PoisonedStaging(ModelRunner):
    """Sets the staged Engram rows of one request's tokens to NaN after the gather."""

    poisoned = None  # the poisoned Sequence (its token-store slot is known once it is scheduled)

    def forward(self, batch, ctxs, futures):
        for ctx, f in zip(ctxs, futures):
            f.result()
            if self.poisoned is None or self.poisoned.slot is None:  # not scheduled yet, or ended
                continue
            b = ctx.batch
            rows = torch.repeat_interleave(b.req_slots, torch.from_numpy(np.diff(b.qsl_host)))
            hit = torch.nonzero(rows == self.poisoned.slot).flatten()
            ctx.bufs.staging[:, hit] = float("nan")
        return super().forward(batch, ctxs, futures)


class PoisonedPadding(ModelRunner):
    """Fills the static buffers' padding staging rows with NaN before every forward."""

    def forward(self, batch, ctxs, futures):
        for ctx, f in zip(ctxs, futures):
            f.result()
            ctx.bufs.staging[:, int(ctx.batch.qsl_host[-1]):] = float("nan")
        return super().forward(batch, ctxs, futures)


def pools(kv) -> list[torch.Tensor]:
    """Every pool of the paged state, each [slots + 2, width]."""
    return [*kv.window, *kv.entries.values(), *kv.index_keys.values(), *kv.open.values()]


def window_one_past_the_token(build):
    """SlotPlan.build whose windows cover positions p - W + 2 .. p + 1: one slot the token has not written."""
    def patched(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios, max_position=None):
        plan = build(cls, positions + 1, rows, block_tables, block_size, slots, zero_slot, window, ratios,
                     None if max_position is None else max_position + 1)
        real = build(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios, max_position)
        real.window, real.window_ok = plan.window, plan.window_ok
        return real
    return classmethod(patched)


def entries_one_past_the_complete(build):
    """SlotPlan.build that shows every token one compressed entry more than are complete at its position."""
    def patched(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios, max_position=None):
        real = build(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios, max_position)
        ahead = {r: build(cls, positions + r, rows, block_tables, block_size, slots, zero_slot, window, ratios,
                          None if max_position is None else max_position + r) for r in (1, 2)}
        for r in real.entry_count:
            real.entry_count[r] = ahead[r].entry_count[r]
            real.entry_slots[r] = ahead[r].entry_slots[r]
        return real
    return classmethod(patched)


def trial(loaded, alone, seed: int, kind: str) -> list[str]:
    """Run one trial; returns what went wrong (empty = isolated)."""
    rng = np.random.default_rng(seed)
    mates = [int(i) for i in rng.choice(len(POOL), size=int(rng.integers(2, 5)), replace=False)]
    runner_cls = {"engram": PoisonedStaging, "padding": PoisonedPadding}.get(kind, ModelRunner)
    cfg = CFG if kind != "padding" else RunnerConfig(**{**CFG.__dict__, "graph_sizes": (16, 64)})
    engine = LLMEngine(loaded, cfg, runner_cls=runner_cls)
    kv = engine.runner.kv
    bad = float(rng.choice([np.nan, np.inf, -np.inf]))
    if kind == "padding":
        for pool in pools(kv):
            pool[kv.trash_slot] = bad
            pool[:kv.num_slots] = bad  # every block is unallocated now: what a request reads of them must be
            # its own writes (the zero slot stays zero: it is what a masked key reads)
    poisoned = None
    if kind != "padding":
        if kind == "embedding":  # a pool prompt: its clean prefix blocks may be shared through the prefix cache
            prompt = list(POOL[int(rng.integers(len(POOL)))])
            prompt.insert(int(rng.integers(len(prompt) + 1)), POISON_TOKEN)
        else:  # poisoned KV or rows are not a function of the tokens: no mate may share its prefix
            prompt = rng.integers(6, 4096, size=int(rng.integers(1, 40))).tolist()
        poisoned = engine.add_request("poisoned", prompt, PARAMS)
        engine.runner.poisoned = poisoned
    first, later = mates[:len(mates) // 2], mates[len(mates) // 2:]
    for i in first:
        engine.add_request(f"m{i}", POOL[i], PARAMS)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished() or later:
        if steps == 2:  # later mates arrive once blocks have been freed and can be reused
            for i in later:
                engine.add_request(f"m{i}", POOL[i], PARAMS)
            later = []
        res = engine.step()
        steps += 1
        for ev in res.events:
            if ev.token is not None:
                got.setdefault(ev.request_id, []).append(ev.token)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
        if kind == "kv" and steps == 1 and poisoned is not None and poisoned.block_ids:
            blocks = torch.tensor(poisoned.block_ids)
            slots = (blocks[:, None] * kv.block_size + torch.arange(kv.block_size)).flatten()
            for pool in pools(kv):
                pool[slots] = bad
        assert steps < 200, "the trial did not finish"
    problems = [f"m{i}: {got.get(f'm{i}')} ({reasons.get(f'm{i}')}), alone {alone[i]}"
                for i in mates if got.get(f"m{i}") != alone[i] or reasons.get(f"m{i}") != "length"]
    if poisoned is not None and reasons.get("poisoned") != "error":
        problems.append(f"the poisoned request ended with {reasons.get('poisoned')}, not error")
    if engine.scheduler.block_manager.num_used:
        problems.append(f"{engine.scheduler.block_manager.num_used} KV blocks still held")
    engine.close()
    return problems


@pytest.mark.parametrize("kind", KINDS)
def test_poison_never_reaches_another_request(loaded, alone, kind):
    failures = {s: p for s in range(50) if (p := trial(loaded, alone, 100 * KINDS.index(kind) + s, kind))}
    assert not failures, failures


def test_negative_control_a_window_one_slot_past_the_token_leaks_nan(loaded, alone, monkeypatch):
    monkeypatch.setattr(paged_state.SlotPlan, "build", window_one_past_the_token(paged_state.SlotPlan.build.__func__))
    failures = [p for s in range(10) if (p := trial(loaded, alone, s, "kv"))]
    assert failures and any(line.startswith("m") for p in failures for line in p)  # a good request was hit


def test_negative_control_an_entry_one_past_the_complete_ones_leaks_nan(loaded, alone, monkeypatch):
    """An entry whose completing token has not run yet is read from its slot: in a reused block, the stale
    NaN of the block's previous owner (the indexer scores its index key, the attention may pick it)."""
    monkeypatch.setattr(paged_state.SlotPlan, "build",
                        entries_one_past_the_complete(paged_state.SlotPlan.build.__func__))
    failures = [p for s in range(10) if (p := trial(loaded, alone, s, "kv"))]
    assert failures and any(line.startswith("m") for p in failures for line in p)  # a good request was hit
