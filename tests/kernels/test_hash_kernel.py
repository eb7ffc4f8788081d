"""The C hash kernel (the hash kernel of engram_serve/kernels.py) against the torch path and `reference_hash`.

Three implementations, one answer: the kernel (CPU production path), the torch ops (CUDA path,
and CPU without a compiler) and the contract's plain loop. The kernel's only non-obvious part is
`n % d` as a multiply-high by magic = floor(2**64 / d) plus one correction; it is checked
directly against Python's `%` on adversarial values, and the negative controls show that a wrong
magic does change the hash ids these tests compare.
"""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.config import EngramConfig
from engram_serve.engram import hashing
from engram_serve.engram.hashing import DEAD, hash_step, hash_step_torch, hash_windows, hash_windows_torch, reference_hash
from engram_serve.engram.layout import build_layout

kernel = kernels.get("hash")
if kernel is None:
    pytest.skip("the C hash kernel is not loaded (`engram-serve env` says why); the torch path serves CPU and is "
                "tested in test_hashing.py", allow_module_level=True)

I64_MAX = 2**63 - 1
GOLDEN = EngramConfig(engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682],
                      engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=32,
                      engram_vocab_size=16000000, engram_compressed_vocab_size=129280, engram_pad_token_id=2)


def with_magic(layout, delta: int):
    """The layout with every division constant shifted by `delta` (a deliberately wrong kernel input)."""
    magic = torch.tensor([[m + delta for m in row] for row in layout.div_magic.tolist()], dtype=torch.uint64)
    return dataclasses.replace(layout, div_magic=magic)


# ---- random layouts and steps ----

@st.composite
def layouts(draw):
    n = draw(st.integers(2, 5))
    heads = draw(st.integers(1, 8))
    layer_ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True))
    # vocab sizes from 2 (modulus 2) through the golden 16M to past 2**32 (moduli above 2**31)
    vocab = draw(st.one_of(st.integers(2, 64), st.integers(2, 20_000_000), st.integers(2**31 - 64, 2**33)))
    cvocab = draw(st.one_of(st.integers(1, 60), st.integers(1, 2**20)))  # sets the multipliers' range
    cfg = EngramConfig(layer_ids, [0] * len(layer_ids), n, heads, 4, vocab, cvocab,
                       draw(st.integers(0, min(cvocab - 1, 100))))
    layout = build_layout(cfg, check_rows=False)
    raw_vocab = draw(st.integers(1, 80))
    tmap = draw(st.lists(st.integers(0, cvocab - 1), min_size=raw_vocab, max_size=raw_vocab))
    return layout, torch.tensor(tmap, dtype=torch.int64)


@st.composite
def steps(draw, raw_vocab: int, depth: int):
    """One step: rows with their history, dead tokens, and padding past qsl[-1].

    Returns input_ids, qsl, history, dead and, for the reference, (seq, dead, start, end) per row."""
    ids, dead, qsl, hist, refs = [], [], [0], [], []
    for _ in range(draw(st.integers(0, 4))):
        length = draw(st.integers(1, 30))
        seq = draw(st.lists(st.integers(0, raw_vocab - 1), min_size=length, max_size=length))
        dmask = draw(st.lists(st.sampled_from([False, False, False, True]), min_size=length, max_size=length))
        start = draw(st.integers(0, length - 1))
        end = draw(st.integers(start + 1, length))
        ids += seq[start:end]
        dead += dmask[start:end]
        qsl.append(qsl[-1] + end - start)
        hist.append([-1 if start - 1 - j < 0 else (DEAD if dmask[start - 1 - j] else seq[start - 1 - j])
                     for j in range(depth)])
        refs.append((seq, dmask, start, end))
    pad = draw(st.integers(0, 3))  # padded slots: never looked up, so even ids outside the map are fine
    ids += draw(st.lists(st.integers(-1, raw_vocab + 5), min_size=pad, max_size=pad))
    dead += [False] * pad
    history = torch.tensor(hist, dtype=torch.int64).view(len(refs), depth)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(qsl), history, torch.tensor(dead, dtype=torch.bool), refs


