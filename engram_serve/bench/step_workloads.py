"""The workloads of `bench step`, and the prepared step both of its forms time (bench/step.py in one
process, bench/step_tp.py at N ranks).

A workload is (requests, new tokens per request, context already computed). `prepare` gives every
request its own pages (request b owns blocks b*P .. b*P + P - 1, P = pages per request), the same
random prompts for every candidate (seed 0), and builds the one step that runs them.
"""
from __future__ import annotations

from collections.abc import Callable

WORKLOADS = {  # name -> (requests, new tokens per request, context already computed)
    "decode-heavy": (64, 1, 512),
    "prefill-heavy": (4, 256, 0),
}
# the single-process workloads and larger ones, where cutting a step costs relatively less
TP_WORKLOADS = {"decode-32": (32, 1, 512), **WORKLOADS, "decode-128": (128, 1, 512),
                "prefill-2048": (8, 256, 0)}
BLOCK = 16


def prepare(make_runner: Callable, vocab: int, workload: tuple[int, int, int], microbatches: int, *,
            planned: bool = False, device: str = "cpu"):
    """(runner, the workload's step) for a runner made by `make_runner(RunnerConfig)`: cut into
    `microbatches` always (the candidate's form, fixed), or with `planned` the served configuration
    (`MicrobatchConfig(microbatches)`, the planner choosing at every call)."""
    import numpy as np

    from ..microbatch.plan import MicrobatchConfig
    from ..runner.model_runner import RunnerConfig
    reqs, new, ctx = workload
    max_len = -(-(ctx + new) // BLOCK) * BLOCK
    cfg = RunnerConfig(max_num_seqs=reqs, max_model_len=max_len, max_num_batched_tokens=reqs * new,
                       block_size=BLOCK, num_blocks=reqs * max_len // BLOCK,
                       microbatch=MicrobatchConfig(microbatches) if planned else
                       MicrobatchConfig(microbatches, "tokens", 0, 0, when="always"), device=device)
    runner = make_runner(cfg)
    rng = np.random.default_rng(0)
    slots = np.array([runner.store.add(rng.integers(6, vocab, ctx + new).tolist()) for _ in range(reqs)])
    per = max_len // BLOCK
    tables = np.arange(reqs * per).reshape(reqs, per)  # [reqs, per] block ids
    batch = runner.build(slots, np.full(reqs, ctx), np.full(reqs, new), tables, np.ones(reqs, bool))
    return runner, batch
