"""Benchmark harness: time a callable, measure its peak memory in a fresh process, print rows.

A benchmark module (see `engram_serve.bench`) exposes `add_args(parser)` and `run(args) -> list[dict]`;
the harness adds the options every benchmark shares (`--json`, `--budget-s`) and prints the rows.

Honest memory: each candidate is measured in its own fresh child process (`measure`), so no other
candidate (or earlier size) leaves allocator caches behind. In the child: build the inputs, make one
warm-up call (this pages in the kernels' code and runs one-time lazy initialisation, which are not
the candidate's working memory), `gc.collect()` and glibc `malloc_trim(0)` (otherwise the warm-up's
freed blocks stay resident and the next call reuses them unseen), then record the resident set size
(RSS), reset the kernel's peak-RSS mark (`/proc/self/clear_refs`, Linux >= 4.0) and run the timed
calls. `peak_mib` is the peak RSS growth over that baseline: the working memory of one call,
output included. Where the peak mark cannot be reset, the child falls back to the growth of
`ru_maxrss`, a lower bound (an allocation under an earlier high-water mark is not seen); the
`mem_method` field says which was used.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

@dataclass(frozen=True)
class Timing:
    median_ms: float
    p90_ms: float
    repeats: int
    cpu_median_ms: float = 0.0  # CPU time of the process (all its threads): less hit by other jobs' load


def time_callable(fn: Callable[[], Any], *, warmup: int = 1, min_repeats: int = 5, max_repeats: int = 100,
                  budget_s: float = 1.0) -> Timing:
    """Call `fn` `warmup` times untimed, then at least `min_repeats` and at most `max_repeats` times,
    stopping once `budget_s` of timed calls have elapsed. p90 is the nearest-rank percentile."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    cpu: list[float] = []
    spent = 0.0
    while len(times) < min_repeats or (len(times) < max_repeats and spent < budget_s):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dt = time.perf_counter() - t0
        cpu.append((time.process_time() - c0) * 1e3)
        times.append(dt * 1e3)
        spent += dt
    ordered = sorted(times)
    return Timing(statistics.median(ordered), ordered[math.ceil(0.9 * len(ordered)) - 1], len(ordered),
                  statistics.median(cpu))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Set the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _ru_maxrss_kib() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


def _malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc only)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _child(setup: Callable[..., Callable[[], Any]], params: dict, timing: dict) -> dict:
    """Runs in a fresh child process: build the candidate, then time it and measure its peak memory."""
    threads = timing.pop("threads", None)
    if threads is not None:
        import os

        import torch
        torch.set_num_threads(threads)
        os.environ["ENGRAM_SERVE_THREADS"] = str(threads)  # engines built by the candidate keep it
    fn = setup(**params)
    warmup = timing.pop("warmup", 1)
    for _ in range(max(1, warmup)):
        fn()
    gc.collect()
    trimmed = _malloc_trim()
    if _reset_peak_rss():
        base = _status_kib("VmRSS")
        method = "VmHWM" if trimmed else "VmHWM, no malloc_trim (lower bound)"
    else:
        base, method = _ru_maxrss_kib(), "ru_maxrss growth (lower bound)"
    t = time_callable(fn, warmup=0, **timing)
    peak = _ru_maxrss_kib() if method.startswith("ru_maxrss") else _status_kib("VmHWM")
    return {"median_ms": t.median_ms, "p90_ms": t.p90_ms, "repeats": t.repeats, "cpu_median_ms": t.cpu_median_ms,
            "peak_mib": max(0, peak - base) / 1024, "mem_method": method}


def measure(setup: Callable[..., Callable[[], Any]], params: dict, **timing) -> dict:
    """Time `setup(**params)()` and measure its peak memory in a fresh child process.

    `timing` may hold `threads` (torch intra-op threads in the child), `warmup` (untimed calls
    before the memory baseline, at least 1) and the keywords of `time_callable`.
    `setup` must be a module-level function (it is sent to the child by reference) that builds the
    inputs and returns the zero-argument callable to measure; building them is not timed and not
    counted as the candidate's memory. Returns median_ms, p90_ms,
    repeats, peak_mib (peak RSS growth while the callable ran) and mem_method."""
    # spawn, not fork or forkserver: the child is a fresh interpreter, like a real run. (A child
    # forked from a preloaded forkserver starts ~2 s sooner but inherits the server's heap state
    # and showed a ~20% higher, less repeatable peak for the 65536-token hash.)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_child, setup, params, timing).result()


# ---- command-line plumbing shared by every benchmark ----

def _number_list(text: str, convert: Callable, kind: str, refused: Callable) -> list:
    """argparse helper: a non-empty comma-separated list of convert(item); refused(v) is why v is out of range, or
    None."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: empty list; expected comma-separated values")
    out = []
    for i, piece in enumerate(text.split(","), 1):
        try:
            v = convert(piece)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: item {i} {piece!r} is not {kind}") from None
        if why := refused(v):
            raise argparse.ArgumentTypeError(f"{text!r}: item {i} ({v}) {why}")
        out.append(v)
    return out


def int_list(text: str, minimum: int) -> list[int]:
    """argparse helper: a non-empty comma-separated list of integers >= minimum (`1,64,8192`)."""
    why = "is negative" if minimum == 0 else f"must be >= {minimum}"
    return _number_list(text, int, "an integer", lambda v: why if v < minimum else None)


def temperature_list(text: str) -> list[float]:
    """argparse type for `--temperatures 0,0.7`: a non-empty comma-separated list of finite numbers >= 0."""
    return _number_list(text, float, "a number",
                        lambda v: None if v >= 0 and math.isfinite(v) else "must be a finite number >= 0")


def positive_int_list(text: str) -> list[int]:
    """argparse type for `--sizes 1,64,8192`: a non-empty comma-separated list of integers >= 1."""
    return int_list(text, 1)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def bounded_int(lo: int, hi: int, why: str) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi]; out of range, the message is '<value> <why>'."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} {why}")
        return v
    return parse


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return v


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list of objects")
    parser.add_argument("--budget-s", type=positive_float, default=1.0, metavar="SECONDS",
                        help="timed seconds per candidate and size, after warm-up (at least 5 repeats; default 1)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="torch intra-op threads in each measuring process (default 1: on a shared machine, "
                             "OpenMP threads that wait for a busy core make timings erratic)")


def timing_kwargs(args: argparse.Namespace) -> dict:
    return {"budget_s": args.budget_s, "threads": args.threads}


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if v == 0 or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def format_table(rows: Sequence[dict]) -> str:
    """Aligned text table; the columns are the rows' keys in order of first appearance."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    cells = [cols] + [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_rows(rows: Sequence[dict], as_json: bool, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    if as_json:
        print(json.dumps(list(rows)), file=out)
    else:
        print(format_table(rows), file=out)