def reference_rows(refs, layout, tmap, pad_id):
    out = []
    for seq, dmask, start, end in refs:
        out += reference_hash(seq, dmask, layout, tmap.tolist(), pad_id)[start:end]
    return out


# ---- kernel == torch == reference ----

def check_kernel_step(data, magic_delta: int = 0) -> None:
    """The property: on a random layout and step, kernel == torch path == reference.
    `magic_delta` shifts the kernel's division constants (negative controls only)."""
    layout, tmap = data.draw(layouts())
    cfg = layout.config
    ids, qsl, history, dead, refs = data.draw(steps(len(tmap), cfg.history_len))
    pad_id = cfg.engram_pad_token_id
    assert hashing.hash_backend(ids, qsl, history, tmap, layout.moduli, dead) == "kernel"
    got = hash_step(ids, qsl, history, with_magic(layout, magic_delta) if magic_delta else layout, tmap, pad_id,
                    dead=dead)
    want = hash_step_torch(ids, qsl, history, layout, tmap, pad_id, dead=dead)
    assert got.dtype == torch.int64 and got.shape == (len(ids), cfg.num_layers, cfg.num_columns)
    assert torch.equal(got, want)
    real = int(qsl[-1])
    assert got[:real].tolist() == reference_rows(refs, layout, tmap, pad_id)
    if data.draw(st.booleans()):  # no dead mask at all
        assert torch.equal(hash_step(ids, qsl, history, layout, tmap, pad_id),
                           hash_step_torch(ids, qsl, history, layout, tmap, pad_id))


@given(data=st.data())
def test_kernel_step_equals_torch_and_reference(data):
    check_kernel_step(data)


@pytest.mark.parametrize("delta", [1, -2])
def test_negative_control_property_fails_with_wrong_magic(delta):
    """The property above goes red (hypothesis finds a falsifying step) when the division
    constants are off: +1 overestimates a quotient, -2 underestimates it by 2 (only for rolling
    values close to 2**63, so random steps hit it less often)."""
    # no shrinking: stop at the first failure. Over 15 tries each, it came after 8-51 examples (+1)
    # and 6-90 (-2), so missing it in 1000 is ~1e-9 likely.
    @settings(phases=[Phase.generate], database=None, max_examples=1000)
    @given(data=st.data())
    def property_with_wrong_magic(data):
        check_kernel_step(data, magic_delta=delta)

    with pytest.raises(AssertionError):
        property_with_wrong_magic()


@given(data=st.data())
def test_kernel_windows_equal_torch(data):
    """hash_windows on arbitrary compressed windows: blocked entries anywhere, values up to V'."""
    layout, _ = data.draw(layouts())
    cfg = layout.config
    t = data.draw(st.integers(0, 50))
    top = cfg.engram_compressed_vocab_size - 1
    win = data.draw(st.lists(st.lists(st.one_of(st.integers(0, top), st.sampled_from([-1, DEAD, top])),
                                      min_size=cfg.engram_max_ngram_size, max_size=cfg.engram_max_ngram_size),
                             min_size=t, max_size=t))
    window_c = torch.tensor(win, dtype=torch.int64).view(t, cfg.engram_max_ngram_size)
    got = hash_windows(window_c, layout, cfg.engram_pad_token_id)
    assert torch.equal(got, hash_windows_torch(window_c, layout, cfg.engram_pad_token_id))


