"""A decode step's inputs written in place (inputs/decode.py, `ModelRunner.build_decode`), by the decode kernel
and without it (a copy of `build_step`'s batch, checked for its padding and tables): the batch that `build_step` makes and the one `pad_tokens` makes of it, field by field, whatever
the previous step left in the buffers, and the rows and tables `plan_rows` makes of that; `execute` of it gives
the logits of `execute(build(...))` bit for bit on the built-in model.

Negative control, red through the real forward: padding left as the previous step wrote it (its real tokens'
KV slots) rewrites a batch mate's KV, and that row's next logits change.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.inputs.decode import DecodeInputs
from engram_serve.inputs.static import pad_tokens
from engram_serve.inputs.step import build_step
from engram_serve.inputs.step_state import StepState
from engram_serve.inputs.token_store import TokenStore
from engram_serve.model.context import ForwardContext
from engram_serve.model.deepseek_v41 import plan_rows
from engram_serve.model.loader import load_model
from engram_serve.runner import cpu_graphs
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from batches import assert_same_batch

BLOCK, HISTORY, SLOTS, MAX_LEN = 16, 3, 8, 200


def random_requests(rng, store: TokenStore, state: StepState) -> tuple[np.ndarray, np.ndarray]:
    """1-8 requests of random lengths (some dead tokens, some null blocks): (slots, the position each decodes)."""
    slots, positions = [], []
    blocks = rng.permutation(SLOTS * state.max_blocks)
    for i in range(int(rng.integers(1, SLOTS + 1))):
        length = int(rng.integers(1, MAX_LEN))
        slot = store.add(rng.integers(0, 500, length), rng.random(length) < 0.05)
        ids = blocks[i * state.max_blocks:][: -(-length // BLOCK)].tolist()
        ids = [-1 if rng.random() < 0.1 else b for b in ids]
        state.sync(slot, ids)
        slots.append(slot)
        positions.append(int(rng.integers(0, length)))
    return np.array(slots), np.array(positions)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad_to=st.integers(1, 12), kernel=st.booleans())
def test_the_decode_inputs_are_the_padded_built_batch_whatever_the_last_step_left(seed, pad_to, kernel):
    """By the decode kernel and by its numpy form."""
    if kernel and not kernels.loaded("decode"):
        pytest.skip("the decode kernel is not loaded")
    with kernels.override("all" if kernel else "-decode"):
        check_decode_inputs(seed, pad_to)


def check_decode_inputs(seed: int, pad_to: int) -> None:
    rng = np.random.default_rng(seed)
    store, state = TokenStore(SLOTS, MAX_LEN), StepState(SLOTS, -(-MAX_LEN // BLOCK))
    slots, positions = random_requests(rng, store, state)
    inputs = DecodeInputs(SLOTS, pad_to, BLOCK, HISTORY, state.max_blocks)
    k = int(rng.integers(1, len(slots) + 1))  # a previous step over other rows leaves its values behind
    inputs.fill(store, state, slots[::-1][:k], positions[::-1][:k], MAX_LEN)
    top = min(int(positions.max()) + 1 + int(rng.integers(0, 40)), MAX_LEN)  # a static bound on the positions
    got = inputs.fill(store, state, slots, positions, top)
    ones = np.ones(len(slots), dtype=np.int64)
    want = build_step(store, slots, positions, ones, state, BLOCK, HISTORY, ones.astype(bool))
    padded = pad_tokens(want, max(len(slots), pad_to))
    assert_same_batch(got, want)
    assert_same_batch(inputs.padded, padded)
    for g, w in zip(inputs.planned, plan_rows(ForwardContext(padded, None, None, None, max_seq_len=top))):
        assert g.dtype == w.dtype and torch.equal(g, w)


class StalePadding(DecodeInputs):
    neutral_padding = False


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def runner(loaded, graphs: bool, inputs=DecodeInputs, pad_to: int = 4) -> ModelRunner:
    r = ModelRunner(loaded, RunnerConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
                                         num_blocks=32, cpu_graphs=graphs))
    if graphs:  # padded past the rows of a one-row step (the built-in model itself needs no padding)
        r.decode_inputs = inputs(4, pad_to, r.cfg.block_size, r.history_len, r.cfg.max_blocks_per_seq)
    return r


def steps(r: ModelRunner) -> list[torch.Tensor]:
    """Three requests: their first 20 prompt tokens prefilled, then decode steps at prompt positions over all,
    one, then two of them (the last step reads the KV that the one-row step's padding could overwrite)."""
    rng = np.random.default_rng(0)
    slots = np.array([r.store.add(rng.integers(6, 4096, 40).tolist()) for _ in range(3)])
    for i, s in enumerate(slots):
        r.state.sync(int(s), list(range(3 * i, 3 * i + 3)))
    ones = np.ones(3, dtype=bool)
    out = [r.execute(r.build(slots, np.zeros(3, np.int64), np.full(3, 20), None, ones)).logits]
    for rows, pos in (([0, 1, 2], 20), ([0], 21), ([1, 2], 21), ([0, 1, 2], 22)):
        out.append(r.execute(r.build_decode(slots[rows], np.full(len(rows), pos))).logits)
    return out


@pytest.mark.skipif(not cpu_graphs.CpuGraphs.available(), reason="the linear and token kernels are not loaded")
def test_decode_steps_have_the_bits_of_built_steps_and_stale_padding_corrupts_a_batch_mate(loaded):
    eager = steps(runner(loaded, False))
    for pad_to in (1, 4):
        r = runner(loaded, True, pad_to=pad_to)
        got = steps(r)
        assert all(torch.equal(a, b) for a, b in zip(got, eager)), f"pad_to={pad_to}"
        assert r.cpu_graphs.replays + r.cpu_graphs.captures > 0
    stale = steps(runner(loaded, True, StalePadding))
    assert all(torch.equal(a, b) for a, b in zip(stale[:3], eager[:3]))  # up to the one-row step
    assert not torch.equal(stale[3], eager[3])  # rows 1 and 2 read the KV that the padding rewrote
