"""Sampling extras and failure isolation end to end through the engine.

- penalties, min_p, logit_bias, min_tokens, logprobs and per-choice seeds give the same tokens and
  logprobs for a request alone (whole steps) and inside a busy batch cut into microbatches;
- logprobs equal an independent float64 log-softmax of the logits the runner produced, to 1e-6;
- a runner failure caused by one request ends only that request (with a negative control);
- the Python API refuses every malformed argument with InvalidRequest.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_serve import thread_pool
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.engine.threads import available_cores
from engram_serve.errors import InvalidRequest
from engram_serve.llm import LLM
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams

OPTS = dict(max_model_len=128, num_blocks=64, max_num_seqs=8)
FORCE_MICROBATCHES = MicrobatchConfig(num_microbatches=2, decode_threshold=2, prefill_threshold=2, when="always")
PROMPTS = ["Hello world", "The quick brown fox jumps", "Once upon a time there was", "1 2 3 4 5 6 7",
           "import os\nimport sys\n", "def main():"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    if (TINY_DIR / "model.safetensors").is_file():
        return load_model()
    return load_model(make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0))


def extras(i: int) -> SamplingParams:
    return [SamplingParams(max_tokens=8, temperature=0.8, seed=11, presence_penalty=1.5, frequency_penalty=0.5,
                           logprobs=3, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.8, logit_bias={13: 4.0, 5: -100.0},
                           logprobs=0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=1.1, seed=-5, min_p=0.05, top_k=40, logprobs=5, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.7, seed=2 ** 40, top_p=0.8, min_tokens=6, stop_token_ids=[11],
                           logprobs=2),
            SamplingParams(max_tokens=8, temperature=0.9, seed=3, logit_bias={7: 2.5}, repetition_penalty=0.7,
                           ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8, ignore_eos=False, logprobs=1)][i]


def test_extras_alone_equal_extras_in_a_busy_microbatched_batch(loaded):
    alone_llm = LLM(loaded, **OPTS, microbatch=MicrobatchConfig(num_microbatches=1))
    alone = [alone_llm.generate(p, extras(i))[0] for i, p in enumerate(PROMPTS)]
    busy = LLM(loaded, **OPTS, microbatch=FORCE_MICROBATCHES)
    noise = [SamplingParams(max_tokens=12, temperature=1.0, seed=900 + j, ignore_eos=True) for j in range(4)]
    outs = busy.generate(PROMPTS + [f"noise {j} " * (j + 1) for j in range(4)],
                         [extras(i) for i in range(len(PROMPTS))] + noise)
    assert busy.stats.microbatched_steps > 0 and busy.stats.straddling_rows > 0
    for a, b in zip(alone, outs):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs  # bit for bit: the forward is batch-invariant, so is the sampler
    assert all(len(o.logprobs[0][1]) == extras(i).logprobs for i, o in enumerate(alone) if o.logprobs)


def test_min_tokens_bans_the_stop_tokens_until_reached(loaded):
    llm = LLM(loaded, **OPTS)
    free = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop = free.token_ids[0]  # the greedy first token: a stop token would end the request at once
    early = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]))[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    late = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop],
                                                   min_tokens=4))[0]
    assert stop not in late.token_ids[:4] and len(late.token_ids) >= 4


def test_logprobs_equal_an_independent_log_softmax_of_the_runner_logits(loaded, monkeypatch):
    engine = LLMEngine(loaded, RunnerConfig(**OPTS))
    seen = []
    original = engine.runner.execute

    def execute(batch, bounds=None, record=False, score_rows=None):
        out = original(batch, bounds, record, score_rows)
        seen.append(out.logits.clone())
        return out

    monkeypatch.setattr(engine.runner, "execute", execute)
    ids = loaded.tokenizer.encode(PROMPTS[1]).ids
    engine.add_request("a", ids, SamplingParams(max_tokens=6, temperature=0.9, seed=4, logprobs=5, ignore_eos=True,
                                                presence_penalty=1.0))
    events = []
    while engine.has_unfinished():
        events += [e for e in engine.step().events if e.token is not None]
    assert len(events) == len(seen) == 6
    for ev, logits in zip(events, seen):
        ref = torch.log_softmax(logits[0].double(), dim=0)  # float64, independent of the sampler
        assert abs(ev.logprob - float(ref[ev.token])) < 1e-6
        top = ref.topk(5)
        assert [t for t, _ in ev.top_logprobs] == top.indices.tolist()
        assert max(abs(v - float(w)) for (_, v), w in zip(ev.top_logprobs, top.values)) < 1e-6
    engine.close()


class Boom(RuntimeError):
    pass


def explode_on(monkeypatch, engine, marker):
    """The runner raises (as the hash kernel did for a bad id) whenever a step holds the marked request."""
    original = engine.runner.execute

    def execute(batch, bounds=None, record=False, score_rows=None):
        slots = set(batch.req_slots.tolist())
        if any(s.slot in slots for s in engine.seqs.values() if s.token_ids[:len(marker)] == marker
               and s.num_output_tokens >= 2):
            raise Boom("kernel refused an id")
        return original(batch, bounds, record, score_rows)

    monkeypatch.setattr(engine.runner, "execute", execute)


class NoIsolation(LLMEngine):
    """Negative control: no culprit search; a failing step ends every request (as before isolation)."""

    def _culprits(self, rows, sample, run, error):
        self.stats.step_failures += 1
        return list(range(len(rows)))

    def step(self, bounds=None, record=False):
        try:
            return super().step(bounds, record)
        except Boom as e:
            from engram_serve.engine.llm_engine import StepResult
            from engram_serve.engine.scheduler import SchedulerOutput
            return StepResult(self._end_rows([type("R", (), {"seq": s}) for s in list(self.seqs.values())], e),
                              SchedulerOutput())


@pytest.mark.parametrize("engine_cls, isolated", [(LLMEngine, True), (NoIsolation, False)])
def test_a_failing_row_ends_alone_and_the_step_recovers(loaded, monkeypatch, engine_cls, isolated):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    clean = LLM(loaded, **OPTS).generate(PROMPTS[:4], params)
    llm = LLM(loaded, **OPTS, microbatch=FORCE_MICROBATCHES)
    llm.engine.__class__ = engine_cls
    explode_on(monkeypatch, llm.engine, loaded.tokenizer.encode(PROMPTS[1]).ids)
    outs = llm.generate(PROMPTS[:4], params)
    assert outs[1].finish_reason == "error" and "kernel refused" in outs[1].error
    assert outs[1].token_ids == clean[1].token_ids[:2]
    others_fine = all(outs[i].token_ids == clean[i].token_ids and outs[i].finish_reason == "length"
                      for i in (0, 2, 3))
    assert others_fine is isolated
    assert llm.engine.stats.step_failures >= 1
    assert (llm.engine.stats.errors == 1) is isolated
    e = llm.engine
    assert e.scheduler.block_manager.num_used == 0 and e.runner.store.num_free == e.cfg.max_num_seqs


def test_python_api_refuses_malformed_arguments(loaded):
    e = LLMEngine(loaded, RunnerConfig(**OPTS))
    ids = [5, 6, 7]
    for dead, needle in ((True, "dead=True"), ("1111111111", "dead='1111111111'"), ([True, 2, False], "dead[1]=2"),
                         ([True], "dead: 1 flags for a prompt of 3 tokens")):
        with pytest.raises(InvalidRequest, match=needle.replace("[", r"\[").replace("(", r"\(")):
            e.add_request(f"d{dead!r}", ids, dead=dead)
    with pytest.raises(InvalidRequest, match=r"stop_token_ids\[1\]=4096: outside the tokenizer"):
        e.add_request("s", ids, SamplingParams(stop_token_ids=[1, 4096]))
    with pytest.raises(InvalidRequest, match="logit_bias: token id 5000"):
        e.add_request("b", ids, SamplingParams(logit_bias={5000: 1.0}))
    for prompt, needle in (([5, True], "prompt: token 1 is True"), ([5, 6.0], r"prompt: token 1 is 6.0 \(float\)"),
                           ([5, 4096], r"prompt: token id 4096 at index 1 is outside the tokenizer's ids \[0, 4096\)"),
                           ([-1, 5], "prompt: token id -1 at index 0"),
                           (np.array([7, 5000]), "prompt: token id 5000 at index 1"),
                           (np.array([7, 2**64 - 1], dtype=np.uint64), f"prompt: token id {2**64 - 1} at index 1"),
                           (np.array([True, False]), "prompt: token 0 is (np.)?True")):
        with pytest.raises(InvalidRequest, match=needle):
            e.add_request("t", prompt, SamplingParams())
    e.add_request("ok", np.array([5, 6, 7], dtype=np.int64), SamplingParams(max_tokens=2))
    assert e.seqs["ok"].token_ids == [5, 6, 7] and all(type(t) is int for t in e.seqs["ok"].token_ids)
    for bounds in ([1, 3], [0, 2], [0, 3, 3], [0, "a", 3], [0, 1, 2, 3], "0,3", [0]):
        with pytest.raises(InvalidRequest, match="bounds="):
            e.step(bounds=bounds)
    while e.has_unfinished():
        e.step()
    assert not e.seqs
    e.close()
    llm = LLM(loaded, **OPTS)
    out = llm.generate([np.int64(5), np.int64(6)], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and out[0].prompt_token_ids == [5, 6]
    with pytest.raises(InvalidRequest, match="prompts"):
        llm.generate(5)


def test_thread_count_defaults_to_the_affinity_mask(monkeypatch):
    import engram_serve.engine.threads as th
    monkeypatch.setattr(th, "_chosen", None)
    monkeypatch.delenv(th.ENV, raising=False)
    monkeypatch.setattr(th.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    before, pool_before = torch.get_num_threads(), thread_pool.threads()
    try:
        assert th.set_torch_threads() == 3 == torch.get_num_threads()
        assert thread_pool.threads() == (3 if thread_pool.built() else 1)  # the C kernels' pool takes the count too
        assert th.set_torch_threads() == 3  # set once: a later engine keeps it
        assert th.set_torch_threads(1) == 1 == torch.get_num_threads()  # an explicit count wins
        monkeypatch.setattr(th, "_chosen", None)
        monkeypatch.setenv(th.ENV, "2")
        assert th.set_torch_threads() == 2
        monkeypatch.setattr(th, "_chosen", None)
        monkeypatch.setenv(th.ENV, "zero")
        with pytest.raises(Exception, match="ENGRAM_SERVE_THREADS='zero'"):
            th.set_torch_threads()
    finally:
        torch.set_num_threads(before)
        thread_pool.set_threads(pool_before)
    assert available_cores() >= 1
