"""The process group of one tensor-parallel model: rendezvous, backend, timeouts, step broadcasts.

A group is built from a rendezvous URL: `tcp://127.0.0.1:PORT` (workers started by this package, on
loopback) or `env://` (under `torchrun`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). The backend is
gloo for CPU tensors and NCCL for CUDA tensors. The backend object is held here and called directly,
never installed as torch's global default group, so one process may build and close several groups
(tests do) and nothing global leaks between them.

Every blocking call has a timeout (`timeout_s`): a peer that died or stopped answering makes the call
raise instead of hanging. Rank 0 rings a doorbell in the rendezvous store before each broadcast, so an
idle worker waits on the store in short slices (checking that its parent is alive) rather than inside
a collective that would time out.
"""
from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import EngramServeError


class ParallelError(EngramServeError, RuntimeError):
    """A tensor-parallel worker died, a collective failed or timed out: the group is unusable."""

    fatal = True  # the async engine stops (and the server shuts down) instead of serving on


@dataclass
class CommStats:
    """Counters of the cross-rank sums: launches, bytes of partials, seconds blocked in their waits."""

    launches: int = 0
    nbytes: int = 0
    wait_s: float = 0.0
    wait_s_by_name: dict = field(default_factory=dict)

    def add_wait(self, name: str, seconds: float) -> None:
        self.wait_s += seconds
        self.wait_s_by_name[name] = self.wait_s_by_name.get(name, 0.0) + seconds


@dataclass
class ParallelGroup:
    rank: int
    world: int
    device: torch.device
    pg: object  # a c10d backend (ProcessGroupGloo / the NCCL group): called directly
    store: object  # the rendezvous store (doorbells, worker error reports)
    timeout_s: float
    stats: "CommStats" = field(default_factory=lambda: CommStats())
    _step: int = field(default=0, repr=False)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @classmethod
    def connect(cls, init_method: str, rank: int, world: int, device: str | torch.device = "cpu",
                timeout_s: float = 60.0, check_peers=None) -> "ParallelGroup":
        """Rendezvous (every rank calls this) and build the backend: gloo on CPU, NCCL on CUDA.

        `check_peers` (rank 0 of workers it started itself): called while waiting for the other ranks
        to join; it raises if one of them died, so a failed start is reported at once, not at the timeout."""
        dev = torch.device(device)
        td = datetime.timedelta(seconds=timeout_s)
        if check_peers is not None and rank == 0 and init_method.startswith("tcp://"):
            host, port = init_method[len("tcp://"):].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, True, td, wait_for_workers=False)
            deadline = time.monotonic() + timeout_s
            while not store.check([f"joined/{r}" for r in range(1, world)]):
                check_peers()
                if time.monotonic() > deadline:
                    raise ParallelError(f"tensor-parallel ranks did not join {init_method} within {timeout_s} s")
                time.sleep(0.05)
        else:
            store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=td))
            store.set(f"joined/{rank}", "1")
        store.set_timeout(td)
        prefix = dist.PrefixStore("engram-tp", store)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, world, td)
        return cls(rank, world, dev, pg, store, timeout_s)

    # ---- collectives --------------------------------------------------------------------------
    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor):
        """Launch an all-gather (async): returns the c10d Work."""
        return self.pg.allgather([outs], [inp])

    def wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:  # a dead peer (connection closed) or a timeout
            raise ParallelError(f"tensor-parallel collective {what!r} failed on rank {self.rank}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled into a uint8 tensor). Rank 0 first rings the doorbell
        `step/<n>` holding the payload length; the others wait for it (`wait_doorbell`)."""
        n = self._step
        self._step += 1
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            self.store.set(f"step/{n}", str(len(payload)))
            if n >= 2:
                self.store.delete_key(f"step/{n - 2}")  # every rank has read it (it joined broadcast n-1)
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            size = int(self.store.get(f"step/{n}"))
            buf = torch.empty(size, dtype=torch.uint8)
        if self.device.type == "cuda":
            dev_buf = buf.to(self.device)
            self.wait(self.pg.broadcast(dev_buf, 0), "broadcast step")
            buf = dev_buf.cpu()
        else:
            self.wait(self.pg.broadcast(buf, 0), "broadcast step")
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def wait_doorbell(self, slice_s: float = 0.5) -> bool:
        """Worker side: True once rank 0 rang the next step's doorbell; False after `slice_s` without one."""
        try:
            self.store.wait([f"step/{self._step}"], datetime.timedelta(seconds=slice_s))
            return True
        except Exception as e:
            if "timeout" in str(e).lower() or "wait timeout" in str(e).lower():
                return False
            raise ParallelError(f"rank {self.rank}: lost the rendezvous store (rank 0 gone?): {e}") from e

    # ---- failure reports ----------------------------------------------------------------------
    def report_error(self, message: str) -> None:
        try:
            self.store.set(f"error/{self.rank}", message)
        except Exception:  # the store is gone too: nothing more to tell
            pass

    def reported_errors(self) -> dict[int, str]:
        out = {}
        for r in range(1, self.world):
            try:
                if self.store.check([f"error/{r}"]):
                    out[r] = self.store.get(f"error/{r}").decode(errors="replace")
            except Exception:
                break
        return out

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass
        self.store = None


def free_port() -> int:
    """A free TCP port on loopback (for the rendezvous of workers this package starts)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

