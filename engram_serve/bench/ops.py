"""Operators per decode step: aten operator count (torch.profiler) and time of one whole engine step.

The whole step is what `LLMEngine.step()` does for a batch of decodes: schedule, build the step
inputs, hash, Engram staging gather, forward, logits, sampling and commit. For each batch size,
B requests of 64 random prompt tokens are prefilled, a few decode steps warm up, then:
- `aten_ops`: every `aten::` event torch.profiler records during ONE decode step (nested ones
  included: a composite operator counts with the operators it calls);
- `top_level_ops`: those not called from another aten operator (what Python code launched);
- `native_calls`: calls into this project's C kernels (V4.1's token-wise steps, row matmuls, hash,
  gather) in that step, which the profiler does not record, those a CPU graph replay makes included:
  each is one call from Python, like an operator;
- `python_calls`: Python function calls (cProfile) in the next decode step;
- `step_ms`: median (and p90) wall time of a decode step without the profiler, after warm-up.
Microbatching off (`MicrobatchConfig(1)`) and on (`MicrobatchConfig(2)`, the planner decides whether to
cut) are measured side by side, each in its own fresh process.
"""
from __future__ import annotations

import argparse

from . import common

NAME = "ops"
PROMPT = 64


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=common.positive_int_list, default=[1, 32], metavar="B,...",
                        help="concurrent decoding requests (default 1,32)")
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")


def _engine(model, batch: int, microbatches: int):
    import numpy as np

    from ..engine.llm_engine import LLMEngine
    from ..microbatch.plan import MicrobatchConfig
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    from ..sampling_params import SamplingParams

    loaded = load_model(model)
    cfg = RunnerConfig(max_num_seqs=max(batch, 4), max_model_len=1024,
                       max_num_batched_tokens=max(1024, batch * PROMPT), microbatch=MicrobatchConfig(microbatches))
    eng = LLMEngine(loaded, cfg)
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=1024 - PROMPT, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", rng.integers(6, loaded.config.vocab_size, PROMPT).tolist(), params)
    eng.step()  # the prefill
    for _ in range(3):
        eng.step()
    return eng


def _native_modules():
    """The project's C kernel modules that a step may call (those loaded: engram_serve/kernels.py)."""
    from .. import kernels
    return [kernels.get(name) for name in kernels.MODULES if kernels.loaded(name)]


def count_ops(model, batch: int, microbatches: int) -> dict:
    """Profile one decode step; returns aten_ops, top_level_ops, native_calls (calls into the project's
    C kernels, which the profiler does not see), python_calls (Python function calls, cProfile) and the
    rows of that step."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile
    eng = _engine(model, batch, microbatches)
    calls = [0]

    def counted(fn):
        def call(*a):
            calls[0] += 1
            return fn(*a)
        return call
    from ..runner.cpu_graphs import _Graph
    native = _native_modules()
    replay = _Graph.replay

    def counted_replay(graph, *a):  # a CPU graph replay calls the kernels it recorded, not the module's names
        calls[0] += sum(getattr(fn, "__self__", None) in native for fn, _, _ in graph.calls)
        return replay(graph, *a)
    originals = [(m, k, getattr(m, k)) for m in native for k in dir(m)
                 if not k.startswith("_") and callable(getattr(m, k))] + [(_Graph, "replay", replay)]
    for m, k, fn in originals[:-1]:
        setattr(m, k, counted(fn))
    _Graph.replay = counted_replay
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res = eng.step()
    finally:
        for m, k, fn in originals:
            setattr(m, k, fn)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    pr = cProfile.Profile()
    pr.runcall(eng.step)
    return {"aten_ops": len(aten), "top_level_ops": len(top), "native_calls": calls[0],
            "python_calls": pstats.Stats(pr).total_calls, "rows": len(res.scheduled.rows),
            "microbatched": len(res.output.bounds) > 2}


def setup(model, batch: int, microbatches: int):
    eng = _engine(model, batch, microbatches)
    return eng.step


def _counted(model, batch: int, microbatches: int) -> dict:
    import torch
    torch.set_num_threads(1)
    return count_ops(model, batch, microbatches)


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    rows = []
    for b in args.batch:
        for name, n in (("off", 1), ("on", 2)):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                ops = pool.submit(_counted, args.model, b, n).result()
            if ops["rows"] != b:
                raise RuntimeError(f"the profiled step held {ops['rows']} rows, expected {b} decodes")
            t = common.measure(setup, dict(model=args.model, batch=b, microbatches=n), **common.timing_kwargs(args))
            rows.append({"batch": b, "microbatching": name, "aten_ops": ops["aten_ops"],
                         "top_level_ops": ops["top_level_ops"],
                         "native_calls": ops["native_calls"], "python_calls": ops["python_calls"],
                         "microbatched": ops["microbatched"], "step_ms": t["median_ms"], "step_p90_ms": t["p90_ms"],
                         "tok_s": b / t["median_ms"] * 1e3, "threads": args.threads})
    return rows
