"""`/metrics`: Prometheus metrics with `prometheus-client`, in Prometheus' conventions (base units
in the names, `_total` counters, one registry per server).

- Histograms, observed on the async engine's output thread (`RequestObserver`):
  `engram_time_to_first_token_seconds`, `engram_inter_token_latency_seconds`,
  `engram_e2e_request_latency_seconds`, `engram_request_queue_time_seconds`.
- Counters from the engine's own counts (read when scraped, so nothing is counted twice):
  `engram_prompt_tokens_total`, `engram_generation_tokens_total`, `engram_preemptions_total`,
  `engram_steps_total`, `engram_microbatched_steps_total`, `engram_straddling_rows_total`,
  `engram_step_failures_total`, `engram_requests_total` (accepted) and
  `engram_requests_finished_total{finished_reason="stop"|"length"|"error"|"abort"}`; speculative decoding as
  vLLM names it: `engram_spec_decode_num_drafts_total` (verify rows), `engram_spec_decode_num_draft_tokens_total`,
  `engram_spec_decode_num_accepted_tokens_total` and
  `engram_spec_decode_num_accepted_tokens_per_pos_total{position="0"|...}` (draft position, from 0).
- Gauges: `engram_requests_running`, `engram_requests_waiting`, `engram_kv_cache_usage_ratio`,
  `engram_kv_blocks_used`, `engram_kv_blocks_total`, `engram_kernel_threads` (the C kernels' pool size at the
  engine's last step), `engram_cpu_graphs` and `engram_cpu_graph_bytes` (the CPU graphs kept and the memory their
  captures allocated, at most runner/cpu_graphs.py `CpuGraphs.MAX_BYTES`).

Throughput is a rate over a counter (e.g. `rate(engram_generation_tokens_total[1m])`), not a gauge.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.async_engine import AsyncLLMEngine, RequestObserver

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
REASONS = ("stop", "length", "error", "abort")

_COUNTERS = (  # name (without _total), help, key in AsyncLLMEngine.metrics()
    ("engram_prompt_tokens", "Prompt tokens computed (prefill).", "prompt_tokens_total"),
    ("engram_generation_tokens", "Tokens sampled.", "generated_tokens_total"),
    ("engram_preemptions", "Requests preempted (KV blocks dropped, recomputed later).", "preemptions_total"),
    ("engram_steps", "Engine steps run.", "steps_total"),
    ("engram_microbatched_steps", "Steps split into more than one microbatch.", "microbatched_steps_total"),
    ("engram_straddling_rows", "Rows cut by a microbatch boundary.", "straddling_rows_total"),
    ("engram_step_failures", "Steps whose forward raised; their offending rows ended with an error.",
     "step_failures_total"),
    ("engram_requests", "Requests accepted.", "requests_total"),
    ("engram_spec_decode_num_drafts", "Speculative decoding: verify rows (requests that drafted in a step).",
     "spec_decode_num_drafts_total"),
    ("engram_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
     "spec_decode_num_draft_tokens_total"),
    ("engram_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_decode_num_accepted_tokens_total"),
)
_GAUGES = (
    ("engram_requests_running", "Requests in the running batch.", "requests_running"),
    ("engram_requests_waiting", "Requests waiting for a slot or KV blocks.", "requests_waiting"),
    ("engram_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", "kv_cache_usage"),
    ("engram_kv_blocks_used", "KV-cache blocks held by live requests.", "kv_blocks_used"),
    ("engram_kv_blocks_total", "KV-cache blocks in the pool.", "kv_blocks_total"),
    ("engram_kernel_threads", "Threads of the C kernels' pool at the engine's last step.", "kernel_threads"),
    ("engram_cpu_graphs", "CPU graphs kept (recorded decode and short-prompt steps).", "cpu_graphs"),
    ("engram_cpu_graph_bytes", "Memory the kept CPU graphs' captures allocated (bounded).", "cpu_graph_bytes"),
)


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    def collect(self):
        m = self.engine.metrics()
        for name, help_, key in _COUNTERS:
            yield CounterMetricFamily(name, help_, value=int(m.get(key, 0)))
        finished = CounterMetricFamily("engram_requests_finished", "Requests finished, by finish reason.",
                                       labels=["finished_reason"])
        counts = m.get("finished", {})
        for reason in sorted(set(REASONS) | set(counts)):
            finished.add_metric([reason], int(counts.get(reason, 0)))
        yield finished
        per_pos = CounterMetricFamily("engram_spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: draft tokens accepted, by draft position.",
                                      labels=["position"])
        for pos, n in enumerate(m.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([str(pos)], int(n))
        yield per_pos
        for name, help_, key in _GAUGES:
            yield GaugeMetricFamily(name, help_, value=float(m.get(key, 0)))


class ServerMetrics(RequestObserver):
    """One registry per server; attach with `ServerMetrics(engine)` (it registers as an observer)."""

    def __init__(self, engine: AsyncLLMEngine):
        self.registry = CollectorRegistry(auto_describe=True)
        h = dict(buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("engram_time_to_first_token_seconds", "Arrival to first token.", **h)
        self.itl = Histogram("engram_inter_token_latency_seconds", "Time between two tokens of a request.", **h)
        self.e2e = Histogram("engram_e2e_request_latency_seconds", "Arrival to the end of the request.", **h)
        self.queue = Histogram("engram_request_queue_time_seconds", "Arrival to first scheduled in a step.", **h)
        self.registry.register(_EngineCollector(engine))
        engine.observers.append(self)

    def queued(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
