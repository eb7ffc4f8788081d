"""scripts/soak.py: a real `serve` process under good and bad requests through the `openai` client passes a short
soak with the default threads; the checker fails on a real 5xx (a server whose waiting queue holds one request answers
503 to the others) and on a real process whose resident set grows."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engram_serve.engine.threads import ENV, available_cores

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_soak(*argv: str) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the server's default threads: the affinity mask's cores
    r = subprocess.run([sys.executable, str(SCRIPT), "--sample-s", "0.2", *argv], capture_output=True, text=True,
                       env=env, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_a_short_soak_of_the_built_in_model_passes():
    code, s = run_soak("--minutes", "0.15", "--clients", "4", "--warmup-fraction", "0.5")
    assert code == 0 and s["passed"], s["failures"]
    assert s["server_threads"] == available_cores()  # the default threads, from the server's /metrics
    assert s["requests_5xx"] == 0 and s["errors"] == 0 and s["timeouts"] == 0
    assert s["by_status"]["200"] >= 20 and s["bad_requests"] >= 1
    assert set(s["by_status"]) <= {"200", "400", "404"}  # every bad request got its 4xx naming the field
    kinds = {k.split("/")[0] for k in s["by_kind"]}
    assert {"chat", "completion"} <= kinds
    assert s["rss"]["passed"] and s["rss"]["after_warmup"] >= 6
    assert s["cpu_graphs_mib"]["end"] > 0  # the rule left out a real cache's memory (the server's /metrics)


def test_negative_control_a_server_answering_503_fails_the_soak():
    """A waiting queue of one request (--max-waiting 1) behind a batch of one: the other clients get the server's
    real 503 (queue_full). The RSS bound is lifted so that the 5xx count alone fails the run."""
    code, s = run_soak("--minutes", "0.05", "--clients", "6", "--rss-growth-mib", "100000", "--",
                       "--max-num-seqs", "1", "--max-waiting", "1")
    assert code == 1 and not s["passed"]
    assert s["by_status"].get("503", 0) == s["requests_5xx"] > 0
    assert s["failures"][0] == f"{s['requests_5xx']} responses with a 5xx status"
    assert s["rss"]["passed"]


@pytest.mark.parametrize("leaks", [False, True])
def test_the_rss_rule_fails_on_a_real_process_that_grows_and_passes_one_that_does_not(leaks):
    soak = load_soak()
    grow = "x.append('x' * (4 << 20))" if leaks else "pass"  # 4 MiB written every 50 ms
    proc = subprocess.Popen([sys.executable, "-c", "import time\nx = ['x' * (32 << 20)]\nwhile True:\n"
                             f"    {grow}\n    time.sleep(0.05)"])
    try:
        time.sleep(0.3)  # the interpreter's start
        sampler = soak.RssSampler(proc.pid, 0.05)
        sampler.start()
        time.sleep(2.0)
        samples = sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    verdict = soak.rss_rule(samples, warmup_s=0.2, growth_pct=5, growth_mib=16)
    assert verdict["after_warmup"] >= 20
    assert verdict["passed"] is not leaks, verdict
    if leaks:
        assert verdict["growth_mib"] > 50 and "grew" in verdict["why"]
