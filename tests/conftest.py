import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

# The tests are grouped by what they test (kernels/, reference/, the rest here); their shared helpers live in
# support/ (fixtures, controls, processes) and reference/ (the float64 reference and the peer oracles), imported
# by module name from any folder.
for _folder in ("support", "reference"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / _folder))

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny-model steps are dominated by op overhead; on a shared 2-core machine extra intra-op threads
# wait on the busy core and make a step ~20x slower. One thread keeps the suite fast and steady.
torch.set_num_threads(1)
os.environ.setdefault("ENGRAM_SERVE_THREADS", "1")  # what engines built by the tests set (engine/threads.py)
