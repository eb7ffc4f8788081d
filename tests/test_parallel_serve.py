"""`engram-serve serve --tensor-parallel-size 2` (2 processes, gloo, CPU) with the official openai client;
then a worker killed mid-stream: the stream ends with a clear error, the server shuts down on its own,
and no process is left behind."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from engram_serve.llm import LLM
from engram_serve.sampling_params import SamplingParams
from serve_process import start_serve

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc, base = start_serve(["--tensor-parallel-size", "2", "--model-name", "tiny"], 60,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_openai_client_against_tp2_matches_one_process(server):
    from openai import OpenAI
    _, base = server
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0)
    llm = LLM()
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0]
    llm.close()
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_worker_killed_mid_stream_ends_with_a_clear_error_and_a_clean_shutdown(server):
    from openai import OpenAI
    proc, base = server
    children = _children(proc.pid)  # the worker (and any helper process multiprocessing started)
    workers = [c for c in children if "spawn_main" in _cmdline(c)]
    assert len(workers) == 1, [(_cmdline(c)) for c in _children(proc.pid)]
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1500, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = []
    for c in stream:
        chunks.append(c)
        if len(chunks) == 5:
            os.kill(workers[0], signal.SIGKILL)
        if c.choices and c.choices[0].finish_reason is not None:
            break
    last = chunks[-1].choices[0]
    assert last.finish_reason == "error", last
    message = last.model_extra["error"]["message"]
    assert "worker rank 1" in message and "exited with code -9" in message, message
    assert 5 <= len(chunks) < 1500
    code = proc.wait(timeout=30)  # the server shuts down on its own
    err = proc.stderr.read()
    assert code == 2 and "the server shut down" in err and "worker rank 1" in err, err[-2000:]
    time.sleep(0.2)
    assert not [c for c in children if _alive(c)], "orphan processes left behind"
