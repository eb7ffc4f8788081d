"""The OpenAI API surface with the official `openai` client: n, best_of, logprobs, echo, prompt
lists, penalties, logit_bias, min_tokens, max_completion_tokens, stream_options; /tokenize,
/detokenize, /version, /v1/models/{id}; /openapi.json schemas; the API key; /metrics parsed by
prometheus_client's own parser.

Every logprob is checked against an independent float64 log-softmax of the logits the server's
runner produced for that very row (recorded by wrapping the runner), to 1e-6; tokens are checked
against the same request run alone on a bare engine."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.llm import build_engine
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams
from engram_serve.server.api import build_app
from engram_serve.server.run import BackgroundServer

MODEL = "engram-api"
KEY = "sk-test-key"
OPTS = dict(max_model_len=128, num_blocks=96, max_num_seqs=16)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = None if (TINY_DIR / "model.safetensors").is_file() else \
        make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=1)
    return load_model(path)


@pytest.fixture(scope="module")
def served(loaded):
    """A server whose runner records, per (request seed, output position), the logits row it sampled from."""
    engine = build_engine(loaded, **OPTS)
    record: dict[tuple[int, int], torch.Tensor] = {}
    original = engine.runner.execute

    def execute(batch, bounds=None, record_=False, score_rows=None):
        out = original(batch, bounds, record_, score_rows)
        by_slot = {s.slot: s for s in engine.seqs.values()}
        for i, slot in enumerate(batch.req_slots[batch.sample].tolist()):
            s = by_slot[slot]
            record[(s.params.seed, s.num_output_tokens)] = out.logits[i].clone()
        return out

    engine.runner.execute = execute
    async_engine = AsyncLLMEngine(engine)
    server = BackgroundServer(build_app(async_engine, MODEL, api_key=KEY)).start()
    yield server, async_engine, record
    server.stop()
    async_engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0].base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def alone(loaded, prompt_ids, params) -> list[int]:
    e = LLMEngine(loaded, RunnerConfig(**OPTS))
    e.add_request("r", prompt_ids, params)
    out = []
    while e.has_unfinished():
        out += [ev.token for ev in e.step().events if ev.token is not None]
    e.close()
    return out


def test_n_logprobs_echo_penalties_bias_plain_and_streamed(client, served, loaded):
    record = served[2]
    tok = loaded.tokenizer
    prompt = "def add(a, b):"
    ids = tok.encode(prompt).ids
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.9, seed=500, n=3, logprobs=5,
              presence_penalty=0.7, frequency_penalty=0.3, logit_bias={"13": 3.0, "204": -100},
              extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.2, "min_p": 0.01})
    r = client.completions.create(**kw)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    texts = set()
    for j, c in enumerate(r.choices):
        params = SamplingParams(max_tokens=6, temperature=0.9, seed=500 + j, presence_penalty=0.7,
                                frequency_penalty=0.3, logit_bias={13: 3.0, 204: -100}, repetition_penalty=1.2,
                                min_p=0.01, ignore_eos=True)
        token_ids = c.model_extra["token_ids"]
        assert token_ids == alone(loaded, ids, params) and 204 not in token_ids
        assert c.text == tok.decode(token_ids)
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
        for pos, (t, value, top) in enumerate(zip(token_ids, lp.token_logprobs, lp.top_logprobs)):
            ref = torch.log_softmax(record[(500 + j, pos)].double(), dim=0)  # independent, float64
            assert abs(value - float(ref[t])) < 1e-6
            # keys are token texts (two ids may share one); the values are the 5 largest logprobs
            assert sorted(top.values(), reverse=True) == pytest.approx(ref.topk(5).values.tolist()[:len(top)],
                                                                       abs=1e-6)
        texts.add(c.text)
    assert len(texts) > 1  # the choices sample with different seeds
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 18

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    got = {i: [] for i in range(3)}
    for ch in chunks:
        for c in ch.choices:
            got[c.index] += c.model_extra["token_ids"]
    assert [got[i] for i in range(3)] == [c.model_extra["token_ids"] for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 18

    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, echo=True, stream=True) if c.choices)
    assert streamed == echo.choices[0].text


def test_prompt_lists_of_text_and_token_ids(client, loaded):
    p = ["import os", "class A:"]
    ids = [loaded.tokenizer.encode(x).ids for x in p]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0.0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=False)
    for i, c in enumerate(r.choices):
        assert c.text == loaded.tokenizer.decode(alone(loaded, ids[i // 2], greedy))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.0, n=2)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    streamed = {i: "" for i in range(4)}
    for ch in client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0.0, n=2, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in r.choices]


def test_best_of_returns_the_highest_cumulative_logprob(client, served):
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, temperature=1.2, seed=77, n=1,
                                  best_of=4, logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    every = client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, temperature=1.2, seed=77, n=4,
                                      logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = every.choices[max(range(4), key=lambda j: (sums[j], -j))]
    assert r.choices[0].model_extra["token_ids"] == best.model_extra["token_ids"]


def test_chat_logprobs_n_and_max_completion_tokens(client, served, loaded):
    record = served[2]
    msgs = [{"role": "user", "content": "Write a loop."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=5, seed=900, n=2,
                                       temperature=0.8, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(r.choices) == 2
    for j, c in enumerate(r.choices):
        toks = c.model_extra["token_ids"]
        assert len(toks) == 5 and len(c.logprobs.content) == 5
        for pos, (t, item) in enumerate(zip(toks, c.logprobs.content)):
            ref = torch.log_softmax(record[(900 + j, pos)].double(), dim=0)
            assert abs(item.logprob - float(ref[t])) < 1e-6
            assert [x.logprob for x in item.top_logprobs] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-6)
            assert bytes(item.bytes).decode("utf-8", "replace") in loaded.tokenizer.decode([t]) or \
                item.token.startswith("bytes:")
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=5, seed=900, n=2,
                                                 temperature=0.8, logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert [text[0], text[1]] == [c.message.content for c in r.choices]


def test_refused_and_unknown_fields_are_400_naming_them(client, served):
    for body, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"tool_choice": "auto"}, "tool_choice"), ({"tools": [{"type": "function"}]}, "tools"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"frobnicate": 1}, "frobnicate"), ({"top_logprobs": 2}, "top_logprobs")):
        r = httpx.post(served[0].base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": [{"role": "user", "content": "x"}], **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = httpx.post(served[0].base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"},
                          "tool_choice": "none", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200  # their "off" values are fine


def test_tokenize_detokenize_version_model_card(served, loaded):
    base, h = served[0].base_url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/tokenize", json={"prompt": "hello world"}, headers=h).json()
    assert r["tokens"] == loaded.tokenizer.encode("hello world").ids and r["count"] == len(r["tokens"])
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}, headers=h).json() == {"prompt": "hello world"}
    bad = httpx.post(base + "/detokenize", json={"tokens": [1, 99999]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h).json()
    assert chat["count"] > 2
    from engram_serve import __version__
    assert httpx.get(base + "/version", headers=h).json() == {"version": __version__}
    assert httpx.get(base + f"/v1/models/{MODEL}", headers=h).json()["id"] == MODEL
    assert httpx.get(base + "/v1/models/other", headers=h).status_code == 404


def test_api_key_is_required_except_on_health_and_metrics(served):
    base = served[0].base_url
    for path in ("/v1/models", "/version", f"/v1/models/{MODEL}"):
        r = httpx.get(base + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(base + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_openapi_publishes_request_and_response_schemas(served):
    spec = httpx.get(served[0].base_url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    comps = spec["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "CompletionResponse", "ChatCompletionResponse",
                 "ErrorResponse", "TokenizeRequest", "ModelList"):
        assert name in comps, name
    op = spec["paths"]["/v1/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "400" in op["responses"] and "413" in op["responses"]
    assert comps["CompletionRequest"]["additionalProperties"] is False


def test_metrics_parse_with_prometheus_client_and_histograms_count_requests(loaded):
    engine = AsyncLLMEngine(build_engine(loaded, **OPTS))
    with BackgroundServer(build_app(engine, MODEL)) as server:
        c = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(3):
            c.completions.create(model=MODEL, prompt=f"n{i}", max_tokens=4, temperature=0.0,
                                 extra_body={"ignore_eos": True})
        list(c.completions.create(model=MODEL, prompt="s", max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "e", "max_tokens": 2, "top_p": 0})
        assert r.status_code == 400  # refused: never counted as a request
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)}
    engine.shutdown()

    def sample(family, suffix, **labels):
        return next(s.value for s in families[family].samples
                    if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    for h in ("engram_time_to_first_token_seconds", "engram_e2e_request_latency_seconds",
              "engram_request_queue_time_seconds"):
        assert families[h].type == "histogram" and sample(h, "_count") == 4, h
    assert sample("engram_inter_token_latency_seconds", "_count") == 4 * 3
    assert sample("engram_generation_tokens", "_total") == 16
    assert sample("engram_requests_finished", "_total", finished_reason="length") == 4
    assert sample("engram_requests_finished", "_total", finished_reason="error") == 0
    assert sample("engram_requests", "_total") == 4
    assert families["engram_kv_cache_usage_ratio"].type == "gauge"
    assert sample("engram_prompt_tokens", "_total") > 0


def test_big_counters_keep_every_digit(loaded):
    from engram_serve.server.metrics import ServerMetrics

    class Fake:
        observers = []

        def metrics(self):
            return {"generated_tokens_total": 123456789012, "finished": {"error": 7}}
    text = ServerMetrics(Fake()).render().decode()
    assert "engram_generation_tokens_total 1.23456789012e+11" in text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    assert fam["engram_generation_tokens"].samples[0].value == 123456789012
