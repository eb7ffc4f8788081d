"""The token kernel of the CPU forward (model/_token_kernel.c, model/_kernel_math.h, through model/fused.py)
against independent float64 plain loops, and the property it exists for: a token's bits do not depend on
its batch mates or on its place in a call, and the form taken (C or torch) does not depend on the layout
of the tensors handed in."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.model import fused

pytestmark = pytest.mark.skipif(not kernels.loaded("token"),
                                reason="the token kernel is not loaded (`engram-serve env` says why)")


def rms(a: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return a / math.sqrt(sum(float(e) ** 2 for e in a) / len(a) + eps)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), hc=st.sampled_from([1, 2, 4]), dim=st.sampled_from([16, 40]), seed=st.integers(0, 2**31))
def test_engram_gate_matches_the_plain_loop_and_a_row_alone(n, hc, dim, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hc, dim, generator=g)
    kv = torch.randn(n, (hc + 1) * dim, generator=g)
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    dead = torch.rand(n, generator=g) < 0.3
    gated = fused.engram_gate(h, kv, qw, kw, dead, 1e-6)
    for t in range(n):
        for i in range(hc):
            dot = float((rms(h[t, i].double()) * qw[i].double() * rms(kv[t, i * dim:(i + 1) * dim].double())
                         * kw[i].double()).sum()) / math.sqrt(dim)
            gate = 0.0 if dead[t] else 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            np.testing.assert_allclose(gated[t, i].double(), h[t, i].double() + gate * kv[t, hc * dim:].double(),
                                       rtol=1e-5, atol=1e-5)
        one = slice(t, t + 1)  # a token alone: the same bits
        assert torch.equal(fused.engram_gate(h[one], kv[one], qw, kw, dead[one], 1e-6), gated[one])


def test_the_form_taken_does_not_depend_on_the_layout():
    """A column slice of one row is contiguous, of several rows not (tensor parallelism's summed Engram
    projections are such slices): the C form must run for both, or a token's bits would depend on
    its batch. (Choosing the form by contiguity broke verify at TP=2 across cuts.)"""
    g = torch.Generator().manual_seed(0)
    hc, dim = 2, 16
    h = torch.randn(3, hc, dim, generator=g)
    both = torch.randn(3, 2 * (hc + 1) * dim, generator=g)
    kv = both[:, :(hc + 1) * dim]  # not contiguous
    qw, kw = torch.randn(hc, dim, generator=g), torch.randn(hc, dim, generator=g)
    assert not kv.is_contiguous() and kv[1:2].is_contiguous()
    batch = fused.engram_gate(h, kv, qw, kw, None, 1e-6)
    for t in range(3):
        assert torch.equal(fused.engram_gate(h[t:t + 1], kv[t:t + 1], qw, kw, None, 1e-6), batch[t:t + 1])
    src = torch.randn(9, 2 * 8, generator=g)[:, :8]  # rows of a column slice
    ids = torch.tensor([4, 0, 4, 8])
    assert torch.equal(fused.gather_rows(src, ids, 3), src[ids][:, None].expand(4, 3, 8))
    assert torch.equal(fused.gather_rows(src, ids[2:3]), fused.gather_rows(src, ids)[2:3])


def plain_argmax(row: list[float]) -> int:
    """The first index of the row's maximum, a NaN above every number: a plain loop."""
    best = 0
    for j, v in enumerate(row):
        b = row[best]
        if math.isnan(b):
            break
        if math.isnan(v) or v > b:
            best = j
    return best


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), v=st.integers(1, 70), data=st.data())
def test_argmax_rows_is_the_first_maximum_with_nan_first(rows, v, data):
    """`fused.argmax_rows` (the sampler's argmax) against a plain loop and torch.argmax, on rows with ties,
    +-0, +-inf and NaN, in the vector body and the tail."""
    special = st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 3.5])
    x = torch.tensor([[data.draw(special | st.floats(-4, 4, width=32)) for _ in range(v)] for _ in range(rows)],
                     dtype=torch.float32)
    got = fused.argmax_rows(x)
    assert got.tolist() == [plain_argmax(r) for r in x.tolist()]
    assert torch.equal(got, x.argmax(dim=1))


def test_gather_rows_refuses_an_id_outside_the_table():
    src = torch.randn(5, 4)
    with pytest.raises(ValueError):
        fused.gather_rows(src, torch.tensor([1, 5]))
    with kernels.override("-token"), pytest.raises(IndexError):  # the torch form: plain indexing
        fused.gather_rows(src, torch.tensor([1, 5]))
