"""The CUDA path end to end. Skipped without CUDA: run by scripts/gpu_check.sh, never needed in CI."""
import pytest
import torch

from engram_serve.llm import LLM
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def __init__(self):"]


def test_device_cuda_places_weights_kv_and_staging_and_keeps_tables_on_the_host():
    llm = LLM(device="cuda")
    r = llm.engine.runner
    assert all(p.device.type == "cuda" for p in r.model.parameters())
    assert r.kv.device.type == "cuda" and all(b.staging.is_cuda for b in r.bufs)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in r.loaded.tables.tables)
    assert r.copy_stream is not None
    llm.close()


def test_cuda_greedy_tokens_match_cpu_with_microbatches_and_static_buffers():
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = LLM(microbatch=MicrobatchConfig(1))
    want = [o.token_ids for o in cpu.generate(PROMPTS, p)]
    cpu.close()
    always = MicrobatchConfig(2, "tokens", 0, 0, when="always")
    for kw in ({"microbatch": always}, {"microbatch": always, "graph_sizes": (4, 8, 16, 32, 64, 1024)}):
        gpu = LLM(device="cuda", **kw)
        got = [o.token_ids for o in gpu.generate(PROMPTS, p)]
        gpu.close()
        assert got == want, kw


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL tensor parallelism")
def test_tensor_parallel_nccl_matches_one_gpu():
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM(device="cuda")
    want = [o.token_ids for o in one.generate(PROMPTS, p)]
    one.close()
    tp = LLM(device="cuda", tensor_parallel_size=2, microbatch=MicrobatchConfig(2, "tokens", 0, 0, when="always"))
    got = [o.token_ids for o in tp.generate(PROMPTS, p)]
    tp.close()
    assert got == want
