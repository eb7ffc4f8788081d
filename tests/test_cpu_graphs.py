"""CPU graphs (runner/cpu_graphs.py): a replayed decode step gives the logits of the eager one, bit for bit, on the
built-in V4.1 model (Engram, every layer role), with requests of different lengths arriving and finishing,
one or two microbatches, and positions crossing the static bound (a new capture).

Negative controls, each red through the real engine: replays without rebinding the step's addresses (they
read the capture's inputs); the capture's operator guard off with a torch operator in the layers (the replay
skips it); the MoE's host read of its expert counts not reported (the replay repeats the captured routing).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_serve import kernels
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import capture, deepseek_v41 as v41, ops_c, ops_torch
from engram_serve.model.loader import load_model
from engram_serve.runner import cpu_graphs
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_graphs.CpuGraphs.available(),
                                reason="the linear and token kernels are not loaded (`engram-serve env` says why)")


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def engine(loaded, graphs: bool, microbatches: int = 1) -> LLMEngine:
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=160, max_num_batched_tokens=256, num_blocks=64,
                       microbatch=MicrobatchConfig(microbatches, "tokens", 0, 0, when="always"), cpu_graphs=graphs)
    return LLMEngine(loaded, cfg, enable_prefix_caching=False)


def decode_logits(eng: LLMEngine, steps: int = 40) -> list[torch.Tensor]:
    """Requests of 20, 55 and 9 prompt tokens (the third arrives later): the logits of every step."""
    rng = np.random.default_rng(0)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 40, 12)]
    prompts = [rng.integers(6, 4096, n).tolist() for n in (20, 55, 9)]
    eng.add_request("a", prompts[0], params[0])
    eng.add_request("b", prompts[1], params[1])
    out = []
    for i in range(steps):
        if i == 5:
            eng.add_request("c", prompts[2], params[2])
        res = eng.step()
        if res.output is not None:
            out.append(res.output.logits.clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def wrong(eng: LLMEngine, eager: list[torch.Tensor]) -> bool:
    """The engine's decode differs from the eager logits, or fails (stale ids outside the vocabulary)."""
    try:
        return not same(decode_logits(eng), eager)
    except ValueError:
        return True


@pytest.mark.parametrize("microbatches", [1, 2])
def test_replayed_decode_steps_have_the_eager_bits(loaded, microbatches):
    eager = decode_logits(engine(loaded, False, microbatches))
    eng = engine(loaded, True, microbatches)
    got = decode_logits(eng)
    g = eng.runner.cpu_graphs
    assert g.replays > 10 and g.captures >= 2  # replays happened, and positions crossed the bound (64 -> 128)
    assert same(got, eager)


def lone_prompt_logits(eng: LLMEngine) -> list[torch.Tensor]:
    """One request at a time (prompts of 30 tokens, then one of 70, chunked 64 + 6 by the step budget of
    `lone_engine`): the logits of every step."""
    rng, out = np.random.default_rng(1), []
    for i, n in enumerate((30, 30, 30, 70, 30)):
        eng.add_request(f"r{i}", rng.integers(6, 4096, n).tolist(), SamplingParams(max_tokens=3, temperature=0.0))
        while eng.has_unfinished():
            res = eng.step()
            if res.output is not None:
                out.append(res.output.logits.clone())
    return out


def lone_engine(loaded, graphs: bool) -> LLMEngine:
    return LLMEngine(loaded, RunnerConfig(max_num_seqs=4, max_model_len=160, max_num_batched_tokens=64,
                                          num_blocks=64, cpu_graphs=graphs), enable_prefix_caching=False)


def test_lone_prompts_replay_with_the_eager_bits(loaded):
    """Every step's logits equal the eager engine's, and a one-row prompt step was replayed."""
    eng = lone_engine(loaded, True)
    assert same(lone_prompt_logits(eng), lone_prompt_logits(lone_engine(loaded, False)))
    g = eng.runner.cpu_graphs
    assert g.replays and any(graph.out[0].shape[0] == 30 for graph in g._graphs.values())
    assert 0 < g.nbytes <= g.MAX_BYTES


def test_the_bound_rounds_up_to_a_power_of_two_within_the_limit():
    assert [cpu_graphs.bound(p, 160) for p in (0, 62, 63, 64, 127, 128, 159)] == [64, 64, 64, 128, 128, 160, 160]


class NoRebind(cpu_graphs.CpuGraphs):
    rebind = False


class NoGuard(cpu_graphs._Watch):
    guard = False


class Unguarded(cpu_graphs.CpuGraphs):
    watch = NoGuard


def with_graphs(loaded, cls) -> LLMEngine:
    eng = engine(loaded, True)
    eng.runner.cpu_graphs = cls(eng.runner.model, eng.runner.cfg.max_model_len)
    return eng


def test_negative_control_replays_without_rebinding_read_the_capture_inputs(loaded):
    """Prompt steps build fresh inputs (a decode step's stay in place: inputs/decode.py)."""
    eager = lone_prompt_logits(lone_engine(loaded, False))
    eng = lone_engine(loaded, True)
    eng.runner.cpu_graphs = NoRebind(eng.runner.model, eng.runner.cfg.max_model_len)
    assert not same(lone_prompt_logits(eng), eager)


