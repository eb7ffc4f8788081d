"""The microbatch executor: one thread interleaves the microbatches' stage generators.

Order is fixed: round r runs stage r of microbatch 0, then of microbatch 1, ... So for every
layer L, microbatch k's stages of layer L (and so its KV-cache writes) finish before microbatch
k+1 runs its stage of layer L (docs/contract.md §5). All microbatches must yield the same stage names in the
same order; a divergence is an error. A microbatch that raises ends the step with that error at
once: the other generators are closed and nothing waits on them.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any


class StageMismatch(RuntimeError):
    pass


def run_interleaved(gens: list[Generator[str, None, Any]], trace: list | None = None) -> list[Any]:
    """Drive the generators round-robin to completion; returns their return values in order."""
    results: list[Any] = [None] * len(gens)
    live = list(range(len(gens)))
    try:
        while live:
            stages, finished = {}, []
            for k in live:
                try:
                    stages[k] = next(gens[k])
                except StopIteration as stop:
                    results[k] = stop.value
                    finished.append(k)
                    continue
                if trace is not None:
                    trace.append((k, stages[k]))
            if finished and len(finished) != len(live):
                raise StageMismatch(f"microbatches {finished} finished while {sorted(stages)} still had stages")
            if len(set(stages.values())) > 1:
                raise StageMismatch(f"microbatches yielded different stages in one round: {stages}")
            live = [k for k in live if k not in finished]
    finally:
        for g in gens:
            g.close()
    return results
