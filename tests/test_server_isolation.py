"""`engram-serve serve` as a process on a free loopback port: every kind of bad input, one per
case, each sent while three other streams run. Each bad request gets a 4xx with an OpenAI error
body naming the field; the three streams finish exactly as they do alone (token for token).

The checkpoint is a random one whose model vocabulary (4608) is larger than its tokenizer (4096),
so "a token id below vocab_size but outside the tokenizer" is a real case here.

Also a test (not a benchmark) of bounded work: a 50 MB body gets 413 in under 2 s, with and
without Content-Length; /health answers in under 100 ms meanwhile; the server's resident memory
is back within 10% of its baseline a few seconds later.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import threading
import time

import httpx
import pytest

from engram_serve.config import ModelConfig, read_json
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.model.loader import TINY_DIR, load_model, make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams
from serve_process import start_serve

MAX_TOKENS = 5
SERVE_OPTS = ["--max-model-len", "128", "--num-kv-blocks", "160", "--max-num-seqs", "8", "--threads", "1"]
STREAMS = [  # the three requests that run beside every bad one
    {"prompt": "alpha beta gamma", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    {"prompt": "one two three four", "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 7, "ignore_eos": True},
    {"prompt": "x = [", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 9, "top_p": 0.9, "ignore_eos": True},
]
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, raw JSON or object, the param the error must name)
    (C, {"prompt": "hi", "top_k": 9223372036854775808}, "top_k"),
    (C, {"prompt": [5, 4500]}, "prompt"),  # < vocab_size 4608, outside the tokenizer's 4096 ids
    (C, {"prompt": [5, 4608]}, "prompt"),
    (C, '{"prompt": "hi", "x": ' + "[" * 1000 + "]" * 1000 + "}", None),
    (C, '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}", "prompt"),
    (C, '{"prompt": "a \\ud800 b"}', "prompt"),
    (C, {"prompt": "hi", "top_p": 1e-46}, "top_p"),
    (C, '{"prompt": "hi", "temperature": 1e309}', "temperature"),
    (C, {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    (C, {"prompt": "hi", "stop": ["x"] * 1000}, "stop"),
    (C, {"prompt": "hi", "stop": ["y" * 5000]}, "stop"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    (C, {"prompt": "hi", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens"),
    (C, {"prompt": "hi", "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    (C, {"prompt": "hi", "n": 17}, "n"),
    (C, {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    (C, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "hi", "echo": True, "logprobs": 2}, "echo"),
    (C, {"prompt": [[1, 2], [3, -1]]}, "prompt"),
    (C, {"prompt": ["ok", 5]}, "prompt.1"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    (C, {"prompt": "hi", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    (C, {"prompt": "hi", "logit_bias": {"4500": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "suffix": "tail"}, "suffix"),
    (C, {"prompt": "hi", "frobnicate": True}, "frobnicate"),
    (C, {"prompt": "hi", "stop_token_ids": [4500]}, "stop_token_ids"),
    (C, {"prompt": "hi", "seed": 2 ** 64}, "seed"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (CHAT, {"messages": MSG, "best_of": 2}, "best_of"),
    (C, "[1, 2]", None),
    (C, "{bad json", None),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dataclasses.replace(ModelConfig.from_dict(read_json(TINY_DIR / "config.json")), vocab_size=4608)
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3, config=cfg)


@pytest.fixture(scope="module")
def server(checkpoint):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc, base = start_serve(["--model", str(checkpoint), "--log-level", "warning", *SERVE_OPTS], 120,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    yield base, proc
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert b"Traceback" not in out, out.decode()[-3000:]


@pytest.fixture(scope="module")
def alone(checkpoint):
    loaded = load_model(checkpoint)
    out = []
    for body in STREAMS:
        e = LLMEngine(loaded, RunnerConfig(max_model_len=128, num_blocks=160, max_num_seqs=8))
        e.add_request("a", loaded.tokenizer.encode(body["prompt"]).ids, SamplingParams(**{
            k: v for k, v in body.items() if k not in ("prompt",)}))
        toks = []
        while e.has_unfinished():
            toks += [ev.token for ev in e.step().events if ev.token is not None]
        e.close()
        out.append(toks)
    return out


def stream(base: str, body: dict, out: list) -> None:
    toks = []
    with httpx.stream("POST", base + C, json={**body, "stream": True, "return_token_ids": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                toks += json.loads(line[6:])["choices"][0]["token_ids"]
    out.append(toks)


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_beside_three_streams(server, alone, path, body, param):
    base, _ = server
    results = [[], [], []]
    threads = [threading.Thread(target=stream, args=(base, b, results[i])) for i, b in enumerate(STREAMS)]
    for t in threads:
        t.start()
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(base + path, content=raw.encode("utf-8", "surrogatepass"),
                   headers={"content-type": "application/json"}, timeout=30)
    for t in threads:
        t.join(60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if param is not None:
        assert param.split(".")[0] in err["message"], err
    assert [x[0] for x in results] == alone, "a bad request disturbed the streams beside it"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


BODY = b'{"prompt": "' + b"a" * (50 * 1000 * 1000) + b'"}'
CHUNK = 1 << 20
CHUNKS = [b"%x\r\n%s\r\n" % (len(BODY[i:i + CHUNK]), BODY[i:i + CHUNK]) for i in range(0, len(BODY), CHUNK)]


def huge_request(base: str, chunked: bool) -> tuple[int, float]:
    """Send a 50 MB body on a raw socket; (status, seconds until the response arrived)."""
    host, port = base.removeprefix("http://").split(":")
    body = BODY
    sock = socket.create_connection((host, int(port)))
    head = f"POST {C} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    head += "transfer-encoding: chunked\r\n\r\n" if chunked else f"content-length: {len(body)}\r\n\r\n"
    t0 = time.monotonic()

    def send():
        try:
            sock.sendall(head.encode())
            for i, part in enumerate(CHUNKS if chunked else (body[j:j + CHUNK] for j in range(0, len(body), CHUNK))):
                sock.sendall(part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server refused and closed: expected

    sender = threading.Thread(target=send)
    sender.start()
    reply = b""
    sock.settimeout(10)
    while b"\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    elapsed = time.monotonic() - t0
    sock.close()
    sender.join(30)
    return int(reply.split()[1]), elapsed


def test_a_50mb_body_is_refused_fast_health_stays_fast_memory_returns(server):
    base, proc = server
    for _ in range(3):
        httpx.post(base + C, json={"prompt": "warm", "max_tokens": 2}, timeout=30)
    baseline = rss_kib(proc.pid)
    for chunked in (False, True):
        worst, stop = [0.0], threading.Event()

        def poll():
            with httpx.Client(base_url=base, timeout=5) as c:
                c.get("/health")
                while not stop.is_set():
                    t = time.monotonic()
                    assert c.get("/health").status_code == 200
                    worst[0] = max(worst[0], time.monotonic() - t)
                    time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            status, seconds = huge_request(base, chunked)
            assert status == 413 and seconds < 2.0, (chunked, status, seconds)
        finally:
            stop.set()
            poller.join(10)
        assert worst[0] < 0.1, f"/health took {worst[0] * 1000:.0f} ms while a 50 MB body came in (chunked={chunked})"
    time.sleep(3)
    after = rss_kib(proc.pid)
    assert after <= baseline * 1.10, f"RSS {baseline} KiB -> {after} KiB"
