"""Comparing step batches field by field (tests/test_inputs.py, tests/test_decode_inputs.py)."""
from __future__ import annotations

import numpy as np
import torch

from engram_serve.inputs.batch import StepBatch


def assert_same_batch(got: StepBatch, want: StepBatch) -> None:
    """Every field of `got` equals `want`'s, in dtype, shape and value."""
    for name, value in want.fields().items():
        mine = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert mine.dtype == value.dtype and torch.equal(mine, value), name
        elif isinstance(value, np.ndarray):
            assert np.array_equal(mine, value), name
        else:
            assert mine == value, name
