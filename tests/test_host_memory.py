"""Freed host memory is kept for reuse (runner/host_memory.py): a large tensor allocated, touched and
freed over and over faults its pages in once, not every time. Each case runs in a fresh interpreter,
since the setting is per process."""
import subprocess
import sys

import pytest

LOOP = """
import resource, torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(12):
    if i == 2:
        f0 = faults()
    torch.empty(12 << 20).fill_(1.0)  # 48 MiB, every page touched, freed at once
print(faults() - f0)
"""


def _faults(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", LOOP.format(setup=setup)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    kept = _faults("from engram_serve.runner.host_memory import keep_freed_memory\nassert keep_freed_memory()")
    default = _faults("")  # the negative control: glibc's defaults
    pages = 10 * (48 << 20) // 4096  # ten loops of 48 MiB, in 4 KiB pages
    assert kept < 0.02 * pages, f"{kept} faults over ten reuses of a freed 48 MiB block"
    assert default > 0.5 * pages, f"glibc's defaults faulted only {default} pages: the control shows nothing"


def test_the_environment_variable_turns_it_off(monkeypatch):
    from engram_serve.runner import host_memory
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory._apply() is False
