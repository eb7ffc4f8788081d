"""The C kernels' thread pool: one engine timed at several pool sizes, round by round in one process.

One process loads the model (--model; e.g. the mid-size V4.1 shape written by scripts/make_official_checkpoint.py)
and builds one engine per workload (exact: torch on one thread; CPU graphs on); each round times every pool size
(`thread_pool.set_threads`), the order rotated round by round, so that a change in machine load hits every size alike.
Workloads:
- `decode-B`: B prompts of --prompt tokens prefilled (untimed), then --new - 1 greedy steps timed
  (tokens/s = B x (new - 1) / their time);
- `prefill-P`: one prompt of P tokens to its first token (tokens/s = P / the step's time).
The same prompts every round; the greedy tokens (decode) and the logits (prefill) of every size must equal the
first size's, bit for bit (`same_bits`). tokens/s is taken at the median time; `x_first` is the median over the
rounds of the first size's time over this size's (each round's ratio measured seconds apart), `x_best` the ratio of
the best times (another process's load only ever slows a call down, and slows a pool of several threads more than
one thread: a neighbour on one of two cores leaves the second thread without a core). `other_cores` is the median
CPU that other processes ran during this size's calls, in cores (/proc/stat's busy time less this process's);
`x_quiet` the median ratio over the `quiet_rounds` in which both sizes' calls saw less than QUIET_CORES.

For decode, `host_ms` is the median step's time outside the C kernels (a last round with a clock around the
token kernel's `call_all`, the CPU graph replays of runner/cpu_graphs.py, and `capture.call`, every other kernel
call of the forward): the Python host work of a step (scheduling, inputs, sampling, detokenizing, the clock's
own calls), which no kernel thread shortens.
"""
from __future__ import annotations

import argparse
import statistics
import time

from ..errors import UsageError
from . import common

