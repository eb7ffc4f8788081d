"""Graph buckets (docs/contract.md §6): a step is padded to its bucket and cut into fixed parts, so the
(microbatch, padded size) keys - static buffer sets, and graph captures on CUDA - stay bounded
however many step sizes the engine meets. CPU: the same static buffers, run eagerly."""
import numpy as np

from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.inputs.static import StaticInputPool
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import load_model
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams

SIZES = (8, 16, 32, 64, 128)


def old_rule_sizes(bounds: list[int], padded_total: int) -> list[int]:
    """The rule the graph buckets replaced: each microbatch at its real size, all padding on the last."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    sizes[-1] += padded_total - bounds[-1]
    return sizes


def test_static_buffer_sets_stay_bounded_over_many_step_sizes():
    loaded = load_model()
    cfg = RunnerConfig(max_num_seqs=10, max_model_len=256, max_num_batched_tokens=128, num_blocks=256,
                       graph_sizes=SIZES, microbatch=MicrobatchConfig(2, "requests", 0, 0, when="always"))
    engine = LLMEngine(loaded, cfg)
    rng = np.random.default_rng(0)
    for i in range(10):  # prompts of many lengths, finishing at different steps: many distinct step sizes
        engine.add_request(f"r{i}", rng.integers(6, 4000, int(rng.integers(1, 50))).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(2, 14)), temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished() and len(steps) < 60:
        res = engine.step()
        if res.output is not None:
            steps.append(res.output.bounds)
    engine.close()
    pool = engine.runner.static
    keys = set(pool._pool)
    bound = 2 * 2 * len(SIZES)  # microbatches * (parts + whole sizes) per microbatch count
    assert len({b[-1] for b in steps}) >= 6, "the workload should meet many step sizes"
    assert len(keys) <= bound, (len(keys), sorted(keys))
    # the old rule (all padding to the last microbatch) makes a key per step size: the bound is what fails
    old = set()
    for b in steps:
        sizes = old_rule_sizes(b, StaticInputPool(list(SIZES)).padded_size(b[-1]))
        old |= {(k, s) for k, s in enumerate(sizes)}
    assert len(old) > len(keys)
    print(f"{len(steps)} steps, {len({b[-1] for b in steps})} step sizes: {len(keys)} buffer sets "
          f"(bound {bound}); the old rule would need {len(old)}")
