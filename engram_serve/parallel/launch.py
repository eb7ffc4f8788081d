"""Worker processes of a tensor-parallel model, their loop, failure detection and shutdown.

Two ways to start N ranks:
  * `TPCluster(path, N)` (what `--tensor-parallel-size N` does): this process is rank 0; it starts
    ranks 1..N-1 with torch.multiprocessing (spawn) and they rendezvous on loopback
    (`tcp://127.0.0.1:<free port>`).
  * under torchrun (`env://`, any number of machines): every process runs `engram-serve ... 
    --dist-init env://`; RANK 0 becomes the TPCluster (the server, verify, ...), every other rank
    runs `worker_entry` (docs/parallelism.md).

Rank 0 owns the scheduler; the workers loop on rank 0's broadcasts: ("runner", RunnerConfig, class)
builds a fresh runner on the rank's shard, ("step", ...) runs one step, ("stop",) ends the loop.

Failures: a worker that raises reports its error in the rendezvous store and exits; rank 0 checks its
workers before each step and turns a failed collective into a ParallelError that names the dead rank,
its pid and exit code. Every wait has a timeout; an idle worker also exits when its parent is gone.
`close` stops the workers (stop message, then join with a timeout, then terminate/kill): no orphans.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from pathlib import Path

import torch

from ..errors import EngramServeError
from .collectives import sum_now
from .group import ParallelError, ParallelGroup, free_port
from .runner import ParallelModelRunner, unpack_batch

log = logging.getLogger("engram_serve.parallel")


def _load_shard(model_path, group: ParallelGroup):
    from ..model.loader import load_model
    from .shard import shard_model
    return shard_model(load_model(model_path, pin_tables=False), group)


def serve_worker(group: ParallelGroup, loaded, ppid: int | None = None) -> None:
    """The worker loop (ranks 1..N-1) until rank 0 says stop, or rank 0 / the parent process is gone."""
    runner = None
    try:
        while True:
            if not group.wait_doorbell(0.5):
                if ppid is not None and os.getppid() != ppid:
                    log.warning("rank %d: parent process gone; exiting", group.rank)
                    return
                continue
            msg = group.broadcast_object()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "runner":
                if runner is not None:
                    runner.close()
                _, cfg, cls = msg
                runner = cls(loaded, cfg, group)
            elif kind == "call":  # run fn(group, *args) on every rank (settings, benchmarks)
                _, fn, args = msg
                fn(group, *args)
            elif kind == "step":
                _, packed, bounds, record, score_rows, reads = msg  # the same rows as rank 0 (its keep)
                try:
                    runner.execute(unpack_batch(packed, group.device), bounds, record, score_rows, reads)
                except ParallelError:
                    raise
                except EngramServeError as e:  # deterministic: rank 0 raised the same error at the same point
                    log.warning("rank %d: step failed: %s", group.rank, e)
            else:
                raise ValueError(f"unknown message {kind!r} from rank 0")
    finally:
        if runner is not None:
            runner.close()


def _worker_main(rank: int, world: int, init_method: str, model_path: str, device: str, timeout_s: float,
                 ppid: int, threads: int) -> None:
    from .. import thread_pool
    torch.set_num_threads(threads)
    thread_pool.set_threads(threads)  # this rank's share of the cores (TPCluster)
    group = ParallelGroup.connect(init_method, rank, world, device, timeout_s)
    try:
        serve_worker(group, _load_shard(model_path, group), ppid)
    except BaseException as e:
        group.report_error(f"{type(e).__name__}: {e}")
        log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        group.close()


def worker_entry(model_path, device: str = "cpu", timeout_s: float = 60.0) -> int:
    """A worker rank under torchrun (`env://`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from ..engine.threads import share_cores
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))  # the ranks on this machine share its cores
    group = ParallelGroup.connect("env://", rank, world, device, timeout_s)
    try:
        serve_worker(group, _load_shard(model_path, group))
    except BaseException as e:
        group.report_error(f"{type(e).__name__}: {e}")
        raise
    finally:
        group.close()
    return 0


@contextlib.contextmanager
def _worker_environment():
    """The environment the spawned workers start with: c10d's C++ log at ERROR unless the user chose a
    level (TORCH_CPP_LOG_LEVEL, read once, when torch loads). An idle worker waits for rank 0's doorbell
    in short slices (ParallelGroup.wait_doorbell), and c10d logs a two-line warning for every slice
    that ends without one; the slice's end is expected, not a problem."""
    key, before = "TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL")
    if before is None:
        os.environ[key] = "ERROR"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


def set_kernel_threads(group: ParallelGroup, n: int) -> int:
    """The C kernels' pool size on a rank (`TPCluster.call_all`: verify's one-thread baseline on every rank)."""
    from .. import thread_pool
    return thread_pool.set_threads(n)


def local_device(device: str) -> str:
    """Under torchrun, each process takes the GPU of its LOCAL_RANK."""
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


