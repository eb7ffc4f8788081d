"""`bench serve --compare threads`: two servers over one model in one process, the default kernel threads against
one. The pool is one per process, so the bench switches it between waves; these tests watch every step of each
server's real engine (the pool's size as the step starts, and the jobs the pool ran on two threads or more during
the step, `shared_jobs`) and fail if a server's steps ran on the other's pool. The negative control makes the switch
a no-op: the one-thread server's steps then run on the default server's two threads, and the check says so.
"""
from __future__ import annotations

import pytest
import torch
from kernel_hooks import pool_always, shared_jobs

from engram_serve import thread_pool
from engram_serve.bench import serve as serve_bench
from engram_serve.cli import build_parser
from engram_serve.engine import threads as engine_threads
from engram_serve.engine.driver import EngineDriver

ARGS = ["bench", "serve", "--compare", "threads", "--clients", "2", "--max-tokens", "4", "--max-waves", "1",
        "--budget-s", "0.01"]


def run_watched(monkeypatch) -> tuple[list[dict], dict[int, list[tuple[int, int]]]]:
    """Run the bench with a default of 2 threads; returns its rows and, per engine (by the count it was built
    with), each step's (pool size as it started, jobs shared across threads during it)."""
    monkeypatch.setenv(engine_threads.ENV, "2")
    monkeypatch.setattr(engine_threads, "_chosen", engine_threads._chosen)  # the bench's engines choose it anew
    seen: dict[int, list[tuple[int, int]]] = {}
    real = EngineDriver.step_events

    def watched(self):  # the real step, on the engine thread, between two reads of the real pool
        size, jobs = thread_pool.threads(), shared_jobs()
        out = real(self)
        seen.setdefault(self.engine.threads, []).append((size, shared_jobs() - jobs))
        return out

    monkeypatch.setattr(EngineDriver, "step_events", watched)
    pool_before, torch_before = thread_pool.threads(), torch.get_num_threads()
    try:
        with pool_always():  # every job of 2 items or more is split: the tiny model's steps use the whole pool
            rows = serve_bench.run(build_parser().parse_args(ARGS))
    finally:
        thread_pool.set_threads(pool_before)
        torch.set_num_threads(torch_before)
    return rows, seen


def problems(seen: dict[int, list[tuple[int, int]]]) -> list[str]:
    """What is wrong with the steps seen: each server's every step on its own pool size, shared jobs only on 2."""
    out = []
    if sorted(seen) != [1, 2]:
        return [f"engines that stepped, by their thread count: {sorted(seen)}; expected [1, 2]"]
    for threads, steps in sorted(seen.items()):
        sizes = sorted({size for size, _ in steps})
        if sizes != [threads]:
            out.append(f"the {threads}-thread server's steps started on pools of {sizes}")
        shared = [jobs for _, jobs in steps]
        if threads == 1 and any(shared):
            out.append(f"the 1-thread server's steps ran {sum(shared)} jobs on several threads")
        if threads == 2 and not all(shared):
            out.append(f"{shared.count(0)} of the 2-thread server's {len(steps)} steps ran no job on two threads")
    return out


@pytest.mark.skipif(not thread_pool.built(), reason="the kernels' thread pool was not built")
def test_each_server_steps_on_its_own_pool_size(monkeypatch):
    rows, seen = run_watched(monkeypatch)
    assert problems(seen) == []
    assert all(len(steps) >= 4 for steps in seen.values())  # warm-up and a wave each: prefill and decodes
    (row,) = rows
    assert row["t1_threads"] == 1 and row["default_threads"] == 2
    assert row["t1_pool_threads"] == 1 and row["default_pool_threads"] == 2  # the engines' own snapshots
    assert row["requests"] == 2 and row["t1_tok_s"] > 0 and row["default_tok_s"] > 0
    assert row["tok_s_ratio_default_t1"] == pytest.approx(row["default_tok_s"] / row["t1_tok_s"])


@pytest.mark.skipif(not thread_pool.built(), reason="the kernels' thread pool was not built")
def test_negative_control_without_the_switch_the_one_thread_server_runs_on_two(monkeypatch):
    monkeypatch.setattr(serve_bench, "_set_pool", lambda sizes, name: None)
    rows, seen = run_watched(monkeypatch)
    found = problems(seen)
    assert "the 1-thread server's steps started on pools of [2]" in found
    assert any(p.startswith("the 1-thread server's steps ran") for p in found)
    assert rows[0]["t1_pool_threads"] == 2  # the engine's snapshot sees it too


def test_threads_comparison_refuses_a_default_of_one_thread(monkeypatch):
    from engram_serve.errors import ConfigError
    monkeypatch.setenv(engine_threads.ENV, "1")
    with pytest.raises(ConfigError, match="--compare threads: the default is 1 thread"):
        serve_bench.run(build_parser().parse_args(ARGS))
