"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `/v1/completions` with `echo` and `logprobs`), as vLLM
serves them: every prompt token's logprob (the first: none) and the top ones at its position, from the same
float32 logits as sampling. They equal the log-softmax of a full-sequence forward of the model bit for bit,
whatever the chunking, the microbatch cut and the batch mates; a request that asks computes every prompt
position (no cached prefix is reused for it)."""
from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.engram.hashing import hash_step
from engram_serve.errors import InvalidRequest
from engram_serve.llm import LLM, build_engine
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import load_model
from engram_serve.sampling_params import SamplingParams
from engram_serve.server.api import build_app
from engram_serve.server.run import BackgroundServer

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def full_sequence_logprobs(lm, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of token p + 1 at position p, log-softmax rows) from one forward_dense pass, float32 as served."""
    e = lm.config.engram
    t = torch.tensor(ids)
    h = hash_step(t, torch.tensor([0, len(ids)]), torch.full((1, e.history_len), -1), lm.layout, lm.token_map,
                  int(lm.token_map[e.engram_pad_token_id]))
    staged = torch.empty(e.num_layers, len(ids), e.num_columns, e.engram_head_dim)
    lm.tables.gather(h, staged)
    with torch.no_grad():
        logits = lm.model.forward_dense(t[None], [staged[i][None] for i in range(e.num_layers)])[0, :, :4096]
    lp = logits - torch.logsumexp(logits, 1, keepdim=True)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], lp


@pytest.mark.parametrize("chunk, cut", [(512, False), (7, False), (7, True)])
def test_prompt_logprobs_equal_a_full_sequence_pass_bit_for_bit(loaded, chunk, cut):
    mb = MicrobatchConfig(2, "tokens", 2, 2, when="always") if cut else MicrobatchConfig(1)
    llm = LLM(loaded, max_num_batched_tokens=max(chunk, 4), max_num_seqs=4, microbatch=mb)
    mates = [list(range(300, 330)), list(range(900, 917))]
    outs = llm.generate([PROMPT, *mates], [SamplingParams(max_tokens=0, prompt_logprobs=3),
                                           SamplingParams(max_tokens=4), SamplingParams(max_tokens=2, prompt_logprobs=0)])
    want, lp = full_sequence_logprobs(loaded, PROMPT)
    got = outs[0].prompt_logprobs
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    assert got[0] is None and len(got) == len(PROMPT)
    assert torch.equal(torch.tensor([g[0] for g in got[1:]]), want)  # tolerance 0
    top = lp[5].topk(3)
    assert [i for i, _ in got[6][1]] == top.indices.tolist() and [v for _, v in got[6][1]] == top.values.tolist()
    assert outs[2].prompt_logprobs[1][1] == [] and len(outs[2].token_ids) == 2
    assert outs[1].prompt_logprobs is None


def test_a_scoring_request_reuses_no_cached_prefix(loaded):
    llm = LLM(loaded, max_num_seqs=4)
    llm.generate([PROMPT], SamplingParams(max_tokens=1))  # its blocks are now cached
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert all(x is not None for x in out.prompt_logprobs[1:])
    assert torch.equal(torch.tensor([x[0] for x in out.prompt_logprobs[1:]]), full_sequence_logprobs(loaded, PROMPT)[0])


@pytest.mark.parametrize("kw, param", [({"prompt_logprobs": 21}, "prompt_logprobs"),
                                       ({"prompt_logprobs": -1}, "prompt_logprobs"),
                                       ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
                                       ({"max_tokens": 0}, "max_tokens")])
def test_bad_prompt_logprobs_are_refused_naming_the_field(kw, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.fixture(scope="module")
def server(loaded):
    engine = AsyncLLMEngine(build_engine(loaded, max_model_len=256, num_blocks=64, max_num_seqs=8))
    srv = BackgroundServer(build_app(engine, "engram-test")).start()
    yield srv
    srv.stop()
    engine.shutdown()


def test_openai_client_echo_logprobs_scores_the_prompt(server, loaded):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    want = full_sequence_logprobs(loaded, PROMPT)[0].tolist()
    r = client.completions.create(model="engram-test", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == want and len(lp.tokens) == len(PROMPT)
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs[3]) <= 2
    r = client.completions.create(model="engram-test", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3 and lp.token_logprobs[1:len(PROMPT)] == want
    stream = client.completions.create(model="engram-test", prompt=PROMPT, echo=True, logprobs=1, max_tokens=2,
                                       stream=True)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert chunks[0].token_logprobs[0] is None and chunks[0].token_logprobs[1:len(PROMPT)] == want


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "engram-test", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_non_finite_prompt_logits_end_only_that_request(loaded, monkeypatch):
    """A request whose prompt logits are NaN ends with an error (no NaN reaches its output); its batch mate
    is untouched."""
    llm = LLM(loaded, max_num_seqs=4)
    mate = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    real = llm.engine.runner.execute

    def poisoned(batch, bounds=None, record=False, score_rows=None):
        out = real(batch, bounds, record, score_rows)
        if out.scored is not None:
            out.scored[:] = float("nan")
        return out

    monkeypatch.setattr(llm.engine.runner, "execute", poisoned)
    bad, good = llm.generate([list(range(60, 70)), PROMPT], [SamplingParams(max_tokens=0, prompt_logprobs=1),
                                                            SamplingParams(max_tokens=3, temperature=0)])
    assert bad.finish_reason == "error" and bad.prompt_logprobs is None and "non-finite" in bad.error
    assert good.token_ids == mate
