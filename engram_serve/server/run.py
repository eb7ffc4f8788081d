"""Running the server: `serve` (the CLI's `engram-serve serve`), its flags, and `BackgroundServer`
(uvicorn on a loopback socket in a thread, for tests and benchmarks).

`serve` binds its socket before it loads the model, so a busy port fails at once, in one line.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..bench.common import bounded_int, positive_int
from ..engine.scheduler import MAX_WAITING
from ..errors import ConfigError

API_KEY_ENV = "ENGRAM_SERVE_API_KEY"
log = logging.getLogger("engram_serve.server")


def start_serve_process(args: list[str], timeout_s: float, **popen) -> tuple[subprocess.Popen, str]:
    """`engram-serve serve --port P *args` in a child process on a free loopback port P (popen: stdout, stderr,
    env...), returned with its base URL once /health answers 200 (scripts/soak.py, the tests that need a real
    server). If it exits or does not answer within timeout_s it is killed: RuntimeError naming its exit code and
    the tail of its output where that was piped."""
    import httpx

    from ..parallel.group import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engram_serve.cli", "serve", "--port", str(port), *args], **popen)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = b"".join(x if isinstance(x, bytes) else x.encode() for x in proc.communicate() if x)
            raise RuntimeError(f"serve did not start within {timeout_s:.0f} s (exit code {proc.returncode}): "
                               f"{out.decode(errors='replace')[-2000:]}")
        time.sleep(0.2)


class BackgroundServer:
    """uvicorn on a loopback socket in a daemon thread (tests, benchmarks). The socket is bound
    before the thread starts, so `base_url` is valid at once (port 0 = a free port)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self._sock = bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="engram-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket, or ConfigError naming --host/--port (busy port, bad address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        raise ConfigError(f"--host {host} --port {port}: the address {why}") from None
    return sock


