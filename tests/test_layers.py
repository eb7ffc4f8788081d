"""Token-wise layers with fewer operators (model/layers.py, engram/layer.py) under the row rules of
model/exactness.py: each row's bits are independent of its batch mates, the MoE matches a plain
per-token loop, fused weights load from and save to the usual checkpoint names."""
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.engram.layer import EngramGate
from engram_serve.model import exactness, fused, layers
from engram_serve.model.layers import MLP, MoE, apply_rotary, rms_norm, rotary_cos_sin
from engram_serve.model.model import run_stages


def _init(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _moe(num_experts=4, top_k=2):
    return _init(MoE(32, 48, num_experts, top_k))


def _run_moe(moe, x):
    return run_stages(moe.stages(x))


def reference_moe(moe, x):
    """A plain loop: per token, its top-k experts by the router, weights renormalised, expert by expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.router.weight.T, -1)
        w, ids = torch.topk(probs, moe.top_k)
        w = w / w.sum()
        for e, we in sorted(zip(ids.tolist(), w.tolist())):
            gate = x[t] @ moe.w_in[e, 0].T
            up = x[t] @ moe.w_in[e, 1].T
            out[t] += we * ((F.silu(gate) * up) @ moe.w_out[:, e].T)
    return out


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 2)])  # dense path, sorted path
def test_moe_matches_a_plain_per_token_loop(experts, top_k):
    moe = _moe(experts, top_k)
    assert moe.dense == (experts <= layers.DENSE_MOE_MAX_RATIO * top_k)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(_run_moe(moe, x), reference_moe(moe, x), atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 24), st.data(), st.booleans())
def test_every_row_is_independent_of_its_batch_mates(n, data, input_major):
    """Bit for bit: a row computed alone, in any sub-batch, equals the same row in the whole batch, with
    the weights in the checkpoint's row-major layout or the serving input-major one."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 32, generator=g)
    h = torch.randn(n, 2, 32, generator=g)
    rows = torch.randn(n, 6, 8, generator=g)
    dead = torch.rand(n, generator=g) < 0.2
    pos = torch.randint(0, 5000, (n,), generator=g)
    mlp, mlp64, moe, moe_sorted = _init(MLP(32, 48)), _init(MLP(32, 64)), _moe(4, 2), _moe(8, 2)  # 64: silu on strided rows
    gate = _init(EngramGate(32, 2, 6, 8, 1e-6))
    if input_major:
        for m in (mlp, mlp64, moe, moe_sorted, gate):
            layers.layout_weights_(m)
    cos, sin = rotary_cos_sin(pos, 8, 10000.0)
    q = torch.randn(n, 4, 8, generator=g)
    fns = {
        "mlp": lambda i: mlp(x[i]), "mlp64": lambda i: mlp64(x[i]), "moe": lambda i: _run_moe(moe, x[i]), "moe_sorted": lambda i: _run_moe(moe_sorted, x[i]),
        "gate": lambda i: gate(h[i], rows[i], dead[i]), "rms_norm": lambda i: rms_norm(h[i], 1e-6),
        "rotary": lambda i: apply_rotary(q[i], cos[i], sin[i]),
    }
    sub = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    with torch.no_grad():
        for name, fn in fns.items():
            whole = fn(torch.arange(n))
            assert torch.equal(fn(sub), whole[sub]), name


def test_rotary_equals_the_textbook_rotate_half():
    pos = torch.arange(40)
    x = torch.randn(40, 3, 16)
    half = 8
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float32) * 2 / 16)
    ang = pos.float()[:, None] * inv[None]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    want = torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], -1)
    assert torch.equal(apply_rotary(x, *rotary_cos_sin(pos, 16, 10000.0)), want)


@pytest.mark.parametrize("input_major", [False, True])
def test_input_major_layout_changes_strides_not_values(input_major):
    mlp = _init(MLP(32, 48))
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    if input_major:
        layers.layout_weights_(mlp)
        assert mlp.gate_up.view(96, 32).t().is_contiguous() and mlp.down_proj.weight.t().is_contiguous()
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())


