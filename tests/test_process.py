"""Process-wide settings (runner/process.py). Freed host memory is kept for reuse: a large tensor
allocated, touched and freed over and over faults its pages in once, not every time. Startup objects
are frozen out of the cyclic collector, and garbage made afterwards is still collected. Each case runs
in a fresh interpreter, since the settings are per process."""
import subprocess
import sys

import pytest

LOOP = """
import resource, torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(26):
    if i == 16:  # after a warm-up: the first reuses may still grow the heap while freed blocks coalesce
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
    kept = _faults("from engram_serve.runner.process import keep_freed_memory\nassert keep_freed_memory()")
    default = _faults("")  # the negative control: glibc's defaults
    pages = 10 * (48 << 20) // 4096  # ten loops of 48 MiB, in 4 KiB pages
    assert kept < 0.02 * pages, f"{kept} faults over ten reuses of a freed 48 MiB block"
    assert default > 0.5 * pages, f"glibc's defaults faulted only {default} pages: the control shows nothing"


def test_the_environment_variable_turns_it_off(monkeypatch):
    from engram_serve.runner import process
    monkeypatch.setenv(process.ENV, "0")
    assert process._apply() is False


FREEZE = """
import gc, weakref
from engram_serve.runner.process import freeze_startup_objects
class Node:
    pass
old = Node(); old.self = old  # alive at the freeze
n = freeze_startup_objects()
assert n > 1000 and freeze_startup_objects() == n, n  # once per process
assert gc.get_freeze_count() == n
new = Node(); new.self = new  # a cycle made after the freeze, then dropped
ref = weakref.ref(new)
del new
gc.collect()
print(ref() is None)
"""


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True", "a cycle made after the freeze was not collected"
