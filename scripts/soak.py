"""Soak `engram-serve serve`: a real server process under a mix of good and bad requests through the `openai` client.

Starts `engram-serve serve` (`python -m engram_serve.cli serve`; the built-in model, or --model DIR; the default
threads unless the serve flags after `--` say otherwise) on a free loopback port, then for --minutes runs --clients
concurrent clients, each sending one request after another until the time is up:

- good requests (1 - --bad-share): completions and chat completions, plain and streamed, each with one of: greedy,
  seeded sampling, top-k and top-p, penalties (presence, frequency, repetition), stop strings, logprobs; every
  response must end with finish_reason "stop" or "length" and no error in a choice;
- bad requests (--bad-share): a wrong type, an out-of-range value, an unknown field, an unknown model, a prompt
  longer than the model allows; each must get a 4xx whose error body names the field (`param`, else the message).

Every --sample-s it reads the server's resident set (VmRSS, and RssAnon, in /proc/PID/status). The soak fails (exit 1)
on: any 5xx; any other error (a good request refused, a bad one accepted or answered without naming its field, a
choice ending in error, a transport error); a hang (no answer within --request-timeout-s: the client's timeout on
connecting and on each read); the server exiting; or RSS growth. The RSS rule: each sample is VmRSS less the memory
the server's CPU graphs keep (`engram_cpu_graph_bytes` on /metrics: a cache that fills as new step shapes recur,
bounded by runner/cpu_graphs.py `CpuGraphs.MAX_BYTES`); the samples of the first --warmup-fraction of the run are
warm-up and left out; of the rest, the median of the last third may exceed the median of the first third by at most
max(--rss-growth-pct % of it, --rss-growth-mib MiB) (a leak grows without bound; allocator and page-cache noise
stays within the bound). Prints a JSON summary on stdout, with the raw VmRSS and the graphs' memory beside.

    python scripts/soak.py [--minutes 5] [--model DIR] [--clients 16] [-- SERVE FLAGS...]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (the checkout's package, as the server it starts runs it)
from engram_serve.server.run import start_serve_process  # noqa: E402

WORDS = ("def return import class self for while if else the of a river stone light number list value "
         "print open file data result error index").split()
STOPS = ["\n\n", " the", ")", "return"]


# ---- the server's resident set ----------------------------------------------------------------------------

def rss_mib(pid: int) -> tuple[float, float] | None:
    """(VmRSS, RssAnon) of process `pid` in MiB, from /proc/PID/status; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["RssAnon"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


class RssSampler(threading.Thread):
    """Samples (seconds since start, VmRSS MiB, RssAnon MiB, graphs MiB) of `pid` every `every` seconds until
    `stop()`; graphs MiB: `graphs()` (the server's CPU graphs, from /metrics; None: 0, or the last value read)."""

    def __init__(self, pid: int, every: float, graphs=None):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.every, self.graphs, self.samples = pid, every, graphs, []
        self._stop_event = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        held = 0.0
        while True:
            got = rss_mib(self.pid)
            if self.graphs is not None:
                held = self.graphs() or held
            if got is not None:
                self.samples.append((time.monotonic() - self.t0, *got, held))
            if self._stop_event.wait(self.every):
                return

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop_event.set()
        self.join()
        return self.samples


def rss_rule(samples: list[tuple[float, ...]], warmup_s: float, growth_pct: float, growth_mib: float) -> dict:
    """The RSS rule (module docstring) over RssSampler's samples: `passed` and the figures."""
    after = [s[1] - s[3] for s in samples if s[0] >= warmup_s]  # VmRSS less the CPU graphs' captures
    out = {"samples": len(samples), "after_warmup": len(after), "warmup_s": round(warmup_s, 1),
           "start_mib": samples[0][1] if samples else None, "end_mib": samples[-1][1] if samples else None}
    if len(after) < 6:
        return {**out, "passed": False, "why": f"{len(after)} samples after the warm-up; the rule needs 6"}
    third = len(after) // 3
    first, last = statistics.median(after[:third]), statistics.median(after[-third:])
    bound = max(first * growth_pct / 100, growth_mib)
    out.update(first_third_median_mib=round(first, 1), last_third_median_mib=round(last, 1),
               growth_mib=round(last - first, 1), bound_mib=round(bound, 1), passed=last - first <= bound)
    if not out["passed"]:
        out["why"] = (f"VmRSS less the CPU graphs grew {last - first:.1f} MiB (median of the last third {last:.1f} "
                      f"against the first third's {first:.1f}) > the bound {bound:.1f} MiB")
    return out


# ---- the server -------------------------------------------------------------------------------------------

def start_server(serve_args: list[str], log, timeout_s: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return start_serve_process(["--log-level", "warning", *serve_args], timeout_s, stdout=log,
                               stderr=subprocess.STDOUT, env=env)


def stop_server(proc: subprocess.Popen) -> int | None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL after 20 s; the exit code (None: killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
    return proc.returncode


def gauge(base: str, name: str) -> float | None:
    """A gauge of the server's /metrics (None: not there, or no answer within 10 s)."""
    import httpx
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


# ---- the requests -----------------------------------------------------------------------------------------

def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def good_request(rng: random.Random, model: str) -> tuple[str, str, dict]:
    """(endpoint, description, keyword arguments of the openai call)."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    kw: dict = {"model": model, "max_tokens": rng.randint(1, 24), "stream": stream, "extra_body": {}}
    if chat:
        kw["messages"] = [{"role": "user", "content": _text(rng, rng.randint(3, 30))}]
    else:
        kw["prompt"] = _text(rng, rng.randint(1, 40))
    how = rng.choice(["greedy", "seeded", "top_k_top_p", "penalties", "stop", "logprobs"])
    if how == "greedy":
        kw["temperature"] = 0.0
    elif how == "seeded":
        kw.update(temperature=rng.uniform(0.3, 1.5), seed=rng.randrange(2 ** 31))
    elif how == "top_k_top_p":
        kw.update(temperature=0.8, top_p=rng.uniform(0.5, 1.0))
        kw["extra_body"]["top_k"] = rng.randint(1, 50)
    elif how == "penalties":
        kw.update(temperature=0.7, presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1))
        kw["extra_body"]["repetition_penalty"] = rng.uniform(0.8, 1.3)
    elif how == "stop":
        kw.update(temperature=0.7, stop=rng.sample(STOPS, rng.randint(1, 3)))
    elif chat:
        kw.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    else:
        kw["logprobs"] = rng.randint(0, 5)
    return ("chat" if chat else "completions"), f"{'chat' if chat else 'completion'}/{how}/" + \
        ("stream" if stream else "plain"), kw


def bad_request(rng: random.Random, model: str, max_len: int) -> tuple[str, str, dict, int, str]:
    """(endpoint, description, keyword arguments, expected status, the field the error must name)."""
    chat = rng.random() < 0.5
    kw: dict = {"model": model, "max_tokens": 4, "extra_body": {}}
    if chat:
        kw["messages"] = [{"role": "user", "content": _text(rng, 5)}]
    else:
        kw["prompt"] = _text(rng, 5)
    case = rng.choice(["wrong_type", "out_of_range", "unknown_field", "unknown_model", "too_long"])
    status = 400
    if case == "wrong_type":
        field, value = rng.choice([("max_tokens", "8"), ("temperature", "hot"), ("seed", 1.5), ("top_p", [0.5])])
        kw[field] = value
    elif case == "out_of_range":
        field, value = rng.choice([("temperature", -1.0), ("top_p", 1.5), ("presence_penalty", 3.0),
                                   ("max_tokens", max_len + 1), ("n", 0), ("frequency_penalty", -2.5)])
        kw[field] = value
    elif case == "unknown_field":
        field = "no_such_field"
        kw["extra_body"][field] = 1
    elif case == "unknown_model":
        field, status = "model", 404
        kw["model"] = "no-such-model"
    else:
        field = "messages" if chat else "prompt"
        long = " ".join(["word"] * (2 * max_len))
        if chat:
            kw["messages"] = [{"role": "user", "content": long}]
        else:
            kw["prompt"] = long
    return ("chat" if chat else "completions"), f"bad/{case}/{field}", kw, status, field


def _check_response(endpoint: str, kw: dict, out) -> str | None:
    """Why a good request's answer is wrong (None: it is right). `out`: the response, or the list of chunks."""
    if kw["stream"]:
        reasons = [c.finish_reason for chunk in out for c in chunk.choices if c.finish_reason is not None]
        choices = [c for chunk in out for c in chunk.choices]
    else:
        reasons = [c.finish_reason for c in out.choices]
        choices = out.choices
    if reasons != ["stop"] and reasons != ["length"]:
        errors = [getattr(c, "error", None) or (c.model_extra or {}).get("error") for c in choices]
        return f"finish reasons {reasons}, errors {[e for e in errors if e]}"
    if not kw["stream"] and endpoint == "completions" and "logprobs" in kw and out.choices[0].logprobs is None:
        return "logprobs asked for, none returned"
    return None


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_status: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.failures: list[str] = []
        self.timeouts = 0
        self.errors = 0

    def add(self, status: int | str, kind: str, failure: str | None = None, timeout: bool = False) -> None:
        with self.lock:
            self.by_status[str(status)] += 1
            self.by_kind[kind] += 1
            self.timeouts += timeout
            if failure is not None:
                self.errors += not timeout
                if len(self.failures) < 20:
                    self.failures.append(f"{kind}: {failure}")


def client_loop(base: str, model: str, max_len: int, rng: random.Random, deadline: float, args, counts: Counts):
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=args.request_timeout_s, max_retries=0)
    while time.monotonic() < deadline:
        bad = rng.random() < args.bad_share
        if bad:
            endpoint, kind, kw, want_status, field = bad_request(rng, model, max_len)
        else:
            endpoint, kind, kw = good_request(rng, model)
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        try:
            out = create(**kw)
            if kw.get("stream"):
                out = list(out)
        except openai.APITimeoutError:
            counts.add("timeout", kind, f"no answer within {args.request_timeout_s} s", timeout=True)
            continue
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            named = field in str(body.get("param") or "") or field in str(body.get("message") or "") if bad else False
            failure = None
            if e.status_code >= 500:
                failure = f"HTTP {e.status_code}: {body.get('message') or e.message}"
            elif not bad:
                failure = f"a good request refused: HTTP {e.status_code}: {body.get('message') or e.message}"
            elif e.status_code != want_status or not named:
                failure = (f"HTTP {e.status_code} (expected {want_status}), param {body.get('param')!r}, "
                           f"message {str(body.get('message'))[:160]!r}: does not name {field!r}")
            counts.add(e.status_code, kind, failure)
            continue
        except openai.APIError as e:  # transport errors, malformed responses
            counts.add("error", kind, f"{type(e).__name__}: {e}")
            continue
        counts.add(200, kind, f"a bad request accepted (expected HTTP {want_status})" if bad
                   else _check_response(endpoint, kw, out))


# ---- the soak ---------------------------------------------------------------------------------------------

def soak(args) -> dict:
    import httpx
    serve_args = ([] if args.model is None else ["--model", args.model]) + args.serve_args
    with tempfile.TemporaryFile() as log:
        t_start = time.monotonic()
        proc, base = start_server(serve_args, log, args.start_timeout_s)
        started_s = time.monotonic() - t_start
        sampler = RssSampler(proc.pid, args.sample_s, lambda: (gauge(base, "engram_cpu_graph_bytes") or 0) / 2 ** 20)
        sampler.start()
        counts = Counts()
        try:
            card = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
            threads = gauge(base, "engram_kernel_threads")
            duration = args.minutes * 60
            deadline = time.monotonic() + duration
            rng = random.Random(args.seed)
            workers = [threading.Thread(target=client_loop, daemon=True, args=(
                base, card["id"], card["max_model_len"], random.Random(rng.randrange(2 ** 63)), deadline, args, counts))
                for _ in range(args.clients)]
            for w in workers:
                w.start()
            for w in workers:  # a request in flight at the deadline finishes (or times out) first
                w.join(duration + 3 * args.request_timeout_s)
            stuck = sum(w.is_alive() for w in workers)
            alive = proc.poll() is None
            health = httpx.get(base + "/health", timeout=10).status_code if alive else None
        finally:
            samples = sampler.stop()
            code = stop_server(proc)
        log.seek(0)
        log_tail = [ln for ln in log.read().decode(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    rss = rss_rule(samples, args.warmup_fraction * duration + (samples[0][0] if samples else 0),
                   args.rss_growth_pct, args.rss_growth_mib)
    fives = sum(n for s, n in counts.by_status.items() if s.isdigit() and int(s) >= 500)
    failures = list(counts.failures)
    if fives:
        failures.insert(0, f"{fives} responses with a 5xx status")
    if counts.timeouts:
        failures.insert(0, f"{counts.timeouts} requests timed out (a hang)")
    if stuck:
        failures.append(f"{stuck} clients still waiting after the run")
    if not alive:
        failures.append(f"the server exited (code {proc.returncode})")
    elif health != 200:
        failures.append(f"the server answered /health {health}")
    if not rss["passed"]:
        failures.append(f"RSS: {rss['why']}")
    total = sum(counts.by_status.values())
    return {"passed": not failures and total > 0, "failures": failures if total else failures + ["no requests"],
            "minutes": args.minutes, "clients": args.clients, "model": card["id"],
            "server_start_s": round(started_s, 1),
            "server_threads": None if threads is None else int(threads), "serve_args": serve_args, "requests": total,
            "by_status": dict(sorted(counts.by_status.items())), "requests_5xx": fives,
            "errors": counts.errors, "timeouts": counts.timeouts,
            "bad_requests": sum(n for k, n in counts.by_kind.items() if k.startswith("bad/")),
            "by_kind": dict(sorted(counts.by_kind.items())), "rss": rss,
            "rss_anon_mib": {"start": samples[0][2], "end": samples[-1][2]} if samples else None,
            "cpu_graphs_mib": {"start": samples[0][3], "end": samples[-1][3]} if samples else None,
            "rss_series": [[round(v, 1) for v in x] for x in samples[::max(1, len(samples) // 40)]],
            "server_exit_code": code, "server_log_tail": log_tail[-15:] if failures else []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                epilog="Flags after `--` go to `engram-serve serve`.")
    p.add_argument("--minutes", type=float, default=5.0, help="how long the clients send requests (default 5)")
    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--bad-share", type=float, default=0.15, help="share of bad requests (default 0.15)")
    p.add_argument("--seed", type=int, default=0, help="seeds the clients' choices (default 0)")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="a request with no answer (connect, or a read) for this long is a hang (default 120)")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="the server's start-up (default 300)")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between two RSS samples (default 2)")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="the first part of the run whose RSS samples the rule leaves out (default 0.2)")
    p.add_argument("--rss-growth-pct", type=float, default=5.0, help="the RSS rule's relative bound (default 5)")
    p.add_argument("--rss-growth-mib", type=float, default=16.0, help="the RSS rule's absolute bound (default 16)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags of `engram-serve serve`")
    args = p.parse_args(argv)
    args.serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.minutes <= 0 or args.clients < 1 or not 0 <= args.bad_share <= 1 or args.sample_s <= 0:
        p.error("--minutes and --sample-s must be > 0, --clients >= 1, --bad-share in [0, 1]")
    summary = soak(args)
    print(json.dumps(summary, indent=1))
    for f in summary["failures"]:
        print(f"soak: FAIL: {f}", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