@pytest.mark.parametrize("input_major", [False, True])
def test_small_calls_differ_without_the_row_padding_rule(input_major):
    """Negative control for `linear`'s rule: with the rule off a row computed alone differs from the same
    row in a bigger call (MKL's small-call kernels), in either weight layout, so the padding is what
    makes rows batch-invariant."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 128, generator=g)
    w = exactness.in_major(w) if input_major else w
    x = torch.randn(16, 128, generator=g)

    def mismatches():
        whole = layers.linear(x, w)
        return sum(not torch.equal(layers.linear(x[i:i + 1], w), whole[i:i + 1]) for i in range(16))
    assert mismatches() == 0
    with exactness.batch_invariant(False):
        assert mismatches() > 0


def _round_f32(q: Fraction) -> np.float32:
    """q rounded to the nearest float32, ties to even (q non-zero and in range)."""
    y = np.float32(float(q))  # float() rounds to float64 first: y is within one float32 step of the answer
    near = [np.nextafter(y, np.float32(-np.inf)), y, np.nextafter(y, np.float32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))


def plain_rows(x: np.ndarray, wt: np.ndarray, kc: int) -> np.ndarray:
    """y = x @ wt, the matmul kernel's definition as a plain loop in exact rational arithmetic: per output,
    fma chains (one rounding each) over blocks of kc inputs from 0, the blocks' sums added in order."""
    m, k = x.shape
    y = np.zeros((m, wt.shape[1]), np.float32)
    for i in range(m):
        for j in range(wt.shape[1]):
            total = None
            for k0 in range(0, k, kc):
                acc = np.float32(0)
                for t in range(k0, min(k, k0 + kc)):
                    acc = _round_f32(Fraction(float(x[i, t])) * Fraction(float(wt[t, j])) + Fraction(float(acc)))
                total = acc if total is None else _round_f32(Fraction(float(total)) + Fraction(float(acc)))
            y[i, j] = total
    return y


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 14), st.integers(1, 70), st.integers(1, 80), st.sampled_from([0, 1, 2]), st.data())
def test_matmul_kernel_equals_a_plain_exact_loop_whatever_its_row_count(m, k, n, simd, data):
    """The linear kernel's `linear_packed` (portable tile, AVX2, or AVX-512 panel pairs where the CPU has them)
    against its definition computed in exact arithmetic, with strided rows, partial tiles, odd and partial
    panels, and each row alone, through another tile, against the same row in the call (the kernel's
    batch invariance)."""
    kc = data.draw(st.integers(1, k))
    g = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    x = torch.randn(m, k + 3, generator=g)[:, 1:k + 1]  # rows 3 floats apart beyond k
    wt = torch.randn(k, n + 5, generator=g)[:, :n]
    panels = exactness.pack_panels(wt)
    y = exactness.matmul_kernel(x, panels, n, kc, simd)
    assert np.array_equal(y.numpy().view(np.uint32), plain_rows(x.numpy(), wt.numpy(), kc).view(np.uint32))
    for i in range(m):
        assert torch.equal(exactness.matmul_kernel(x[i:i + 1], panels, n, kc, (simd + 1) % 3), y[i:i + 1])


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_wide_matmul_tiles_give_the_exact_bits(m):
    """The wide AVX-512 tiles (8 panels a row, 4 for two rows, where the CPU has AVX-512) and the group
    remainders after them: every level of the kernel against the exact definition, at 9 and 13 panels."""
    g = torch.Generator().manual_seed(m)
    for n in (130, 200):
        x, wt = torch.randn(m, 37, generator=g), torch.randn(37, n, generator=g)
        want = plain_rows(x.numpy(), wt.numpy(), 16).view(np.uint32)
        for simd in (0, 1, 2):
            got = exactness.matmul_kernel(x, exactness.pack_panels(wt), n, 16, simd)
            assert np.array_equal(got.numpy().view(np.uint32), want), (n, simd)


@pytest.mark.parametrize("out_f,in_f", [(384, 128), (128, 512), (4096, 128), (7, 100)])
def test_calls_through_the_matmul_kernel_get_torchs_bits(out_f, in_f):
    """Where the probe accepts the C kernel for a shape (`small_call_kc`), a row computed alone through it
    equals the row in a big call and in torch's matmul of the batch, on values other than the probe's; a
    block size the probe did not pick gives other bits (the accumulation order is what makes them equal)."""
    g = torch.Generator().manual_seed(out_f + in_f)
    w = exactness.in_major(torch.randn(out_f, in_f, generator=g))
    kc = exactness.small_call_kc(w)
    if kc is None:
        pytest.skip(f"the C kernel does not reproduce this CPU's matmul bits for [{out_f}, {in_f}]: small calls pad")
    x = torch.randn(700, in_f, generator=g)
    whole = layers.linear(x, w)
    assert torch.equal(whole, F.linear(x, w))
    assert all(torch.equal(layers.linear(x[i:i + 1], w), whole[i:i + 1]) for i in range(64))
    wrong = kc // 2 + 1
    assert not torch.equal(exactness.matmul_kernel(x, exactness.pack_panels(w.t()), out_f, wrong), whole)


def test_fused_weights_keep_the_checkpoint_names():
    mlp, moe = _init(MLP(32, 48)), _moe(4, 2)
    sd = {**{f"mlp.{k}": v for k, v in mlp.state_dict().items()}, **{f"moe.{k}": v for k, v in moe.state_dict().items()}}
    assert set(sd) == {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "moe.router.weight",
                       "moe.w_gate", "moe.w_up", "moe.w_down"}
    assert sd["moe.w_gate"].shape == (4, 48, 32) and sd["moe.w_down"].shape == (4, 32, 48)
    mlp2, moe2 = MLP(32, 48), MoE(32, 48, 4, 2)
    mlp2.load_state_dict(mlp.state_dict())
    moe2.load_state_dict(moe.state_dict())
    assert torch.equal(mlp2.gate_up, mlp.gate_up) and torch.equal(moe2.w_in, moe.w_in)
    assert torch.equal(moe2.w_out, moe.w_out)
    x = torch.randn(5, 32)
    with torch.no_grad():  # the unfused form of the checkpoint tensors gives the same function
        g, u, d = sd["mlp.gate_proj.weight"], sd["mlp.up_proj.weight"], sd["mlp.down_proj.weight"]
        assert torch.allclose(mlp2(x), (F.silu(x @ g.T) * (x @ u.T)) @ d.T, atol=1e-6)


