"""`engram-serve serve` as a real process on a free loopback port, for the tests that need one."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx

from engram_serve.parallel.group import free_port


def start_serve(args: list[str], timeout_s: float, **popen) -> tuple[subprocess.Popen, str]:
    """Start `serve` with `args` (popen: stdout/stderr/env...) and wait until /health answers 200.
    Returns the process and its base URL; raises RuntimeError with the output's tail if it fails."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engram_serve.cli", "serve", "--port", str(port), *args], **popen)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = b"".join(x if isinstance(x, bytes) else x.encode() for x in proc.communicate() if x)
            raise RuntimeError(f"serve did not start: {out.decode()[-2000:]}")
        time.sleep(0.2)