def test_golden_layout_long_step_equals_torch():
    """The benchmark's shape: 8192 tokens, golden layout, several rows and dead tokens."""
    layout = build_layout(GOLDEN)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 129280, (8192,), generator=gen)
    dead = torch.rand(8192, generator=gen) < 0.01
    qsl = torch.tensor([0, 5, 4000, 4000, 8000])  # an empty row, then 192 padded slots
    history = torch.randint(-2, 129280, (4, 3), generator=gen)
    tmap = torch.randperm(129280, generator=gen)
    got = hash_step(ids, qsl, history, layout, tmap, 7, dead=dead)
    assert torch.equal(got, hash_step_torch(ids, qsl, history, layout, tmap, 7, dead=dead))


# ---- the division itself ----

def adversarial(d: int) -> list[int]:
    """int64 values where a reciprocal division goes wrong first: around multiples of d at the top of
    the 63-bit range, the range's ends, and their negatives (floor modulo, like torch.remainder)."""
    k = I64_MAX // d
    vals = {0, 1, 2, d - 1, d, d + 1, 2 * d - 1, 2 * d, I64_MAX, I64_MAX - 1, 2**62, 2**62 - 1, 2**62 + 1}
    for q in (k, k - 1, k - 2, k // 2, k // 3):
        for delta in (-2, -1, 0, 1, 2):
            vals.add(q * d + delta)
    vals |= {-v for v in list(vals)} | {-2**63, -2**63 + 1}
    return sorted(v for v in vals if -2**63 <= v <= I64_MAX)


MODULI = [2, 3, 5, 7, 251, 65537, 16000057, 16000079, 2**31 - 1, 2**31 + 11, 2**32 - 5, 2**32 + 15, 10**12 + 39,
          2**61 - 1, 2**62 + 135, 2**63 - 25, I64_MAX]


def kernel_remainder(values: list[int], d: int, magic: int) -> list[int]:
    vals = np.array(values, dtype=np.int64)
    out = np.empty_like(vals)
    kernel.remainder(vals, d, magic, out)
    return out.tolist()


@pytest.mark.parametrize("d", MODULI)
def test_magic_remainder_exact_on_adversarial_values(d):
    vals = adversarial(d)
    assert kernel_remainder(vals, d, 2**64 // d) == [v % d for v in vals]


@given(st.lists(st.integers(-2**63, I64_MAX), min_size=1, max_size=64),
       st.one_of(st.integers(2, 1000), st.integers(2, 2**33), st.integers(2, I64_MAX)))
def test_magic_remainder_exact_on_random_values(values, d):
    assert kernel_remainder(values, d, 2**64 // d) == [v % d for v in values]


@pytest.mark.parametrize("d", [m for m in MODULI if m > 2])
def test_negative_control_magic_plus_one_is_caught(d):
    """magic + 1 overestimates the quotient just below a multiple of d near 2**63: wrong remainder."""
    vals = adversarial(d)
    assert kernel_remainder(vals, d, 2**64 // d + 1) != [v % d for v in vals]


@pytest.mark.parametrize("d", [m for m in MODULI if 3 < m < 2**40])
def test_negative_control_magic_minus_two_is_caught(d):
    """magic - 2 underestimates the quotient by 2 at multiples of d near 2**63: one correction step
    is not enough. (magic - 1 is provably still exact on [0, 2**63]: its quotient error stays < 1,
    which the correction absorbs. For d near 2**63, magic is 2 or 3 and magic - 2 can stay exact on
    these values; hash moduli are far below 2**40.)"""
    vals = adversarial(d)
    assert kernel_remainder(vals, d, 2**64 // d - 2) != [v % d for v in vals]
    assert kernel_remainder(vals, d, 2**64 // d - 1) == [v % d for v in vals]


def test_hash_path_on_values_near_int64_max():
    """Through hash_windows itself: with multipliers [1, 1] the rolling value is the window's
    first entry (XOR 0), so each adversarial value goes through the per-token loop's division."""
    for d in MODULI:
        vals = [v for v in adversarial(d) if v >= 0]  # compressed ids are non-negative
        win = np.array([[v, 0] for v in vals], dtype=np.int64)
        out = np.empty((len(vals), 1, 1), dtype=np.int64)
        mult, mod, off = (np.array([[1, 1]]), np.array([[d]]), np.array([[1000]]))
        kernel.hash_windows(win, mult, mod, off, np.array([[2**64 // d]], dtype=np.uint64), 0, out)
        wrap = [(v % d + 1000 + 2**63) % 2**64 - 2**63 for v in vals]  # `+ offset` wraps, as in torch
        assert out[:, 0, 0].tolist() == wrap, d


# ---- the layout's constants, and negative controls through the production hash ----

@given(layouts())
def test_layout_division_magic_is_exact(layout_and_map):
    layout, _ = layout_and_map
    assert layout.div_magic.dtype == torch.uint64
    assert layout.div_magic.tolist() == [[2**64 // d for d in row] for row in layout.moduli.tolist()]


def test_golden_layout_division_magic():
    layout = build_layout(GOLDEN)
    assert layout.div_magic[0, 0].item() == 2**64 // 16000057 == 1152917397338
    assert layout.to("cpu").div_magic is layout.div_magic


def _golden_step(tokens: int = 4096):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 129280, (tokens,), generator=gen)
    return ids, torch.tensor([0, tokens]), torch.full((1, 3), -1), torch.arange(129280)


def test_negative_control_wrong_magic_changes_production_hash():
    """The comparisons above can fail: with the layout's constants off by +1 (or -2) the kernel's
    hash ids differ from the torch path's on an ordinary golden-layout step."""
    layout = build_layout(GOLDEN)
    ids, qsl, hist, tmap = _golden_step()
    want = hash_step_torch(ids, qsl, hist, layout, tmap, 2)
    assert torch.equal(hash_step(ids, qsl, hist, layout, tmap, 2), want)
    for delta in (1, -2):
        bad = hash_step(ids, qsl, hist, with_magic(layout, delta), tmap, 2)
        assert not torch.equal(bad, want), delta
        assert (bad != want).any(dim=(1, 2)).float().mean() > 0.1  # many tokens, not a rare corner


# ---- dispatch and argument checks ----

def test_backend_selection():
    x = torch.zeros(1, dtype=torch.int64)
    assert hashing.hash_backend(x) == "kernel"
    assert hashing.hash_backend(x, torch.zeros(1, device="meta")) == "torch"  # not on the CPU
    with kernels.override("-hash"):
        assert hashing.hash_backend(x) == "torch"
    with kernels.override("hash"):
        assert hashing.hash_backend(x) == "kernel"


@kernels.override("-hash")
def test_switched_off_kernel_is_not_called():
    """With the hash kernel switched off a wrong magic is harmless (the torch path ignores it)."""
    layout = with_magic(build_layout(GOLDEN), 1)
    ids, qsl, hist, tmap = _golden_step(256)
    assert torch.equal(hash_step(ids, qsl, hist, layout, tmap, 2), hash_step_torch(ids, qsl, hist, layout, tmap, 2))


def test_int32_and_noncontiguous_inputs_are_converted():
    layout = build_layout(GOLDEN)
    ids, qsl, hist, tmap = _golden_step(64)
    want = hash_step_torch(ids, qsl, hist, layout, tmap, 2)
    assert torch.equal(hash_step(ids.int(), qsl.int(), hist.int(), layout, tmap.int(), 2), want)
    wide = torch.stack([ids, ids], dim=1)[:, 0]  # stride 2
    assert torch.equal(hash_step(wide, qsl, hist, layout, tmap, 2), want)


def test_token_outside_map_raises_index_error_in_both_paths():
    layout = build_layout(GOLDEN)
    ids, qsl, hist, tmap = _golden_step(16)
    ids[5] = 129280
    with pytest.raises(IndexError, match="129280 in the window of token 5 is outside the token map"):
        hash_step(ids, qsl, hist, layout, tmap, 2)
    with pytest.raises(IndexError):
        hash_step_torch(ids, qsl, hist, layout, tmap, 2)


def _args():
    layout = build_layout(GOLDEN)
    mult, mod, off = (t.numpy() for t in (layout.multipliers, layout.moduli, layout.offsets))
    return np.zeros((3, 4), dtype=np.int64), mult, mod, off, layout.div_magic.numpy(), np.empty((3, 2, 24), np.int64)


def test_kernel_rejects_bad_arrays_with_clear_messages():
    win, mult, mod, off, magic, out = _args()
    kernel.hash_windows(win, mult, mod, off, magic, 2, out)  # the good call
    cases = [
        ((win.astype(np.int32), mult, mod, off, magic, 2, out), r"window_c must be a C-contiguous int64 .* wrong dtype"),
        ((np.zeros((4, 3), np.int64).T, mult, mod, off, magic, 2, out), r"window_c .*\(not C-contiguous\)"),
        ((win, mult, mod, off, magic.astype(np.int64), 2, out), r"magic must be a C-contiguous uint64"),
        ((win, mult, mod, off, magic, 2, out[:2]), r"out has shape \[2, 2, 24\], expected \[T, L, C\] = \[3, 2, 24\]"),
        ((win, mult, mod[:, :23].copy(), off, magic, 2, out), r"moduli.shape\[1\] = 23 is not a multiple of N-1 = 3"),
        ((np.zeros((3, 3), np.int64), mult, mod, off, magic, 2, out), r"multipliers.shape\[1\] \(N\) is 4, expected 3"),
        ((win, mult, np.ones_like(mod), off, magic, 2, out), r"moduli\[0, 0\] = 1; every modulus must be >= 2"),
        ((win, mult, mod, off, magic, 2, [0]), r"out must be a writable int64 array"),
    ]
    ro = out.copy()
    ro.flags.writeable = False
    cases.append(((win, mult, mod, off, magic, 2, ro), r"out must be a writable int64 array"))
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            kernel.hash_windows(*args)


def test_kernel_step_rejects_unsorted_qsl_and_bad_dead_mask():
    layout = build_layout(GOLDEN)
    ids, _, hist, tmap = _golden_step(8)
    consts = (layout.multipliers.numpy(), layout.moduli.numpy(), layout.offsets.numpy(), layout.div_magic.numpy())
    out = np.empty((8, 2, 24), np.int64)
    with pytest.raises(ValueError, match=r"qsl must be non-decreasing, but qsl\[2\] = 3 < qsl\[1\] = 5"):
        kernel.hash_step(ids.numpy(), np.array([0, 5, 3]), hist.numpy(), None, tmap.numpy(), *consts, 2, out)
    with pytest.raises(ValueError, match=r"dead.shape\[0\] is 7, expected 8"):
        kernel.hash_step(ids.numpy(), np.array([0, 8]), hist.numpy(), np.zeros(7, bool), tmap.numpy(), *consts, 2, out)
    with pytest.raises(ValueError, match=r"dead must be a C-contiguous bool"):
        kernel.hash_step(ids.numpy(), np.array([0, 8]), hist.numpy(), np.zeros(8, np.int64), tmap.numpy(), *consts,
                         2, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the torch path on the device")
def test_cuda_torch_path_equals_cpu_kernel():
    layout = build_layout(GOLDEN)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 129280, (8192,), generator=gen)
    dead = torch.rand(8192, generator=gen) < 0.01
    qsl, hist, tmap = torch.tensor([0, 3000, 8000]), torch.randint(-2, 129280, (2, 3), generator=gen), torch.arange(129280)
    cpu = hash_step(ids, qsl, hist, layout, tmap, 2, dead=dead)
    dev = hash_step(ids.cuda(), qsl.cuda(), hist.cuda(), layout.to("cuda"), tmap.cuda(), 2, dead=dead.cuda())
    assert dev.device.type == "cuda" and torch.equal(dev.cpu(), cpu)

