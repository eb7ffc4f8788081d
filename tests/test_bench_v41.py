"""The V4.1 configurations of `bench peers` (engram_serve/bench/v41_shapes.py): valid, with every layer role at mid
size, their arithmetic per token counted as the model computes it, and a model without Engram layers (what
mlx-lm runs) loading and serving."""
from __future__ import annotations

import json

import pytest

from engram_serve.bench import v41_shapes as vs
from engram_serve.config import ModelConfig
from engram_serve.model.deepseek_v41 import layer_roles


@pytest.mark.parametrize("shape", vs.SHAPES)
def test_the_shapes_are_valid_configs_without_engram(shape):
    cfg = ModelConfig.from_dict(vs.text_config(shape))
    assert len(cfg.engram.engram_layer_ids) == 0
    assert vs.flops_per_token(vs.text_config(shape), 1) < vs.flops_per_token(vs.text_config(shape), 200)


def test_the_mid_shape_has_every_layer_role():
    roles = layer_roles(ModelConfig.from_dict(vs.text_config("mid")))
    assert any(r.ratio == 0 for r in roles)  # window only
    assert any(r.ratio == 2 and r.owns_compressor and r.runs_indexer for r in roles)
    assert any(r.ratio == 2 and not r.runs_indexer for r in roles)  # reuses a top-k
    assert any(r.ratio == 1 and r.publishes_candidates for r in roles)
    assert any(r.ratio == 1 and r.uses_candidates for r in roles)
    assert any(r.ratio == 1 and not r.runs_indexer for r in roles)
    assert vs.text_config("mid")["hidden_size"] == 1024 and len(roles) == 8


def test_flops_and_weight_bytes_count_what_a_token_multiplies():
    """A one-layer window-only config by hand: 2 x (mix + attention projections + attention + router + k + 1
    experts) + the head; a prefill's tokens before the last make that (last) layer's keys alone."""
    cfg = dict(vs.text_config("mid"), num_hidden_layers=1, compress_ratios=[0], kv_source_layer_ids=[],
               index_source_layer_ids=[], candidate_source_layer_id=-1)
    d, hc, h, hd, ql, ol, og, inter = 1024, 4, 16, 128, 512, 256, 4, 256
    mix = 2 * (2 + hc) * hc * hc * d
    attn = d * ql + ql * h * hd + d * hd + og * (h * hd // og) * ol + og * ol * d
    moe = d * 16 + 5 * 3 * d * inter
    head = d * 4096
    assert vs.flops_per_token(cfg, 10) == 2 * (mix + attn + 2 * h * 10 * hd + moe + head)
    # a 3-token prefill: the first two tokens make the one layer's window key alone, the third runs it whole
    keys = d * hd
    assert vs.prefill_flops(cfg, 3) == 2 * (2 * keys + mix + attn + 2 * h * 3 * hd + moe + head)
    assert vs.weight_bytes_per_token(cfg) == 4 * (mix + attn + moe + head)


def test_a_model_without_engram_layers_serves(tmp_path):
    """The layout, the hash and the staging gather of zero Engram layers (mlx-lm's V4.1 has none)."""
    from engram_serve.engine.llm_engine import LLMEngine
    from engram_serve.model.loader import load_model
    from engram_serve.runner.model_runner import RunnerConfig
    from engram_serve.sampling_params import SamplingParams
    loaded = load_model(vs.write_checkpoint("builtin", tmp_path / "ckpt"))
    assert loaded.layout.moduli.shape == (0, 8) and loaded.layout.multipliers.shape == (0, 3)
    eng = LLMEngine(loaded, RunnerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, num_blocks=16),
                    enable_prefix_caching=False)
    eng.add_request("a", list(range(6, 30)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    tokens = []
    while eng.has_unfinished():
        tokens += [e.token for e in eng.step().events if e.token is not None]
    assert len(tokens) == 5


def test_the_clock_is_timed_from_a_chain_of_adds():
    """The FMA peak's clock: `spin_adds` runs the 8 n adds it returns, and their timing gives a clock a core can
    have (a chain that the core folded, or a loop the compiler dropped, would read as tens of GHz)."""
    from engram_serve import kernels
    lin = kernels.get("linear")
    if lin is None or lin.spin_adds(1) is None:
        pytest.skip("no linear kernel on x86-64 here")
    assert lin.spin_adds(1000) == 8000
    assert 300 < vs.measured_mhz(rounds=1 << 18, repeats=3) < 6500


def test_bench_step_at_two_ranks_on_a_model_without_engram_tables_prints_its_rows(tmp_path, monkeypatch, capsys):
    """`bench step --tensor-parallel-size 2` on a checkpoint without Engram layers measured every row, then
    divided its table bytes per rank by zero table bytes and printed nothing. Its table-memory row now says
    there are no Engram tables and gives no ratio. (One tiny workload, the fewest rounds, the builtin shape.)"""
    from engram_serve import cli
    from engram_serve.bench import step_tp
    monkeypatch.setattr(step_tp, "TP_WORKLOADS", {"tiny": (2, 1, 15)})
    ckpt = vs.write_checkpoint("builtin", tmp_path / "ckpt")
    assert cli.main(["bench", "step", "--tensor-parallel-size", "2", "--model", str(ckpt), "--workloads", "tiny",
                     "--cpu-bind", "none", "--budget-s", "0.001", "--sim-latency-us", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    memory = [r for r in rows if "table_memory" in r]
    assert memory == [{**memory[0], "table_memory": "TP=2, no Engram tables", "tables_mib_per_rank": 0.0,
                       "tables_mib_one_process": 0.0, "ratio": None}]
    assert [r["workload"] for r in rows if "workload" in r] == ["tiny", "tiny"]  # the real link, one simulated


def test_the_table_memory_row_of_a_model_with_tables_gives_the_ratio():
    from engram_serve.bench.step_tp import table_memory
    row = table_memory(2, 3 << 20, 6 << 20, [1.0, 2.0], [3.0, 4.0])
    assert row["table_memory"] == "TP=2" and row["ratio"] == 0.5 and row["tables_mib_one_process"] == 6.0