def test_negative_control_an_unguarded_capture_skips_a_torch_operator(loaded, monkeypatch):
    """collapse in its torch form (the token kernel off for it): a guarded capture is refused (the key runs
    eagerly, the eager bits); an unguarded one replays without the operators, so stale streams."""
    monkeypatch.setattr(ops_c, "collapse", ops_torch.collapse)
    eager = decode_logits(engine(loaded, False))
    guarded = with_graphs(loaded, cpu_graphs.CpuGraphs)
    assert same(decode_logits(guarded), eager) and guarded.runner.cpu_graphs.replays == 0
    assert wrong(with_graphs(loaded, Unguarded), eager)


def test_negative_control_an_unreported_host_read_replays_a_stale_routing(monkeypatch):
    """The MoE's per-expert loop (its one-call form off) reads the counts on the host: reported, the capture is
    refused; not reported, the replay repeats the captured step's experts (a sharper router, so that the
    experts change from token to token)."""
    loaded = load_model()
    with torch.no_grad():
        for blk in loaded.model.layers:
            blk.ffn.gate.weight.mul_(40.0)
    monkeypatch.setattr(v41.MoE, "_expert_panels", lambda self, xs, counts, ops: None)
    eager = decode_logits(engine(loaded, False))
    reported = with_graphs(loaded, cpu_graphs.CpuGraphs)
    assert same(decode_logits(reported), eager) and reported.runner.cpu_graphs.replays == 0
    monkeypatch.setattr(capture, "refuse", lambda reason: None)
    assert wrong(with_graphs(loaded, cpu_graphs.CpuGraphs), eager)


def test_the_one_call_experts_have_the_bits_of_the_per_expert_calls(loaded):
    """MoE.experts in one linear-kernel call (the serving layout) against the per-expert loop, on grouped rows."""
    moe = loaded.model.layers[1].ffn
    x = torch.randn(13, loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, _ = moe.route(x, ops_c)
    order, counts, tok = ops_c.moe_group(ids, loaded.config.n_routed_experts)
    xs = ops_c.gather_rows(x, tok)[:, 0]
    assert moe._expert_panels(xs, counts, ops_c) is not None
    one = moe.experts(xs, counts, ops_c)
    parts, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            parts.append(moe.expert(e, xs[start:start + c], ops_c))
        start += c
    assert torch.equal(one, torch.cat(parts))


@pytest.mark.skipif(not cpu_graphs.CpuGraphs.available(), reason="CPU graphs need the C kernels")
def test_raw_replays_read_the_per_step_tensor_at_its_new_address():
    """A call of a kernel with a raw entry replays from 64-bit slots, its per-step addresses rewritten in place:
    an RMSNorm (its eps a double slot) and a matmul of the microbatch's `rows` (float here, for the test) compute
    on this step's tensor, equal to calling the kernels again; negative control: without rebinding they read the
    capture's tensor."""
    tok, lin = kernels.get("token"), kernels.get("linear")
    g = torch.Generator().manual_seed(0)
    first, w = torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    panels = torch.randn(2, 32, 16, generator=g)
    normed, y = torch.empty(3, 32), torch.empty(3, 32)
    tape = []
    with capture.recording(tape):
        capture.call(tok.rms_norm, x=first.data_ptr(), rows=3, dim=32, w=w.data_ptr(), eps=1e-6, out=normed.data_ptr())
        capture.call(lin.linear_packed, x=normed.data_ptr(), ldx=32, panels=panels.data_ptr(), y=y.data_ptr(), m=3,
                     k=32, n=32, kc=32, simd=2)
    span = (first.data_ptr(), first.data_ptr() + first.numel() * 4)
    graph = cpu_graphs._Graph(tape, {"rows": span}, y, [first, normed], 0)
    assert sum(len(c) == 3 for c in graph._raw if c is not None) == 2  # both replay raw
    for rebind in (True, False):
        step = torch.randn(3, 32, generator=g)
        want_x = step if rebind else first
        want = torch.empty(3, 32)
        tok.rms_norm(x=want_x.data_ptr(), rows=3, dim=32, w=w.data_ptr(), eps=1e-6, out=normed.data_ptr())
        lin.linear_packed(x=normed.data_ptr(), ldx=32, panels=panels.data_ptr(), y=want.data_ptr(), m=3, k=32, n=32,
                          kc=32, simd=2)
        y.zero_()
        assert torch.equal(graph.replay({"rows": step}, rebind).clone(), want)


def test_no_module_is_imported_inside_the_first_requests():
    """A fresh process: building an engine imports what its steps will (a capture's dispatch mode imports
    torch._dynamo at first use, ~1 s), so that the first requests, a greedy one and a sampled one with logprobs,
    whose steps capture and replay graphs, import no module. Red if `CpuGraphs` does not import it up front."""
    import subprocess
    import sys
    from pathlib import Path
    code = """
import sys
from engram_serve.engine.factory import build_engine
from engram_serve.sampling_params import SamplingParams
engine = build_engine(None, threads=1)
before = set(sys.modules)
engine.add_request("a", list(range(10, 40)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
engine.add_request("b", list(range(10, 30)), SamplingParams(max_tokens=8, temperature=0.7, seed=1, logprobs=2))
while engine.has_unfinished():
    engine.step()
assert engine.runner.cpu_graphs.captures, "no graph was captured"
print(sorted(set(sys.modules) - before))
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "[]", f"modules imported inside the first requests' steps: {out.stdout[:500]}"