NAME = "threads"
QUIET_CORES = 0.25  # a round counts as quiet where other processes ran less than this many cores during its calls


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--workloads", default="decode-1,decode-32,prefill-64,prefill-2048",
                        help="comma-separated decode-B and prefill-P (default decode-1,decode-32,prefill-64,"
                             "prefill-2048)")
    parser.add_argument("--sizes", type=common.positive_int_list, default=[1, 2], metavar="N,N",
                        help="pool sizes timed against each other, the first the reference (default 1,2)")
    parser.add_argument("--rounds", type=common.positive_int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--prompt", type=common.positive_int, default=64, help="decode prompts' tokens (default 64)")
    parser.add_argument("--new", type=common.positive_int, default=32, help="decode: greedy tokens (default 32)")


def _workload(name: str) -> tuple[str, int]:
    kind, _, n = name.partition("-")
    if kind not in ("decode", "prefill") or not n.isdigit() or int(n) < 1:
        raise UsageError(f"--workloads: {name!r} is neither decode-B nor prefill-P (B, P >= 1)")
    return kind, int(n)


class _KernelClock:
    """Time spent in the C kernels of the forward while installed: the token kernel's `call_all` (CPU graph replays)
    and `capture.call` (every other kernel call of the forward, e.g. the logits' product)."""

    def __init__(self, token_kernel):
        from ..model import capture
        self.spent = 0.0
        self.targets = [(token_kernel, "call_all"), (capture, "call")]
        self.inner = [getattr(m, n) for m, n in self.targets]

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0
        return timed

    def __enter__(self):
        for (m, n), fn in zip(self.targets, self.inner):
            setattr(m, n, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for (m, n), fn in zip(self.targets, self.inner):
            setattr(m, n, fn)


def _machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has run so far (/proc/stat, Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / 100.0  # all but idle and iowait, in USER_HZ ticks


def _setup(loaded, kind: str, n: int, prompt: int, new: int):
    import numpy as np

    from ..engine.llm_engine import LLMEngine
    from ..microbatch.plan import MicrobatchConfig
    from ..runner.model_runner import RunnerConfig
    from ..sampling_params import SamplingParams
    batch, length = (n, prompt) if kind == "decode" else (1, n)
    cfg = RunnerConfig(max_num_seqs=max(batch, 4), max_model_len=length + new + 1,
                       max_num_batched_tokens=max(2048, batch * length), num_blocks=max(64, batch * 16 + length // 8),
                       microbatch=MicrobatchConfig(1))
    eng = LLMEngine(loaded, cfg, enable_prefix_caching=False)
    prompts = np.random.default_rng(0).integers(6, loaded.config.vocab_size, size=(batch, length)).tolist()
    calls = [0]

    def call(clock: _KernelClock | None = None) -> dict:
        calls[0] += 1
        params = SamplingParams(max_tokens=1 if kind == "prefill" else new, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"c{calls[0]}-{i}", p, params)
        busy0, cpu0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
        first = eng.step(record=kind == "prefill")
        t1 = time.perf_counter()
        if kind == "prefill":
            busy1, cpu1 = _machine_busy_s(), time.process_time()
        steps, kernel_s, tokens = [], [], [e.token for e in first.events]
        while eng.has_unfinished():
            if kind == "decode" and not steps:
                busy0, cpu0 = _machine_busy_s(), time.process_time()
            k0 = clock.spent if clock else 0.0
            s0 = time.perf_counter()
            tokens += [e.token for e in eng.step().events]
            steps.append(time.perf_counter() - s0)
            kernel_s.append((clock.spent - k0) if clock else 0.0)
        if kind == "decode":
            busy1, cpu1 = _machine_busy_s(), time.process_time()
        seconds = t1 - t0 if kind == "prefill" else sum(steps)
        other = None if busy0 is None else max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / seconds
        out = {"seconds": seconds, "tokens": tokens, "steps": steps, "kernel": kernel_s, "other": other}
        if kind == "prefill":
            out["logits"] = first.output.logits.clone()
        return out
    return call


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from .. import kernels, thread_pool
    from ..engine.threads import set_torch_threads
    from ..model.loader import load_model
    sizes = list(dict.fromkeys(args.sizes))
    set_torch_threads(max(sizes))  # the engine's count (torch: one thread in exact mode)
    loaded = load_model(args.model)
    rows = []
    for name in args.workloads.split(","):
        kind, n = _workload(name)
        call = _setup(loaded, kind, n, args.prompt, args.new)
        times: dict[int, list[float]] = {s: [] for s in sizes}
        other: dict[int, list[float | None]] = {s: [] for s in sizes}
        host: dict[int, list[float]] = {s: [] for s in sizes}
        same = {s: True for s in sizes}
        ref = None  # the first size's output: every size's must equal it
        for s in sizes:  # warm-up (captures, packing, first touch)
            thread_pool.set_threads(s)
            out = call()
            ref = ref or out
            same[s] &= out["tokens"] == ref["tokens"] and ("logits" not in out or torch.equal(out["logits"],
                                                                                          ref["logits"]))
        for r in range(args.rounds + (kind == "decode")):  # decode: a last round times the kernels
            for s in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                thread_pool.set_threads(s)
                if r < args.rounds:
                    out = call()
                    times[s].append(out["seconds"])
                    other[s].append(out["other"])
                else:
                    with _KernelClock(kernels.get("token")) as clock:
                        out = call(clock)
                    host[s] = [(a - b) * 1e3 for a, b in zip(out["steps"], out["kernel"])]
                same[s] &= out["tokens"] == ref["tokens"] and ("logits" not in out or torch.equal(out["logits"],
                                                                                              ref["logits"]))
        work = n * (args.new - 1) if kind == "decode" else n
        for s in sizes:
            med = statistics.median(times[s])
            ratios = [a / b for a, b in zip(times[sizes[0]], times[s])]
            quiet = [x for x, o0, o in zip(ratios, other[sizes[0]], other[s])
                     if o0 is not None and o is not None and max(o0, o) < QUIET_CORES]
            row = {"workload": name, "threads": s, "tok_s": work / med, "median_ms": med * 1e3,
                   "spread_ms": f"{min(times[s]) * 1e3:.1f}-{max(times[s]) * 1e3:.1f}",
                   "x_first": statistics.median(ratios), "x_best": min(times[sizes[0]]) / min(times[s]),
                   "x_quiet": statistics.median(quiet) if quiet else None, "quiet_rounds": len(quiet),
                   "other_cores": statistics.median(o for o in other[s] if o is not None)
                   if any(o is not None for o in other[s]) else None, "same_bits": same[s]}
            if host[s]:
                row["step_ms"] = med / (args.new - 1) * 1e3
                row["host_ms"] = statistics.median(host[s])
            rows.append(row)
    thread_pool.set_threads(sizes[0])
    return rows
