"""One engine step, whole against cut into 2 microbatches (dual-batch overlap), side by side.

Workloads: decode-heavy (many requests, one new token each, deep contexts) and prefill-heavy (a few
long prompt chunks). Timed: `ModelRunner.execute` on a prepared step (hash, staging gather, forward,
logits). Memory: the per-microbatch buffers each candidate allocates up front (staging rows,
hash ids, index-sharing buffer, MoE scratch; one set per microbatch) and the peak RSS growth
while steps run (measured in a fresh child process per candidate).
"""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import common
from .step_workloads import WORKLOADS, prepare

NAME = "step"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: " + ", ".join(WORKLOADS) + " (default: both); with "
                             "--tensor-parallel-size also decode-32, decode-128, prefill-2048 (default: all five)")
    parser.add_argument("--tensor-parallel-size", type=common.positive_int, default=1, metavar="N",
                        help="N >= 2: microbatching on against off at N ranks (gloo), real link and a simulated one "
                             "(bench/step_tp.py)")
    parser.add_argument("--sim-latency-us", type=common.positive_int_list, default=[500, 2000], metavar="US,US",
                        help="simulated links: latency per cross-rank sum, one link per value (default 500,2000)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="single-process step on this device (the tensor-parallel bench runs on CPU, gloo)")
    parser.add_argument("--cpu-bind", choices=("rank", "none"), default="rank",
                        help="tensor-parallel bench: pin each rank to its own share of the cores (default) or "
                             "leave placement to the OS")
    parser.add_argument("--sim-gbps", type=common.positive_float, default=1.0, metavar="GB/S",
                        help="simulated link: bandwidth in GB/s (default 1)")


def _runner(model: str | None, workload: str, microbatches: int, device: str = "cpu"):
    import torch

    from ..model.loader import load_model
    from ..runner.model_runner import ModelRunner

    torch.manual_seed(0)
    loaded = load_model(model, device=device)
    return prepare(lambda cfg: ModelRunner(loaded, cfg), loaded.config.vocab_size, WORKLOADS[workload],
                   microbatches, device=device)


def buffer_bytes(runner) -> int:
    seen, total = set(), 0
    for b in runner.bufs:
        for t in [b.staging, b.hash_ids, b.topk_idx, *b.scratch.values()]:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.numel() * t.element_size()
    return total


def setup(model: str | None, workload: str, microbatches: int, device: str = "cpu"):
    runner, batch = _runner(model, workload, microbatches, device)
    if device == "cpu":
        return lambda: runner.execute(batch)
    import torch

    def step():
        runner.execute(batch)
        torch.cuda.synchronize()  # time the device work, not the launch
    return step


def run(args: argparse.Namespace) -> list[dict]:
    if args.tensor_parallel_size > 1:
        from .step_tp import run_tp
        return run_tp(args)
    rows = []
    for wl in (args.workloads or ",".join(WORKLOADS)).split(","):
        if wl not in WORKLOADS:
            raise UsageError(f"--workloads: unknown workload {wl!r}; choose from {sorted(WORKLOADS)}")
        res, bufs = {}, {}
        for name, n in (("whole", 1), ("microbatched", 2)):
            runner, batch = _runner(args.model, wl, n, args.device)
            bufs[name] = buffer_bytes(runner) / 2**20
            tokens = batch.num_tokens
            runner.close()
            res[name] = common.measure(setup, dict(model=args.model, workload=wl, microbatches=n, device=args.device),
                                       **common.timing_kwargs(args))
        w, d = res["whole"], res["microbatched"]
        rows.append({"workload": wl, "tokens": tokens,
                     "whole_tok_s": tokens / w["median_ms"] * 1e3, "microbatched_tok_s": tokens / d["median_ms"] * 1e3,
                     "microbatched_over_whole": w["median_ms"] / d["median_ms"],
                     "whole_buffers_mib": bufs["whole"], "microbatched_buffers_mib": bufs["microbatched"],
                     "whole_peak_mib": w["peak_mib"], "microbatched_peak_mib": d["peak_mib"], "device": args.device})
    return rows
