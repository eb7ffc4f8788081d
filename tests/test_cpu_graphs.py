"""CPU graphs (runner/cpu_graphs.py): a replayed decode forward computes what the eager forward
computes, bit for bit, over random batches, contexts that cross block-table widths, and forced cuts;
a forward that cannot be captured runs eagerly. Negative controls: a replay that does not rebind the
step's inputs, and a capture that does not watch torch's operators, give wrong logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve.config import ModelConfig, read_json
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import CONFIG_FILE, TINY_DIR, load_model, make_random_checkpoint
from engram_serve.runner import cpu_graphs
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from engram_serve.verify import Workload, run_case


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def config(n: int, microbatches: int = 1, graphs: bool = True) -> RunnerConfig:
    return RunnerConfig(max_num_seqs=n, max_model_len=128, max_num_batched_tokens=512, num_blocks=8 * n + 8,
                        microbatch=MicrobatchConfig(microbatches, "tokens", 0, 0, when="always"), cpu_graphs=graphs)


def run(loaded, work: Workload, cfg: RunnerConfig, runner_cls=ModelRunner):
    """The record of the workload, and the runner's replay count."""
    runner = runner_cls(loaded, cfg)
    rec = run_case(loaded, work, cfg, make_runner=lambda _: runner)
    return rec, getattr(runner.graphs, "replays", 0)


def workload(seed: int, mates: int, gen: int, vocab: int) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload([rng.integers(6, vocab, size=int(n)).tolist() for n in rng.integers(1, 90, mates + 1)], gen)


def assert_same(rec, ref) -> None:
    assert np.array_equal(rec.logit_keys, ref.logit_keys)
    assert torch.equal(rec.hashes, ref.hashes) and torch.equal(rec.staged, ref.staged)
    assert torch.equal(rec.logits, ref.logits), float((rec.logits - ref.logits).abs().max())
    assert rec.tokens == ref.tokens


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), mates=st.sampled_from([0, 1, 4, 9]), microbatches=st.integers(1, 2))
def test_replayed_decode_forwards_are_bit_identical_to_eager_ones(loaded, seed, mates, microbatches):
    """Prompts of 1 to 89 tokens and 24 decode steps: contexts from 2 to 112 tokens, block tables 1 to 8
    blocks wide, so several layouts are captured and each is replayed with other positions, slots,
    tables and history."""
    work = workload(seed, mates, 24, loaded.config.vocab_size)
    ref, none = run(loaded, work, config(mates + 1, microbatches, graphs=False))
    rec, replays = run(loaded, work, config(mates + 1, microbatches))
    assert none == 0 and replays > 0
    assert_same(rec, ref)


class NoRebind(cpu_graphs.CpuGraphs):
    rebind = False


class Unwatched(cpu_graphs._Watch):
    guard = False


@pytest.mark.parametrize("off", ["inputs not rebound", "operators not watched"])
def test_negative_control_without_the_protection_replays_give_wrong_logits(loaded, monkeypatch, off):
    """Without rebinding, a replay reads the capture step's positions, slots and tables (wrong rotary,
    keys written to old slots); without the watch, the router's matmul (a torch operator) is not
    replayed, so every replay routes with the capture step's router logits."""
    work = workload(3, 3, 16, loaded.config.vocab_size)
    ref, _ = run(loaded, work, config(4, graphs=False))
    if off.startswith("inputs"):
        monkeypatch.setattr(cpu_graphs.CpuGraphs, "rebind", False)
    else:
        monkeypatch.setattr(cpu_graphs.CpuGraphs, "watch", Unwatched)
    rec, replays = run(loaded, work, config(4))
    assert replays > 0
    assert not torch.equal(rec.logits, ref.logits)


def test_a_forward_with_a_host_read_runs_eagerly_and_stays_exact(tmp_path, caplog):
    """The sorted MoE path (8 experts, top 2) reads the per-expert counts on the host: its capture is
    refused (named once in the log) and every step runs eagerly, with the eager bits."""
    raw = read_json(TINY_DIR / CONFIG_FILE)
    raw["n_routed_experts"] = 8
    model = load_model(make_random_checkpoint(tmp_path, seed=2, config=ModelConfig.from_dict(raw)))
    work = workload(5, 2, 8, model.config.vocab_size)
    ref, _ = run(model, work, config(3, graphs=False))
    with caplog.at_level("INFO", logger=cpu_graphs.__name__):
        rec, replays = run(model, work, config(3))
    assert replays == 0 and "runs eagerly: operator aten." in caplog.text
    assert_same(rec, ref)