@kernels.override("-token")  # the torch form of the gate, whose sigmoid goes through `pointwise`
def test_gate_rows_differ_without_the_pointwise_rule(monkeypatch):
    """Negative control: with `pointwise` no longer padding sigmoid's input to whole vectors (VEC_PAD 1),
    or with every rule off, a row's gate depends on how many rows share the call."""
    g = torch.Generator().manual_seed(20)
    h, rows = torch.randn(64, 2, 32, generator=g), torch.randn(64, 6, 8, generator=g) * 4
    gate = _init(EngramGate(32, 2, 6, 8, 1e-6))

    def mismatches():
        with torch.no_grad():
            whole = gate(h, rows)
            return sum(not torch.equal(gate(h[:k], rows[:k]), whole[:k]) for k in range(1, 65))
    assert mismatches() == 0
    with exactness.batch_invariant(False):
        assert mismatches() > 0
    monkeypatch.setattr(exactness, "VEC_PAD", 1)  # only the elementwise rule off
    assert mismatches() > 0


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k,n", [(32, 64), (64, 32), (16, 64)])
def test_measured_bmm_rule_holds_for_other_values(k, n, transposed):
    """`bmm_min_rows` is measured on random probes; on other values, every row count from it on gives
    a row the bits it has in a 300-row call (the rule the attention's query widths rely on)."""
    g = torch.Generator().manual_seed(7)
    m = exactness.bmm_min_rows(k, n, transposed)
    b = torch.randn(1, n, k, generator=g).transpose(1, 2) if transposed else torch.randn(1, k, n, generator=g)
    a = torch.randn(1, 300, k, generator=g)
    full = torch.bmm(a, b)
    assert all(torch.equal(torch.bmm(a[:, :r].contiguous(), b), full[:, :r]) for r in range(m, 80))


def test_a_weight_changed_in_place_is_packed_again():
    """`linear` caches the C kernel's packed copy of a weight: an in-place change (load_state_dict, an
    optimizer step) must reach the next call, and a new weight at a freed one's address is not confused."""
    mlp = layers.layout_weights_(_init(MLP(32, 48)))
    x = torch.randn(5, 32)
    with torch.no_grad():
        before = mlp(x)
        mlp.gate_up.mul_(2)
        after = mlp(x)
        assert not torch.equal(after, before)
        fresh = MLP(32, 48)
        fresh.load_state_dict(mlp.state_dict())
        assert torch.equal(after, layers.layout_weights_(fresh)(x))
    for seed in range(20):  # fresh weights, likely at recycled addresses
        w = exactness.in_major(torch.randn(48, 32, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(layers.linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not kernels.loaded("linear"), reason="the matmul kernel is not loaded (`engram-serve env`)")
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 14), st.sampled_from([16, 32, 48]), st.integers(1, 4), st.booleans(), st.sampled_from([0, 1, 2]),
       st.sampled_from([3.0, 40.0]))
def test_the_fused_swiglu_gives_the_bits_of_the_product_then_silu_mul(m, inter, groups, weighted, simd, scale):
    """`linear_swiglu` (the kernel's SwiGLU epilogue, portable, AVX2 or AVX-512 tile) against the product stored
    and then `fused.silu_mul`, with per-group weights (the dense MoE) or none (the MLP). Scale 40 puts
    many gates beyond exp's clamps (|-g| > 87), where e^-g is 0 or inf."""
    g = torch.Generator().manual_seed(m * 1000 + inter * 10 + groups)
    w = exactness.in_major(torch.randn(groups * 2 * inter, 40, generator=g))
    x = torch.randn(m, 40, generator=g) * scale
    weights = torch.rand(m, groups, generator=g) if weighted else None
    want = fused.silu_mul(layers.linear(x, w).view(m, groups, 2 * inter), inter, weights).view(m, groups * inter)
    kc = exactness.small_call_kc(w) or 40
    got = exactness.matmul_kernel(x, exactness.pack_panels(w.t()), w.shape[0], kc, simd, inter, weights)
    if exactness.small_call_kc(w):
        assert torch.equal(layers.linear_swiglu(x, w, inter, weights), want)
    y = exactness.matmul_kernel(x, exactness.pack_panels(w.t()), w.shape[0], kc, simd)
    want = fused.silu_mul(y.view(m, groups, 2 * inter), inter, weights).view(m, groups * inter)
    assert torch.equal(got, want)
