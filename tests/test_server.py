"""The OpenAI-compatible server on a real uvicorn (loopback, free port), driven by the official
`openai` client and by httpx for the malformed requests the client would never send."""
from __future__ import annotations

import asyncio
import json
import resource
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.errors import InvalidRequest
from engram_serve.llm import build_engine
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.sampling_params import SamplingParams
from engram_serve.server.api import build_app
from engram_serve.server.chat_template import ChatTemplate
from engram_serve.server.protocol import ChatMessage
from engram_serve.server.run import BackgroundServer

MODEL = "engram-test"
POISON = "POISON marker"  # prompts starting with this get NaN logits from their 3rd token on
SLOW = "SLOW marker"  # a step with a prompt starting with this takes 5 ms more (disconnect tests: the engine
# would otherwise finish a request before the client is gone)


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (a response must never be built from them)."""
    def bad(name):
        raise AssertionError(f"non-finite constant {name} in a response body")
    return json.loads(text, parse_constant=bad)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = None if (TINY_DIR / "model.safetensors").is_file() else \
        make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=1)
    loaded = load_model(path)
    engine = build_engine(loaded, max_model_len=128, num_blocks=64, max_num_seqs=8)
    marker, slow = loaded.tokenizer.encode(POISON).ids, loaded.tokenizer.encode(SLOW).ids
    original = engine.runner.execute

    def execute(batch, bounds=None, record=False, score_rows=None):  # runs on the engine thread, like every engine call
        out = original(batch, bounds, record, score_rows)
        by_slot = {s.slot: s for s in engine.seqs.values()}
        if any(by_slot[slot].token_ids[:len(slow)] == slow for slot in batch.req_slots.tolist()):
            time.sleep(0.005)
        for i, slot in enumerate(batch.req_slots[batch.sample].tolist()):
            s = by_slot[slot]
            if s.token_ids[:len(marker)] == marker and s.num_output_tokens >= 2:
                out.logits[i] = float("nan")
        return out

    engine.runner.execute = execute
    async_engine = AsyncLLMEngine(engine)
    server = BackgroundServer(build_app(async_engine, MODEL)).start()
    yield server, async_engine
    server.stop()
    async_engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0].base_url + "/v1", api_key="x", max_retries=0, timeout=30)


def post(served, path: str, body, timeout: float = 30) -> httpx.Response:
    if not isinstance(body, (str, bytes)):
        body = json.dumps(body)
    return httpx.post(served[0].base_url + path, content=body, headers={"content-type": "application/json"},
                      timeout=timeout)


def wait_idle(async_engine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = async_engine.metrics()
        if m["kv_blocks_used"] == 0 and m["requests_running"] == 0 and m["requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine never went idle: {m}"
        time.sleep(0.02)


def test_completions_plain_and_streaming_agree(client, served):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0.7, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and len(c.model_extra["token_ids"]) == 8
    prompt_ids = served[1].tokenizer.encode("Hello world").ids
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    assert text == c.text and ids == c.model_extra["token_ids"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    again = client.completions.create(**{**kw, "prompt": prompt_ids})
    assert again.choices[0].text == c.text  # token-id prompt == the same text prompt


def test_raw_sse_format_ends_with_done(served):
    with httpx.stream("POST", served[0].base_url + "/v1/completions", timeout=30,
                      json={"prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len(events[:-2]) == 3  # one chunk per token
    for e in events[:-2]:
        strict_json(e[len("data: "):])


def test_chat_completions_plain_and_streaming(client, served):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, seed=5, temperature=0.9, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    m = r.choices[0]
    assert m.message.role == "assistant" and m.finish_reason == "length" and r.usage.completion_tokens == 6
    tok = served[1].tokenizer
    prompt = "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nSay something.<|endoftext|>\n<|assistant|>\n"
    assert r.usage.prompt_tokens == len(tok.encode(prompt).ids)  # the built-in template
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == m.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=5, temperature=0.9,
                                     extra_body={"ignore_eos": True})
    assert same.choices[0].text == m.message.content


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served[0].base_url + "/health").json() == {"status": "ok"}
    text = httpx.get(served[0].base_url + "/metrics").text
    for name in ("engram_requests_running", "engram_requests_waiting", "engram_kv_blocks_used",
                 "engram_kv_cache_usage_ratio", "engram_generation_tokens_total",
                 "engram_microbatched_steps_total", "engram_straddling_rows_total", "engram_kernel_threads",
                 "engram_cpu_graphs", "engram_cpu_graph_bytes"):
        assert f"\n{name} " in "\n" + text, name
    from engram_serve import thread_pool
    assert f"\nengram_kernel_threads {float(thread_pool.threads())}\n" in "\n" + text  # one pool per process


BAD = [  # (path, body, param that must be named)
    ("/v1/completions", "{not json", None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 17}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.01}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', None),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2, 4096]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", 3]}, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 200}, "prompt"),
    ("/v1/completions", {"prompt": list(range(10, 130)), "max_tokens": 16}, "max_tokens"),  # the prompt fits
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": -1}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field_and_the_next_request_succeeds(served, path, body, param):
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    err = strict_json(r.text)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if param is not None:
        assert param.split(".")[0] in err["message"]
    else:
        assert "JSON" in err["message"]
    ok = post(served, "/v1/completions", {"prompt": "fine", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and strict_json(ok.text)["usage"]["completion_tokens"] == 2


def test_bad_input_through_the_openai_client_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)


def test_nan_for_one_request_ends_only_that_one(served):
    bodies = [{"prompt": POISON + " now", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
               "return_token_ids": True}] + \
             [{"prompt": f"normal request {i}", "max_tokens": 6, "seed": i, "ignore_eos": True} for i in range(3)]
    results = [None] * len(bodies)

    def go(i):
        results[i] = post(served, "/v1/completions", bodies[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bad = strict_json(results[0].text)
    c = bad["choices"][0]
    assert results[0].status_code == 200 and c["finish_reason"] == "error"
    assert "non-finite" in c["error"]["message"] and len(c["token_ids"]) == 2  # poisoned at its 3rd token
    assert bad["usage"]["completion_tokens"] == 2
    for r in results[1:]:
        assert r.status_code == 200 and strict_json(r.text)["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", served[0].base_url + "/v1/completions", timeout=30,
                      json={**bodies[0], "stream": True}) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [strict_json(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "error" and chunks[-1]["choices"][0]["error"]["message"]
    assert wait_idle(served[1])["request_errors_total"] >= 2


def test_client_disconnect_mid_stream_frees_the_request(served):
    engine = served[1]
    before = engine.metrics()["generated_tokens_total"]
    with httpx.stream("POST", served[0].base_url + "/v1/completions", timeout=30,
                      json={"prompt": SLOW + " a long one", "max_tokens": 100, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]  # two chunks (each a data line and a blank line)
        assert got[0].startswith("data: ")
        assert engine.metrics()["kv_blocks_used"] > 0
    m = wait_idle(engine)
    assert m["generated_tokens_total"] - before < 100  # it was stopped, not run to the end
    e = engine.engine
    assert e.runner.store.num_free == e.cfg.max_num_seqs and not e.seqs


def test_non_streaming_disconnect_aborts(served):
    engine = served[1]
    before = engine.metrics()["generated_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        post(served, "/v1/completions", {"prompt": SLOW, "max_tokens": 120, "ignore_eos": True}, timeout=0.1)
    m = wait_idle(engine)
    assert m["generated_tokens_total"] - before < 120


def test_a_full_waiting_queue_is_503_and_starts_nothing(served):
    wait_idle(served[1])
    engine = AsyncLLMEngine(build_engine(served[1].engine.loaded, max_model_len=128, num_blocks=64, max_num_seqs=1,
                                         max_waiting=1))
    server = BackgroundServer(build_app(engine, MODEL)).start()
    try:  # 3 choices: one runs (100 tokens), one waits, the third finds the queue full
        r = httpx.post(server.base_url + "/v1/completions", timeout=30,
                       json={"prompt": "hi", "n": 3, "max_tokens": 100, "ignore_eos": True})
        assert r.status_code == 503, r.text
        err = strict_json(r.text)["error"]
        assert (err["type"], err["code"], err["param"]) == ("server_error", "queue_full", None)
        assert "max_waiting=1" in err["message"]
        deadline = time.monotonic() + 10
        while engine.engine.seqs or engine.metrics()["finished"].get("abort", 0) < 1:  # the accepted ones: aborted
            assert time.monotonic() < deadline, engine.metrics()
            time.sleep(0.01)
        assert engine.metrics()["generated_tokens_total"] < 100
        ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        server.stop()
        engine.shutdown()


def test_async_engine_generate_validates_streams_and_aborts_on_cancel(served):
    engine = served[1]
    ids = engine.tokenizer.encode("direct use").ids

    async def main():
        with pytest.raises(InvalidRequest, match="outside the tokenizer"):
            async for _ in engine.generate([1, 99999], SamplingParams(max_tokens=2)):
                pytest.fail("a refused request must not stream")
        deltas = [d async for d in engine.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True))]
        assert [d.finished for d in deltas] == [False, False, True] and deltas[-1].finish_reason == "length"
        assert all(d.token_id is not None for d in deltas) and deltas[-1].num_output_tokens == 3
        got = []

        async def consume():
            async for d in engine.generate(ids, SamplingParams(max_tokens=100, ignore_eos=True)):
                got.append(d)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.005)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    before = engine.metrics()["generated_tokens_total"]
    asyncio.run(main())
    assert wait_idle(engine)["generated_tokens_total"] - before < 3 + 100


def test_idle_engine_thread_sleeps(served):
    engine = served[1]
    wait_idle(engine)
    steps, cpu = engine.metrics()["steps_total"], resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert engine.metrics()["steps_total"] == steps
    assert (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime) < 0.1  # a spinning thread burns ~0.5 s


def test_chat_template_from_tokenizer_config(served, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = ChatTemplate(served[1].tokenizer, tmp_path)
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="assistant", content=[{"type": "text", "text": "yo"}])]
    assert t.render(msgs) == "[user]hi<|endoftext|>[assistant]yo<|endoftext|>[assistant]"
    assert ChatTemplate(served[1].tokenizer, None).render(msgs[:1]) == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_stop_string_streaming_and_plain(client, served):
    kw = dict(model=MODEL, prompt="Tell me", max_tokens=20, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    plain = client.completions.create(stop=stop, **kw).choices[0]
    assert plain.finish_reason == "stop" and plain.text == want
    chunks = [ch.choices[0] for ch in client.completions.create(stop=[stop], stream=True, **kw)]
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"
    assert wait_idle(served[1])["kv_blocks_used"] == 0
