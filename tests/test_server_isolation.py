"""`engram-serve serve` as a process on a free loopback port: every kind of bad input, one per
case, each sent while three other streams run. Each bad request gets a 4xx with an OpenAI error
body naming the field; the three streams finish exactly as they do alone (token for token).

The checkpoint is a random one whose model vocabulary (4608) is larger than its tokenizer (4096),
so "a token id below vocab_size but outside the tokenizer" is a real case here.

Also a test (not a benchmark) of bounded work: a 50 MB body gets 413 in under 2 s, with and
without Content-Length; /health answers in under 100 ms meanwhile; the server's resident memory
is back within 10% of its baseline a few seconds later. A client that finishes its upload before it
reads (async httpx) still reads the 413, and the drain that lets it is bounded in bytes and time.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time

import httpx
import pytest

from engram_serve.config import read_json
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams
from engram_serve.server.limits import BodyLimit
from engram_serve.server.run import BackgroundServer
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
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt scored alone)
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
    text = {**read_json(TINY_DIR / "config.json")["text_config"], "vocab_size": 4608}  # ids past the tokenizer
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3, config=text)


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


async def upload_then_read(url: str, size: int, content_length: bool) -> httpx.Response:
    """POST a `size`-byte JSON body from an async generator, as async httpx does: the whole body
    goes out before the response is read."""
    async def body():
        yield b'{"prompt": "'
        for _ in range(size // CHUNK):
            yield b"a" * CHUNK
        yield b'"}'
    headers = {"content-type": "application/json"}
    if content_length:
        headers["content-length"] = str(size // CHUNK * CHUNK + 14)
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url, content=body(), headers=headers)


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
def test_an_async_client_still_uploading_20mb_reads_the_413(server, content_length):
    base, _ = server
    r = asyncio.run(upload_then_read(base + C, 20 * 1000 * 1000, content_length))
    assert r.status_code == 413 and r.headers["connection"] == "close"
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": None,
                   "code": "request_too_large"}
    assert "larger than the limit of 4194304 bytes" in err["message"]
    assert httpx.get(base + "/health", timeout=5).status_code == 200


async def _echo(scope, receive, send):
    """An ASGI app that reads its whole body and answers 200."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_the_drain_of_a_refused_body_is_bounded_in_bytes_and_in_time():
    limited = BodyLimit(_echo, max_bytes=1000, drain_bytes=200_000, drain_seconds=1.0)
    with BackgroundServer(limited) as srv:
        host, port = srv.host, srv.port
        # bytes: a client that never stops sending is cut off after the drain, far before 200 MB
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
        sent, t0 = 0, time.monotonic()
        with pytest.raises(OSError):  # reset or broken pipe: the server closed after its drain
            while sent < 200 * 1000 * 1000:
                sock.sendall(b"a" * CHUNK)
                sent += CHUNK
        sock.close()
        assert time.monotonic() - t0 < 5, sent
        # time: a client that stops sending is closed after drain_seconds
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n" + b"a" * 100)
        sock.settimeout(5)
        t0, reply = time.monotonic(), b""
        while chunk := sock.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413 ") and 0.9 < time.monotonic() - t0 < 3
        sock.close()
        # within the bounds a body is read to its end: the connection closes cleanly and at once
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n" + b"a" * 5000)
        t0, reply = time.monotonic(), b""
        while chunk := sock.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413 ") and time.monotonic() - t0 < 0.5
        sock.close()
