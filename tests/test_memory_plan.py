"""`engram-serve plan` (engram_serve/memory_plan.py) against what a loaded engine holds.

Two checks of the one rule `held_copies`: in-process, the plan's bytes per copy equal the bytes of the tensors a
loaded model holds after a generation (its parameters, MXFP4 panels, product panels, stacked copies, probes);
in a fresh process at two shapes, the plan's RAM is within 10% of the growth of the anonymous resident set from
before the load to after a few generation steps, and the checkpoint's resident mapped pages are at most its
file-backed bytes (a page of a weight as stored is resident once a step touched it). That process warms up on the built-in model first (imports, kernels, torch's
first ops belong to the baseline) and runs with freed memory given back (ENGRAM_SERVE_KEEP_FREED_MEMORY=0 and
glibc's mmap threshold fixed: the resident set is then what is held, not the peak of a freed step).
Negative control: the same RAM with the weights as stored copied into it is off by more than 10%.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_serve.cli import main
from engram_serve.memory_plan import Machine, memory_plan, parse_bytes
from engram_serve.model.random_writer import fast_v41_checkpoint
from engram_serve.model.writer import SMALL_TEXT_CONFIG, Quant

ROOT = Path(__file__).resolve().parents[1]
FLASH = ROOT / "tests" / "data" / "deepseek_v41_flash_config.json"
SHAPES = {  # ~120 MiB of weights as stored, most of it MXFP4 experts, and ~170 MiB in RAM, most of it request
    # state; ~230 MiB as stored and ~340 MiB in RAM, a larger head
    "experts": (dict(SMALL_TEXT_CONFIG, hidden_size=512, moe_intermediate_size=512, n_routed_experts=32,
                     num_attention_heads=8, head_dim=64, q_lora_rank=128, o_lora_rank=64, index_n_heads=4,
                     index_head_dim=32, engram_head_dim=64, vocab_size=16384), 16, 2048),
    "head+state": (dict(SMALL_TEXT_CONFIG, hidden_size=384, moe_intermediate_size=256, n_routed_experts=64,
                        num_attention_heads=8, head_dim=128, q_lora_rank=256, o_lora_rank=128, index_n_heads=8,
                        index_head_dim=64, engram_head_dim=64, vocab_size=32768), 16, 2048),
}
TOKENS = 256  # max_num_batched_tokens of both the plan and the engine

MEASURE = """
import gc, json, sys
from engram_serve.llm import LLM
from engram_serve.sampling_params import SamplingParams

def rss():
    status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    return {"anon": status["RssAnon"], "checkpoint": mapped(sys.argv[1])}

def mapped(root):  # resident bytes of this process's mappings of files under root (/proc/self/smaps)
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
            inside = len(head) >= 6 and head[5].startswith(root)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total

params = SamplingParams(max_tokens=6, temperature=0.0)
warm = LLM(None, max_num_seqs=2, max_model_len=64, num_blocks=8)
warm.generate(["def f(x):"], params)
del warm
gc.collect()
before = rss()
path, seqs, length, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, max_num_seqs=seqs, max_model_len=length, num_blocks=seqs * -(-length // 16),
          max_num_batched_tokens=tokens)
llm.generate(["def f(x):", "import os\\n", "the quick brown fox"], params)
gc.collect()
after = rss()
print(json.dumps({k: after[k] - before[k] for k in after}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan")
    return {name: fast_v41_checkpoint(root / name, text, seed=1, quant=Quant(bf16=True), shard_bytes=64 << 20)
            for name, (text, _, _) in SHAPES.items()}


def held_tensors(model) -> dict[str, int]:
    """Bytes of the tensors a loaded model holds, by kind, each storage once (the views of the memory map by their
    own size)."""
    from engram_serve.model import layers, products
    from engram_serve.model.weights import StoredWeight
    seen: set[int] = set()

    def size(t) -> int:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return t.untyped_storage().nbytes()

    stored = [m.stored for m in model.modules() if getattr(m, "stored", None) is not None]
    linears = [s for s in stored if isinstance(s, StoredWeight)]
    # a part repacked panel-major holds its words in RAM; its mapped rows' pages are let go (not held)
    views = [x for s in linears for (d, sc, _), w in zip(s.parts, s.words) for x in (d if w is None else None, sc)
             if x is not None]
    experts = [s for s in stored if not isinstance(s, StoredWeight)]
    views += [x for s in experts for w in (s.w1, s.w3, s.w2) for c, sc in w for x in ((c, sc) if s.words is None else (sc,))]
    dense = [s._dense for s in stored if isinstance(s, StoredWeight) and s._dense is not None]
    params = sum(size(p) for p in model.parameters()) + sum(size(t) for t in dense)
    mine = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *dense]}
    stacks = [v[0] for v in layers._stacks.values() if isinstance(v[0], torch.Tensor)
              and all(w.untyped_storage().data_ptr() in mine for w in v[1])]
    ours = mine | {t.untyped_storage().data_ptr() for t in stacks}
    plans = [p for p in products._plans.values() if p.weight.untyped_storage().data_ptr() in ours]
    return {"parameters": params, "stacked": sum(size(t) for t in stacks),
            "as stored": sum(t.numel() * t.element_size() for t in views),
            "words": sum(size(w) for s in linears for w in s.words if w is not None)
            + sum(size(t) for s in experts if s.words is not None for w in s.words for t in w),
            "panels": sum(size(p.kernel_weight) for p in plans if p.kernel_weight is not None),
            "fp8": sum(size(p.fp8[0]) + size(p.fp8[1]) for p in plans if getattr(p, "fp8", None) is not None)}


