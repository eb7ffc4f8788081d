"""Load: 32 concurrent streaming clients plus 4 that disconnect mid-stream, on a real server.

Every surviving client must get exactly what the same request gets when run alone on a bare
engine (same seed): the same tokens, `max_tokens` of them or fewer ending in a stop. The server
batches them and cuts its steps into microbatches; the alone runs are single-row and never cut.
Logits are bit-exact across batches and cuts, so there is no near-tie exemption: every token must
match. Afterwards no KV block may be held."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams
from engram_serve.server.api import build_app
from engram_serve.server.run import BackgroundServer

N_CLIENTS, N_DROPPERS, MAX_TOKENS = 32, 4, 8
# small thresholds so that the loaded server really cuts its steps; at most 24 running: the rest queue
CFG = RunnerConfig(max_model_len=128, num_blocks=256, max_num_seqs=24,
                   microbatch=MicrobatchConfig(num_microbatches=2, decode_threshold=8, prefill_threshold=16, when="always"))
WORDS = "the a of river stone light quick slow green idea number seven over under".split()


def request(i: int) -> dict:
    rng = random.Random(i)
    prompt = f"client {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "seed": 1000 + i, "stream": True, "return_token_ids": True}
    body["temperature"] = 0.0 if i % 2 == 0 else 0.8
    return body


def run_alone(loaded, body: dict) -> tuple[list[int], str]:
    """Tokens and finish reason of one request alone."""
    engine = LLMEngine(loaded, RunnerConfig(**{**CFG.__dict__, "microbatch": MicrobatchConfig(num_microbatches=1)}))
    engine.add_request("alone", loaded.tokenizer.encode(body["prompt"]).ids,
                       SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                      seed=body["seed"]))
    tokens, reason = [], None
    while engine.has_unfinished():
        for ev in engine.step().events:
            if ev.token is not None:
                tokens.append(ev.token)
            if ev.finished:
                reason = ev.finish_reason
    engine.close()
    return tokens, reason


async def stream_client(client: httpx.AsyncClient, body: dict, drop_after: int | None = None) -> dict:
    tokens, text, reason = [], "", None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                break
            choice = json.loads(line[len("data: "):])["choices"][0]
            tokens += choice["token_ids"]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            if drop_after is not None and len(tokens) >= drop_after:
                return {"dropped": True, "tokens": tokens}  # leaving the block closes the connection
    return {"tokens": tokens, "text": text, "finish_reason": reason}


async def load(base_url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        droppers = [stream_client(client, {"prompt": f"dropper {j} goes away", "max_tokens": 100, "stream": True,
                                           "ignore_eos": True, "return_token_ids": True}, drop_after=2)
                    for j in range(N_DROPPERS)]
        clients = [stream_client(client, request(i)) for i in range(N_CLIENTS)]
        jobs = clients[:N_CLIENTS // 2] + droppers + clients[N_CLIENTS // 2:]  # droppers start mid-pack
        out = await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)
    return out[:N_CLIENTS // 2] + out[N_CLIENTS // 2 + N_DROPPERS:]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    if (TINY_DIR / "model.safetensors").is_file():
        return load_model()
    return load_model(make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=2))


def test_concurrent_streams_match_alone_runs_and_free_everything(loaded):
    alone = [run_alone(loaded, request(i)) for i in range(N_CLIENTS)]  # before the server: one model user at a time
    engine = AsyncLLMEngine(LLMEngine(loaded, CFG))
    server = BackgroundServer(build_app(engine, "load")).start()
    try:
        t0 = time.monotonic()
        results = asyncio.run(load(server.base_url))
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 15
        while True:  # the droppers' requests are aborted when their connection closes
            metrics = httpx.get(server.base_url + "/metrics").text
            used = float(next(ln.split()[1] for ln in metrics.splitlines() if ln.startswith("engram_kv_blocks_used ")))
            if used == 0 and engine.metrics()["requests_running"] == 0:
                break
            assert time.monotonic() < deadline, f"KV blocks still held after the load: {used}"
            time.sleep(0.05)
    finally:
        server.stop()
        engine.shutdown()
    e = engine.engine
    assert e.scheduler.block_manager.num_used == 0 and e.runner.store.num_free == CFG.max_num_seqs and not e.seqs
    assert e.stats.microbatched_steps > 0  # the load really was cut into microbatches
    assert e.stats.generated_tokens < N_CLIENTS * MAX_TOKENS + N_DROPPERS * 100  # droppers were stopped early

    failures = []
    for i, (got, (tokens, reason)) in enumerate(zip(results, alone)):
        assert got["finish_reason"] in ("length", "stop")
        n = len(got["tokens"])
        assert n == MAX_TOKENS if got["finish_reason"] == "length" else n <= MAX_TOKENS
        assert got["text"] == loaded.tokenizer.decode(got["tokens"])
        if got["tokens"] != tokens or got["finish_reason"] != reason:
            failures.append(f"client {i}: served {got['tokens']} ({got['finish_reason']}), alone {tokens} ({reason})")
    assert not failures, "\n".join(failures)
    print(f"\n{N_CLIENTS} streams + {N_DROPPERS} dropped in {elapsed:.2f}s; {e.stats.microbatched_steps}/"
          f"{e.stats.steps} steps split, {e.stats.straddling_rows} straddling rows")