def bind_cpus(group: ParallelGroup, cores: list[int], bind: bool = True) -> list[int]:
    """Pin every thread of this rank's process (the compute thread, gloo's threads, the Engram gather
    thread; threads started later inherit it) to the rank's own share of `cores` (rank 0's cores
    before any binding; the workers it spawned inherit them): rank r of N gets
    cores[r*C/N : (r+1)*C/N]. `bind=False` gives all of `cores` back. Called on every rank through
    TPCluster.call_all by `bench step --tensor-parallel-size`; returns this rank's cores once every
    rank has applied its own (a cross-rank sum at the end).

    Why: unpinned, N ranks and their communication threads migrate between the same few cores, and a
    rank preempted by its peer's thread leaves the other rank waiting inside a collective."""
    if len(cores) < group.world:
        raise ValueError(f"bind_cpus: {len(cores)} cores {cores} for {group.world} ranks")
    per = len(cores) // group.world
    mine = cores[group.rank * per:(group.rank + 1) * per] if bind else list(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    sum_now(group, torch.zeros(1), "bind_cpus")
    return mine


class TPCluster:
    """Rank 0 of an N-way tensor-parallel model: the workers, the group and this rank's shard."""

    def __init__(self, model_path: str | Path | None, world: int, device: str = "cpu",
                 init_method: str | None = None, timeout_s: float = 60.0):
        from ..model.loader import TINY_DIR
        from .shard import check_divisible
        if world < 2:
            raise ValueError(f"tensor_parallel_size={world}: a cluster needs >= 2 ranks")
        self.model_path = str(model_path if model_path is not None else TINY_DIR)
        self.world, self.device = world, device
        self.procs = []
        self._closed = False
        from ..config import ModelConfig, read_json
        from ..engine.threads import share_cores
        check_divisible(ModelConfig.from_dict(read_json(Path(self.model_path) / "config.json")), world)
        # the ranks on this machine share its cores: each runs its kernels and torch on its share of the threads
        threads = share_cores(world if init_method is None else int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if init_method is None:  # start our own workers on loopback
            init_method = f"tcp://127.0.0.1:{free_port()}"
            ctx = torch.multiprocessing.get_context("spawn")
            with _worker_environment():
                for r in range(1, world):
                    p = ctx.Process(target=_worker_main, name=f"engram-tp-rank{r}", daemon=True,
                                    args=(r, world, init_method, self.model_path, device, timeout_s, os.getpid(),
                                          threads))
                    p.start()
                    self.procs.append(p)
        try:
            self.group = ParallelGroup.connect(init_method, 0, world, device, timeout_s, check_peers=self.check)
            self.loaded = _load_shard(self.model_path, self.group)
        except Exception as e:
            why = self.diagnose()
            self.close()
            raise ParallelError(f"starting {world} tensor-parallel ranks failed: {why or e}") from e
        self.on_death = None  # called once with a message when a worker dies (even while idle)
        if self.procs:
            threading.Thread(target=self._watch, name="engram-tp-watchdog", daemon=True).start()

    def _watch(self, period_s: float = 0.5) -> None:
        while not self._closed:
            why = self.diagnose(check_only=True)
            if why:
                if self.on_death is not None and not self._closed:
                    self.on_death(why)
                return
            time.sleep(period_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def make_runner(self, cfg, runner_cls: type = ParallelModelRunner) -> ParallelModelRunner:
        """A fresh runner on every rank (rank 0's is returned). `runner_cls` must be importable by name
        in the workers (tests pass a subclass for the negative control)."""
        self.check()
        self.group.broadcast_object(("runner", cfg, runner_cls))
        return runner_cls(self.loaded, cfg, self.group, self.diagnose)

    def call_all(self, fn, *args):
        """fn(group, *args) on every rank (fn importable by name in the workers); returns rank 0's result."""
        self.check()
        self.group.broadcast_object(("call", fn, args))
        return fn(self.group, *args)

    def check(self) -> None:
        why = self.diagnose(check_only=True)
        if why:
            raise ParallelError(why)

    def diagnose(self, check_only: bool = False, wait_s: float = 0.0) -> str | None:
        """A description of dead workers and reported errors, or None when all look fine. `wait_s`: after
        a failed collective, give a dying worker that long to be reaped (its socket closes first)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                    for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if check_only and not dead:
            return None
        errs = {}
        if getattr(self, "group", None) is not None and self.group.store is not None:
            errs = self.group.reported_errors()
        parts = dead + [f"rank {r} reported: {m}" for r, m in errs.items()]
        return "; ".join(parts) or None

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "group", None)
        if group is not None and group.pg is not None and not self.diagnose(check_only=True):
            try:
                group.broadcast_object(("stop",))
            except Exception as e:  # a broken group: the workers are stopped below anyway
                log.warning("stop broadcast failed: %s", e)
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if group is not None:
            group.close()
        from ..engine.threads import share_cores
        share_cores(1)  # this process has the machine's cores again