def test_the_rule_counts_the_tensors_a_loaded_model_holds(checkpoints):
    from engram_serve.llm import LLM
    from engram_serve.sampling_params import SamplingParams
    path = checkpoints["experts"]
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64, num_blocks=8)
    llm.generate(["def f(x):", "import os\n"], SamplingParams(max_tokens=3, temperature=0.0))
    got = held_tensors(llm.engine.runner.model)
    plan = memory_plan(path, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=TOKENS)
    copies: dict[str, int] = {}
    for w in plan.weights.values():
        for what, n in w.copies.items():
            copies[what] = copies.get(what, 0) + n
    expect = {"parameters": copies["float32 (input-major)"] + copies["float32 (cast)"] + copies["float32, mapped"],
              "stacked": copies.get("stacked float32 copy", 0), "as stored": copies["as stored, mapped"],
              "panels": copies.get("float panels", 0) + copies.get("bfloat16 tiles", 0),  # (AMX: tiles)
              "fp8": 0, "words": copies["rows panel-major"]}
    assert Machine.local().kernel  # the C kernels are built: weights stay as stored, float ones get panels
    for kind, n in expect.items():
        assert abs(got[kind] - n) <= 0.01 * n + 4096, (kind, got[kind], n)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_plan_total_is_within_10_percent_of_the_resident_growth(checkpoints, shape):
    _, seqs, length = SHAPES[shape]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ENGRAM_SERVE_KEEP_FREED_MEMORY": "0",
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "ENGRAM_SERVE_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoints[shape]), str(seqs), str(length), str(TOKENS)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    growth = json.loads(run.stdout.strip().splitlines()[-1])
    plan = memory_plan(checkpoints[shape], max_model_len=length, max_num_seqs=seqs, max_num_batched_tokens=TOKENS)
    print(f"{shape}: plan {plan.ram / 2**20:.1f} MiB in RAM + {plan.file_backed / 2**20:.1f} MiB file-backed; "
          f"growth {growth['anon'] / 2**20:.1f} MiB anonymous, {growth['checkpoint'] / 2**20:.1f} MiB of the "
          f"checkpoint's mapped pages")
    assert abs(plan.ram - growth["anon"]) <= 0.10 * growth["anon"]
    assert growth["checkpoint"] <= plan.file_backed  # (the pages of the weights as stored that steps touched)
    stored = sum(n for w in plan.weights.values() for what, n in w.copies.items()
                 if what in ("as stored, mapped", "rows panel-major"))
    assert abs(plan.ram + stored - growth["anon"]) > 0.10 * growth["anon"]  # control: were they copied again, off


def test_config_alone_gives_the_checkpoints_plan(checkpoints):
    """A config.json alone assumes the published layout, which the fast checkpoint with --bf16 has."""
    path = checkpoints["experts"]
    a = memory_plan(path, max_model_len=256, max_num_seqs=4).to_dict()
    b = memory_plan(path / "config.json", max_model_len=256, max_num_seqs=4).to_dict()
    assert a.pop("source") == "checkpoint" and b.pop("source") == "config"
    assert a == b


def test_tensor_parallelism_shards_what_parallel_shards(checkpoints):
    path = checkpoints["experts"]
    one, two = (memory_plan(path, tp, max_model_len=256, max_num_seqs=4) for tp in (1, 2))
    assert one.state == two.state  # the paged state is whole on every rank
    mx1, mx2 = one.weights["MXFP4"], two.weights["MXFP4"]
    assert mx2.stored * 2 == mx1.stored  # half the experts
    assert "MXFP4 panels" not in mx2.copies and mx2.copies["float32 (input-major)"] == 4 * mx2.stored * 32 // 17
    assert one.tables.file_backed == one.tables.held and two.tables.file_backed == 0  # rows copied at TP > 1
    assert two.load_peak > one.ram - one.state  # every rank loads the whole checkpoint first


def test_cli_prints_the_flash_plan(capsys):
    assert main(["plan", "--model", str(FLASH), "--tensor-parallel-size", "8", "--max-model-len", "8192",
                 "--max-num-seqs", "4", "--memory", "2T"]) == 0
    out = capsys.readouterr().out
    assert "per rank of 8" in out and "weights MXFP4" in out and "Engram tables" in out
    assert "fits in 2,048.00 GiB" in out
    assert main(["plan", "--model", str(FLASH), "--json", "--memory", "1G"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["max_model_len"] == 2048 and d["tensor_parallel_size"] == 1
    assert main(["plan", "--model", str(FLASH), "--tensor-parallel-size", "3"]) == 2
    assert "num_attention_heads=64 is not divisible by 3" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("1024") == 1024 and parse_bytes("64G") == 64 << 30 and parse_bytes("1.5TiB") == 3 << 39
    with pytest.raises(ValueError):
        parse_bytes("lots")
