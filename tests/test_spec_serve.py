"""`engram-serve serve --speculative-config` with the built-in model's DSpark drafter, as vLLM's users run it: the
official openai client streams completions (greedy and seeded sampling) whose text equals plain decoding's, and
/metrics shows vLLM's spec_decode counters."""
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from engram_serve.llm import LLM
from engram_serve.sampling_params import SamplingParams
from serve_process import start_serve

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n"]


@pytest.fixture(scope="module")
def server():
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 5, "when": "always"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc, base = start_serve(["--speculative-config", spec, "--model-name", "tiny"], 60,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def test_the_openai_client_streams_plain_decodings_text_with_dspark(server):
    from openai import OpenAI
    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    llm = LLM()
    try:
        for prompt in PROMPTS:
            for temperature, seed in ((0.0, None), (0.7, 11)):
                stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=temperature,
                                                   seed=seed, stream=True, extra_body={"ignore_eos": True})
                got = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
                want = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                                                           ignore_eos=True))[0].text
                assert got == want, (prompt, temperature)
    finally:
        llm.close()
    metrics = httpx.get(server + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("engram_spec_decode")}
    assert values["engram_spec_decode_num_drafts_total"] > 0
    assert 0 < values["engram_spec_decode_num_accepted_tokens_total"] < values[
        "engram_spec_decode_num_draft_tokens_total"]
    assert values['engram_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
