"""`AsyncLLMEngine`: an `LLMEngine` stepped on one background thread, with asyncio streams per request.

Two threads:
- the **engine thread** owns the engine (through an `EngineDriver`; the scheduler holds the one
  waiting queue). The model is not thread-safe, so every engine call (add, abort, step) happens
  there; asyncio callers talk to it through a command queue. When there is no work it blocks on
  that queue (no spinning).
- the **output thread** detokenizes (`OutputProcessor`), applies stop strings, measures request
  latencies and hands deltas to each request's `asyncio.Queue` via `loop.call_soon_threadsafe`.
  The engine thread never waits for it: detokenization is off the step loop. A stop string found
  there sends an abort back to the engine thread (the engine may have run a step more; those
  tokens are dropped).

Messages to the output thread keep the engine thread's order, so a request is registered there
before any of its events arrives.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from .. import thread_pool
from ..errors import InvalidRequest
from .detokenizer import OutputProcessor, RequestDelta
from .driver import EngineDriver
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


class RequestObserver:
    """Receives request timings from the output thread (the server's Prometheus metrics). All times
    are in seconds. The default does nothing."""

    def queued(self, seconds: float) -> None: ...  # arrival -> first scheduled in a step

    def first_token(self, seconds: float) -> None: ...  # arrival -> first token

    def inter_token(self, seconds: float) -> None: ...  # between two tokens of one request

    def finished(self, reason: str, seconds: float) -> None: ...  # arrival -> end (e2e)


@dataclass
class _Timing:
    arrival: float
    scheduled: bool = False
    last_token: float | None = None


@dataclass
class _Out:
    """Output-thread state of one request."""

    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    timing: _Timing
    token_times: list = field(default_factory=list)


class AsyncLLMEngine:
    """`generate` streams `RequestDelta`s; a validation error raises InvalidRequest before the first
    delta; cancelling or closing the consumer aborts the request (KV blocks and slot freed)."""

    def __init__(self, engine: LLMEngine):
        self.driver = EngineDriver(engine, detokenize=False)
        self.engine = engine
        self.observers: list[RequestObserver] = []
        self._outputs = OutputProcessor(engine.loaded.tokenizer)  # output thread only
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._out_q: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, _Out] = {}  # output thread only
        self._metrics: dict[str, float] = {}
        self._requests_total = 0
        self._finished: dict[str, int] = {}
        self._closed = False
        self.fatal_error: str | None = None  # why the engine stopped on its own (a fatal step error)
        self.on_fatal = None  # called with that message from the engine thread (the server shuts down)
        self._ids = itertools.count()
        self._kernel_threads = thread_pool.threads()  # the kernels' pool size the last step ran on
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engram-engine", daemon=True)
        self._out_thread = threading.Thread(target=self._run_outputs, name="engram-output", daemon=True)
        self._out_thread.start()
        self._thread.start()

    @classmethod
    def from_model(cls, model=None, *, enable_prefix_caching: bool = True, **options) -> "AsyncLLMEngine":
        """`model`: a checkpoint path, None (the built-in tiny model) or a LoadedModel."""
        from .factory import build_engine
        return cls(build_engine(model, enable_prefix_caching=enable_prefix_caching, **options))

    @property
    def tokenizer(self):
        return self.engine.loaded.tokenizer

    # ---- asyncio side -------------------------------------------------------------------------
    async def add_request(self, prompt_ids: Sequence[int], params, request_id: str | None = None
                          ) -> "RequestStream":
        """Validate and queue a request; returns its delta stream. Raises InvalidRequest if refused
        (QueueFull when the scheduler's waiting queue is at its limit)."""
        if self._closed:
            raise RuntimeError("AsyncLLMEngine is shut down")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._cmds.put(("add", request_id, prompt_ids, params, loop, q, accepted, time.monotonic()))
        try:
            await accepted
        except asyncio.CancelledError:
            self._cmds.put(("abort", request_id))  # a no-op if it was refused or never arrived
            raise
        return RequestStream(self, request_id, q)

    async def generate(self, prompt_ids: Sequence[int], params, request_id: str | None = None
                       ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas; the last one has `finished=True`."""
        stream = await self.add_request(prompt_ids, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def fail(self, message: str) -> None:
        """Stop the engine on a fatal error found outside a step (e.g. a tensor-parallel worker died while
        idle): every open request ends with `message`, then `on_fatal` runs. Thread-safe."""
        self._cmds.put(("fatal", message))

    def metrics(self) -> dict[str, float]:
        """A snapshot of the engine's counters and gauges (taken by the engine thread after every step)."""
        m = dict(self._metrics)
        m["finished"] = dict(self._finished)
        return m

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and accepting requests."""
        return self._thread.is_alive() and not self._closed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish every open stream with an error, stop both threads and close the engine."""
        if self._closed:
            return
        self._closed = True
        self._cmds.put(("stop",))
        self._thread.join(timeout)
        self._out_thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        driver = self.driver
        while True:
            try:
                cmd = self._cmds.get(block=not driver.has_work(), timeout=None)
            except queue.Empty:
                cmd = None
            stop = False
            while cmd is not None:
                stop |= self._handle(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if stop:
                break
            if not driver.has_work():
                self._snapshot()
                continue
            started = time.monotonic()
            self._kernel_threads = thread_pool.threads()  # one pool per process (bench serve switches it)
            try:
                events, rows = driver.step_events()
            except Exception as e:  # a failed step ends its requests, never the server, never a hang
                log.exception("engine step failed")
                events, rows = driver.fail_all(f"engine step failed: {type(e).__name__}: {e}"), []
                if getattr(e, "fatal", False):  # e.g. a tensor-parallel worker died: the engine cannot go on
                    self.fatal_error = f"{type(e).__name__}: {e}"
                    self._closed = True
                    self._out_q.put(("events", events, rows, started))
                    break
            self._out_q.put(("events", events, rows, started))
            self._snapshot()
            if not events and driver.has_work() and not self.engine.scheduler.num_running:
                time.sleep(0.001)  # nothing could be scheduled this step: do not spin at full speed
        self._out_q.put(("events", driver.fail_all(self.fatal_error or "the engine was shut down"), [],
                         time.monotonic()))
        self._out_q.put(("stop",))
        self._snapshot()
        try:
            self.engine.close()
        finally:
            if self.fatal_error is not None and self.on_fatal is not None:
                self.on_fatal(self.fatal_error)

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, params, loop, q, accepted, arrival = cmd
            try:
                seq = self.driver.add(rid, prompt_ids, params)
            except Exception as e:  # InvalidRequest, or a bad argument type: hand it to the caller
                _post(loop, _set_exception, accepted, e)
                return False
            self._requests_total += 1
            self._out_q.put(("add", rid, loop, q, seq.num_prompt_tokens, params, arrival))
            _post(loop, _set_result, accepted, None)
        elif kind == "abort":
            if self.driver.abort(cmd[1]):
                self._out_q.put(("abort", cmd[1]))
        elif kind == "stopped":  # the output thread found a stop string: it already ended the stream
            self.driver.abort(cmd[1])
        elif kind == "stop":
            return True
        elif kind == "fatal":
            self.fatal_error = cmd[1]
            self._closed = True
            return True
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return False

    def _snapshot(self) -> None:
        e, st = self.engine, self.engine.stats
        bm = e.scheduler.block_manager
        graphs = getattr(e.runner, "cpu_graphs", None)  # None: eager (or a runner without them)
        self._metrics = {
            "requests_running": e.scheduler.num_running,
            "requests_waiting": e.scheduler.num_waiting,
            "requests_total": self._requests_total,
            "kv_blocks_used": bm.num_used, "kv_blocks_total": bm.num_blocks, "kv_cache_usage": bm.usage,
            "steps_total": st.steps, "microbatched_steps_total": st.microbatched_steps,
            "straddling_rows_total": st.straddling_rows, "prompt_tokens_total": st.prompt_tokens,
            "generated_tokens_total": st.generated_tokens, "preemptions_total": st.preemptions,
            "request_errors_total": st.errors, "step_failures_total": st.step_failures,
            "kernel_threads": self._kernel_threads,
            "cpu_graphs": len(graphs) if graphs is not None else 0,
            "cpu_graph_bytes": graphs.nbytes if graphs is not None else 0,
            "spec_decode_num_drafts_total": st.spec_drafts, "spec_decode_num_draft_tokens_total": st.spec_draft_tokens,
            "spec_decode_num_accepted_tokens_total": st.spec_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(st.spec_accepted_per_position),
        }

    # ---- output thread ------------------------------------------------------------------------
    def _run_outputs(self) -> None:
        while True:
            msg = self._out_q.get()
            kind = msg[0]
            try:
                if kind == "events":
                    self._on_events(*msg[1:])
                elif kind == "add":
                    _, rid, loop, q, num_prompt, params, arrival = msg
                    self._outputs.add(rid, num_prompt, params.stop, params.min_tokens)
                    self._reqs[rid] = _Out(loop, q, _Timing(arrival))
                elif kind == "abort":
                    self._outputs.discard(msg[1])
                    out = self._reqs.pop(msg[1], None)
                    if out is not None:
                        self._count("abort", out)
                elif kind == "stop":
                    return
            except Exception:  # never let the output thread die: streams would hang
                log.exception("output thread: %s message failed", kind)

    def _on_events(self, events, rows: list[str], started: float) -> None:
        now = time.monotonic()
        for rid in rows:
            out = self._reqs.get(rid)
            if out is not None and not out.timing.scheduled:
                out.timing.scheduled = True
                for o in self.observers:
                    o.queued(max(0.0, started - out.timing.arrival))
        deltas, stopped = self._outputs.process(events)
        for rid in stopped:
            self._cmds.put(("stopped", rid))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for d in deltas:
            out = self._reqs.pop(d.request_id, None) if d.finished else self._reqs.get(d.request_id)
            if out is None:
                continue
            if d.token_id is not None:
                t = out.timing
                for o in self.observers:
                    if t.last_token is None:
                        o.first_token(now - t.arrival)
                    else:
                        o.inter_token(now - t.last_token)
                t.last_token = now
            if d.finished:
                self._count(d.finish_reason or "stop", out, now)
            by_loop.setdefault(out.loop, []).append((out.q, d))
        for loop, items in by_loop.items():  # one callback per event loop per step, not one per token
            if not _post(loop, _deliver, items):
                for _, d in items:  # that loop is gone: nobody will read these
                    if not d.finished:
                        self._reqs.pop(d.request_id, None)
                        self._outputs.discard(d.request_id)
                        self.abort(d.request_id)

    def _count(self, reason: str, out: _Out, now: float | None = None) -> None:
        self._finished[reason] = self._finished.get(reason, 0) + 1
        seconds = (now or time.monotonic()) - out.timing.arrival
        for o in self.observers:
            o.finished(reason, seconds)


class RequestStream:
    """The deltas of one request, in order; the last has `finished=True`. Closing it (`aclose`), a
    cancelled `__anext__` or garbage collection before the last delta aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, q: asyncio.Queue):
        self.engine, self.request_id, self._q = engine, request_id, q
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            delta = await self._q.get()
        except BaseException:  # cancelled: the consumer went away
            self._abort()
            raise
        self.finished = delta.finished
        return delta

    async def aclose(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __del__(self) -> None:
        self._abort()


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop is closed
        return False


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _deliver(items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
    for q, d in items:
        q.put_nowait(d)


__all__ = ["AsyncLLMEngine", "RequestStream", "RequestObserver", "EngineDriver", "InvalidRequest"]
