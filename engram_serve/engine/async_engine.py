"""Driving an `LLMEngine`: a synchronous driver (used by `LLM`) and an asyncio front (used by the server).

`EngineDriver` adds validation, an admission queue and detokenization around the engine: requests
beyond the engine's token-store slots wait in `pending` (already validated) and are admitted as
slots free up; every step's `TokenEvent`s become `RequestDelta`s; a stop string aborts its request.

`AsyncLLMEngine` runs one driver on ONE background thread. The model is not thread-safe, so every
engine call (add, abort, step) happens on that thread; asyncio callers talk to it through a command
queue, and deltas come back to each request's `asyncio.Queue` via `loop.call_soon_threadsafe`.
When there is no work, the thread blocks on the command queue (no spinning).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass


from ..errors import InvalidRequest
from .detokenizer import OutputProcessor, RequestDelta
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: object


class EngineDriver:
    """Requests in, deltas out, around one `LLMEngine`. Not thread-safe: one thread makes every call.

    Invariant: every request id is in exactly one of `pending` (validated, not yet in the engine) or
    the engine together with `outputs` (until its finishing delta is returned or it is aborted)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.outputs = OutputProcessor(engine.loaded.tokenizer)
        self.pending: OrderedDict[str, _Pending] = OrderedDict()

    def add(self, request_id: str, prompt_ids: Sequence[int], params) -> None:
        """Validate (InvalidRequest) and queue; the request enters the engine when a slot is free."""
        if request_id in self.pending or request_id in self.outputs or request_id in self.engine.seqs:
            raise InvalidRequest(f"request_id={request_id!r} is already in use")
        ids = self.engine.validate(prompt_ids, params)
        self.pending[request_id] = _Pending(ids, params)
        self._admit()

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its KV blocks and token-store slot are freed."""
        self.outputs.discard(request_id)
        if self.pending.pop(request_id, None) is not None:
            return True
        found = self.engine.abort(request_id)
        self._admit()
        return found

    def has_work(self) -> bool:
        return bool(self.pending) or self.engine.has_unfinished()

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def step(self) -> list[RequestDelta]:
        """Admit what fits, run one engine step, return its deltas (stop strings already aborted)."""
        self._admit()
        deltas: list[RequestDelta] = []
        if self.engine.has_unfinished():
            result = self.engine.step()
            deltas, stopped = self.outputs.process(result.events)
            for rid in stopped:
                self.engine.abort(rid)
        deltas += self._admit()
        return deltas

    def fail_all(self, message: str) -> list[RequestDelta]:
        """End every request with finish_reason "error" (the step itself failed) and free them."""
        deltas = self.outputs.fail_all(message)
        deltas += [RequestDelta(rid, "", None, True, "error", message, len(p.prompt_ids))
                   for rid, p in self.pending.items()]
        self.pending.clear()
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        return deltas

    def _admit(self) -> list[RequestDelta]:
        """Move pending requests into the engine while it has token-store slots."""
        failed = []
        while self.pending and self.engine.runner.store.num_free > 0 \
                and len(self.engine.seqs) < self.engine.cfg.max_num_seqs:
            rid, p = self.pending.popitem(last=False)
            try:
                self.engine.add_request(rid, p.prompt_ids, p.params)
            except InvalidRequest as e:  # checked already; kept so one bad request never blocks the queue
                failed.append(RequestDelta(rid, "", None, True, "error", str(e), len(p.prompt_ids)))
                continue
            self.outputs.add(rid, len(p.prompt_ids), getattr(p.params, "stop", ()) or ())
        return failed


class _Rate:
    """Tokens per second over a sliding window, read from any thread."""

    def __init__(self, window_s: float = 10.0):
        self.window_s, self._samples, self._lock = window_s, deque(), threading.Lock()

    def add(self, now: float, total: int) -> None:
        with self._lock:
            self._samples.append((now, total))
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()  # keep one sample at or before the window start as the base

    def rate(self, now: float) -> float:
        with self._lock:
            if not self._samples:
                return 0.0
            (t0, g0), (_, g1) = self._samples[0], self._samples[-1]
        span = max(now - max(t0, now - self.window_s), 1e-9)
        return (g1 - g0) / span if now - t0 > 1e-9 else 0.0


class AsyncLLMEngine:
    """An `LLMEngine` stepped on one background thread, with asyncio streams per request.

    `generate` streams `RequestDelta`s; a validation error raises InvalidRequest before the first
    delta; cancelling or closing the consumer aborts the request (KV blocks and slot freed)."""

    def __init__(self, engine: LLMEngine):
        self.driver = EngineDriver(engine)
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._rate = _Rate()
        self._metrics: dict[str, float] = {}
        self._requests_total = 0
        self._closed = False
        self.fatal_error: str | None = None  # why the engine stopped on its own (a fatal step error)
        self.on_fatal = None  # called with that message from the engine thread (the server shuts down)
        self._ids = itertools.count()
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engram-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model=None, *, enable_prefix_caching: bool = True, **runner_options) -> "AsyncLLMEngine":
        """`model`: a checkpoint path, None (the built-in tiny model) or a LoadedModel."""
        from ..llm import build_engine
        return cls(build_engine(model, enable_prefix_caching=enable_prefix_caching, **runner_options))

    @property
    def tokenizer(self):
        return self.engine.loaded.tokenizer

    # ---- asyncio side -------------------------------------------------------------------------
    async def add_request(self, prompt_ids: Sequence[int], params, request_id: str | None = None
                          ) -> "RequestStream":
        """Validate and queue a request; returns its delta stream. Raises InvalidRequest if refused."""
        if self._closed:
            raise RuntimeError("AsyncLLMEngine is shut down")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._cmds.put(("add", request_id, prompt_ids, params, loop, q, accepted))
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
        """A snapshot for /metrics (taken by the engine thread after every step; rate computed now)."""
        m = dict(self._metrics)
        m["generation_tokens_per_second"] = self._rate.rate(time.monotonic())
        return m

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and accepting requests."""
        return self._thread.is_alive() and not self._closed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish every open stream with an error, stop the thread and close the engine."""
        if self._closed:
            return
        self._closed = True
        self._cmds.put(("stop",))
        self._thread.join(timeout)

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
            try:
                deltas = driver.step()
            except Exception as e:  # a failed step ends its requests, never the server, never a hang
                log.exception("engine step failed")
                deltas = driver.fail_all(f"engine step failed: {type(e).__name__}: {e}")
                if getattr(e, "fatal", False):  # e.g. a tensor-parallel worker died: the engine cannot go on
                    self.fatal_error = f"{type(e).__name__}: {e}"
                    self._closed = True
                    self._dispatch(deltas)
                    break
            self._dispatch(deltas)
            self._snapshot()
            if not deltas and driver.has_work() and not self.engine.scheduler.num_running:
                time.sleep(0.001)  # nothing could be scheduled this step: do not spin at full speed
        self._dispatch(driver.fail_all(self.fatal_error or "the engine was shut down"))
        self._snapshot()
        try:
            self.engine.close()
        finally:
            if self.fatal_error is not None and self.on_fatal is not None:
                self.on_fatal(self.fatal_error)

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, params, loop, q, accepted = cmd
            try:
                self.driver.add(rid, prompt_ids, params)
            except Exception as e:  # InvalidRequest, or a bad argument type: hand it to the caller
                _post(loop, _set_exception, accepted, e)
                return False
            self._streams[rid] = (loop, q)
            self._requests_total += 1
            _post(loop, _set_result, accepted, None)
        elif kind == "abort":
            self._streams.pop(cmd[1], None)
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

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        """One callback per event loop per step, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for d in deltas:
            target = self._streams.pop(d.request_id, None) if d.finished else self._streams.get(d.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], d))
        for loop, items in by_loop.items():
            if not _post(loop, _deliver, items):
                for _, d in items:  # that loop is gone: nobody will read these
                    if not d.finished:
                        self._streams.pop(d.request_id, None)
                        self.driver.abort(d.request_id)

    def _snapshot(self) -> None:
        e, st = self.engine, self.engine.stats
        bm = e.scheduler.block_manager
        now = time.monotonic()
        self._rate.add(now, st.generated_tokens)
        self._metrics = {
            "requests_running": e.scheduler.num_running,
            "requests_waiting": e.scheduler.num_waiting + self.driver.num_pending,
            "requests_total": self._requests_total,
            "kv_blocks_used": bm.num_used, "kv_blocks_total": bm.num_blocks, "kv_cache_usage": bm.usage,
            "steps_total": st.steps, "microbatched_steps_total": st.microbatched_steps,
            "straddling_rows_total": st.straddling_rows, "prompt_tokens_total": st.prompt_tokens,
            "generated_tokens_total": st.generated_tokens, "preemptions_total": st.preemptions,
            "request_errors_total": st.errors,
        }


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