def log_to_stderr(level: str) -> None:
    """The package's log records (logger `engram_serve`) on stderr at `level`, as `LEVEL: message`."""
    logger = logging.getLogger("engram_serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def serve(model_path: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000, *,
          model_name: str | None = None, log_level: str = "info", enable_prefix_caching: bool = True,
          api_key: str | None = None, chat_template: Path | None = None, max_body_bytes: int | None = None,
          threads: int | None = None, seed: int | None = None, **runner_options) -> None:
    """Bind, load the model (with a progress bar), start the engine thread and serve until interrupted."""
    import uvicorn

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.factory import build_engine
    from .api import DEFAULT_MAX_BODY_BYTES, build_app
    sock = bind(host, port)  # before loading: a busy port fails in a second, not after the model loads
    try:
        log_to_stderr(log_level)  # the engine's start-up line (its C kernels) and the package's own logs
        engine = build_engine(model_path, enable_prefix_caching=enable_prefix_caching, progress=True,
                              threads=threads, seed=seed, **runner_options)
        name = model_name or f"engram-{engine.loaded.path.name}"
        async_engine = AsyncLLMEngine(engine)
        app = build_app(async_engine, name, own_engine=True, api_key=api_key, chat_template=chat_template,
                        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on"))

        def fatal(message: str) -> None:  # engine thread: e.g. a tensor-parallel worker died
            log.error("engine stopped: %s; shutting the server down", message)
            server.should_exit = True
        async_engine.on_fatal = fatal
        cluster = getattr(engine.runner, "cluster", None)
        if cluster is not None:  # a worker that dies while the server is idle stops it too
            cluster.on_death = async_engine.fail
        try:
            server.run(sockets=[sock])
        finally:
            async_engine.shutdown()
    finally:
        sock.close()
    if async_engine.fatal_error is not None:
        from ..errors import EngineFailed
        raise EngineFailed(f"the server shut down: {async_engine.fatal_error}")


# ---- CLI: engram-serve serve --------------------------------------------------------------------------

_port = bounded_int(0, 65535, "is not a TCP port (0..65535)")
_int64 = bounded_int(-(2 ** 63), 2 ** 63 - 1, "does not fit in a signed 64-bit integer")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    a("--port", type=_port, default=8000, help="TCP port (default 8000)")
    a("--model", type=Path, default=None, metavar="PATH", help="checkpoint directory (default: the built-in model)")
    a("--served-model-name", "--model-name", dest="model_name", default=None, metavar="NAME",
      help="the name clients use in `model` (default: engram-<checkpoint directory name>)")
    a("--dtype", choices=("auto", "float32"), default="auto",
      help="weights and activations; this runtime computes in float32 (auto = float32)")
    a("--max-model-len", type=positive_int, default=None, metavar="N",
      help="prompt + output tokens per request at most (default: min(2048, max_position_embeddings))")
    a("--max-num-seqs", type=positive_int, default=64, metavar="N", help="requests in the running batch (64)")
    a("--max-num-batched-tokens", type=positive_int, default=1024, metavar="N", help="tokens per step (1024)")
    a("--max-waiting", type=positive_int, default=MAX_WAITING, metavar="N",
      help=f"requests waiting for a slot before a new one gets 503 (default {MAX_WAITING})")
    a("--num-kv-blocks", type=positive_int, default=1024, metavar="N",
      help="KV-cache size in blocks of --block-size tokens (default 1024)")
    a("--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block (16)")
    a("--enforce-eager", action="store_true",
      help="never replay recorded steps (decode and short prompts: the CPU graphs of runner/cpu_graphs.py)")
    a("--microbatches", "--ubatches", dest="microbatches", type=positive_int, default=2, metavar="N",
      help="microbatches per large step (default 2: dual-batch overlap; 1 = off)")
    a("--no-microbatching", "--no-dual-batch-overlap", dest="no_microbatching", action="store_true",
      help="same as --microbatches 1")
    a("--no-enable-prefix-caching", action="store_true", help="do not reuse KV blocks of identical prefixes")
    a("--chat-template", type=Path, default=None, metavar="FILE",
      help="a Jinja chat template file (default: tokenizer_config.json's, else the built-in one)")
    a("--api-key", default=None, metavar="KEY",
      help=f"require `Authorization: Bearer KEY` (except on /health and /metrics); also ${API_KEY_ENV}")
    a("--seed", type=_int64, default=None, metavar="S",
      help="seeds the per-request seeds of requests that give none (default: random)")
    a("--threads", type=positive_int, default=None, metavar="N",
      help="threads of the C kernels (and of torch where not exact; default: the cores of this process's "
           "affinity mask)")
    a("--max-body-bytes", type=positive_int, default=None, metavar="N",
      help="largest request body accepted, larger ones get 413 (default 4 MiB)")
    a("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    from ..spec.config import add_speculative_arg
    add_speculative_arg(parser)
    from ..parallel.options import add_parallel_args
    add_parallel_args(parser)  # --tensor-parallel-size, --device, --dist-init


def run_serve(args: argparse.Namespace) -> int:
    from ..microbatch.plan import MicrobatchConfig
    if args.chat_template is not None and not args.chat_template.is_file():
        raise ConfigError(f"--chat-template {args.chat_template}: no such file")
    options = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   num_blocks=args.num_kv_blocks, block_size=args.block_size,
                   microbatch=MicrobatchConfig(num_microbatches=1 if args.no_microbatching else args.microbatches))
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    from ..parallel.options import engine_options
    options.update(engine_options(args))
    if args.enforce_eager:
        options["cpu_graphs"] = False
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    serve(args.model, args.host, args.port, model_name=args.model_name, log_level=args.log_level,
          enable_prefix_caching=not args.no_enable_prefix_caching, api_key=args.api_key or os.environ.get(API_KEY_ENV),
          chat_template=args.chat_template, max_body_bytes=args.max_body_bytes, threads=args.threads, seed=args.seed,
          max_waiting=args.max_waiting, **options)
    return 0
