"""Token-wise building blocks of the V4.1 forward (model/layers.py, model/deepseek_v41.py, engram/layer.py)
under the row rules of model/exactness.py: each row's bits are independent of its batch mates; the MoE
(sqrt-softplus scores, a bias that only chooses, a shared expert) matches a plain per-token loop; the
interleaved RoPE is the textbook rotation; the stacked experts load from and save to the checkpoint's
names. (The linear kernel's own tests: tests/kernels/test_linear_kernel.py.)"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.config import ModelConfig
from engram_serve.engram.layer import EngramGate
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model import exactness, layers, ops, products
from engram_serve.model.deepseek_v41 import DeepseekV41, MoE, RopeTable, run_stages
from engram_serve.model.loader import model_state_from_official
from engram_serve.model.writer import Quant, official_tensors
from fp8_tables import fp8_weight
from v41_fixtures import small_v41_config


def _cfg(**over) -> ModelConfig:
    return ModelConfig.from_dict(small_v41_config(hidden_size=32, moe_intermediate_size=48, **over))


def _init(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _moe(num_experts=4, top_k=2, limit=10.0):
    return _init(MoE(_cfg(n_routed_experts=num_experts, num_experts_per_tok=top_k, swiglu_limit=limit)))


def _run_moe(moe, x):
    return run_stages(moe.stages(x, ops.choose(x, *moe.parameters())))


def _layout_moe(moe):
    """The serving layout of an MoE's weights (input-major, as DeepseekV41.matmul_params lists them)."""
    for name in ("w13", "w2"):
        getattr(moe, name).data = exactness.in_major(getattr(moe, name).data)
    return layers.layout_weights_(moe)


def reference_moe(moe, x):
    """A plain float64 loop: per token, sqrt(softplus) scores; the experts chosen by score + bias (ties to the
    lower id), weighed by their scores (renormalised for k > 1) times the routed scale, added in ascending
    expert order; then the shared expert. Experts: silu(min(g, L)) * clamp(u, -L, L), then w2."""
    cfg, inter = moe.cfg, moe.inter
    lim = cfg.swiglu_limit

    def ffn(xt, w1, w3, w2):
        g, u = xt @ w1.T, xt @ w3.T
        if lim > 0:
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        return (F.silu(g) * u) @ w2.T
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = moe.w13.double(), moe.w2.double()
    sh = moe.shared_experts
    for t in range(x.shape[0]):
        xt = x[t].double()
        score = torch.sqrt(F.softplus(xt @ moe.gate.weight.double().T))
        choose = (score + moe.gate.bias.double()).tolist()
        ids = sorted(range(len(choose)), key=lambda e: (-choose[e], e))[:cfg.num_experts_per_tok]
        w = score[ids]
        if cfg.norm_topk_prob and len(ids) > 1:
            w = w / w.sum()
        for e, we in sorted(zip(ids, (w * cfg.routed_scaling_factor).tolist())):
            out[t] += we * ffn(xt, w13[e, :inter], w13[e, inter:], w2[e])
        out[t] += ffn(xt, sh.w1.weight.double(), sh.w3.weight.double(), sh.w2.weight.double())
    return out


@pytest.mark.parametrize("experts,top_k,limit", [(4, 2, 10.0), (8, 2, 0.25), (8, 1, 0.0)])
def test_moe_matches_a_plain_per_token_loop(experts, top_k, limit):
    moe = _moe(experts, top_k, limit)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.randn(experts, generator=torch.Generator().manual_seed(3)) * 0.3)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        biased = _run_moe(moe, x)
        assert torch.allclose(biased.double(), reference_moe(moe, x), atol=1e-5)
        moe.gate.bias.zero_()  # the bias chooses experts: without it some token takes others
        assert not torch.equal(_run_moe(moe, x), biased)
        assert torch.allclose(_run_moe(moe, x).double(), reference_moe(moe, x), atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 24), st.data(), st.booleans())
def test_every_row_is_independent_of_its_batch_mates(n, data, input_major):
    """Bit for bit: a row computed alone, in any sub-batch, equals the same row in the whole batch, with
    the weights in the checkpoint's row-major layout or the serving input-major one."""
    cfg = _cfg(hc_mult=2)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 32, generator=g)
    h = torch.randn(n, 2, 32, generator=g)
    rows = torch.randn(n, 6, 8, generator=g)
    dead = torch.rand(n, generator=g) < 0.2
    pos = torch.randint(0, 5000, (n,), generator=g)
    moe, moe_wide = _moe(4, 2), _moe(8, 3)
    gate = _init(EngramGate(32, 2, 6, 8, 1e-6))
    fn, base, scale = torch.randn(8, 64, generator=g) * 0.1, torch.randn(8, generator=g), torch.rand(3, generator=g)
    if input_major:
        for m in (moe, moe_wide):
            _layout_moe(m)
        layers.layout_weights_(gate)
        fn = exactness.in_major(fn)
    cos, sin = RopeTable(8, 160000.0, {"factor": 4, "original_max_position_embeddings": 64})(pos)
    q = torch.randn(n, 4, 16, generator=g)
    gu, pair = torch.randn(n, 96, generator=g) * 3, torch.randn(2, n, 32, generator=g)
    scores = torch.randn(n, 40, generator=g).masked_fill(torch.rand(n, 40, generator=g) < 0.3, float("-inf"))
    form = ops.choose(h)  # (the C forms where the token kernel is loaded)
    mix = lambda i: torch.cat([t.flatten(1) for t in form.hyper_mix(h[i], fn, base, scale, cfg)], 1)  # noqa: E731
    pre, post, comb = form.hyper_mix(h, fn, base, scale, cfg)
    fns = {
        "moe": lambda i: _run_moe(moe, x[i]), "moe_wide": lambda i: _run_moe(moe_wide, x[i]),
        "gate": lambda i: gate(h[i], rows[i], dead[i], form), "rms_norm": lambda i: form.rms_norm(h[i], 1e-6),
        "rope": lambda i: form.rope(q[i], cos[i], sin[i], False), "rope_inverse": lambda i: form.rope(q[i], cos[i], sin[i], True),
        "hyper_mix": mix, "collapse": lambda i: form.collapse(h[i], pre[i]),
        "expand": lambda i: form.expand(x[i], h[i], post[i], comb[i]),
        "swiglu": lambda i: form.swiglu(gu[i], 48, 1.0), "pool_pair": lambda i: form.pool_pair(pair[0, i], pair[1, i]),
        "topk_first": lambda i: form.topk(scores[i], 5),
    }
    sub = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    with torch.no_grad():
        for name, f in fns.items():
            whole = f(torch.arange(n))
            assert torch.equal(f(sub), whole[sub]), name


def test_rope_is_the_textbook_rotation_of_the_last_pairs_and_its_inverse_undoes_it():
    """Interleaved pairs (x[d0 + 2j], x[d0 + 2j + 1]) of the last rd dims turned by p * f_j, as a complex
    product in float64; the other dims untouched."""
    pos = torch.arange(40)
    x = torch.randn(40, 3, 16)
    table = RopeTable(8, 10000.0, None)
    cos, sin = table(pos)
    got = ops.choose(x).rope(x, cos, sin, False)
    f = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    turn = torch.polar(torch.ones(40, 4, dtype=torch.float64), pos.double()[:, None] * f[None])[:, None, :]
    tail = torch.view_as_complex(x[..., 8:].double().reshape(40, 3, 4, 2).contiguous())
    want = torch.view_as_real(tail * turn).reshape(40, 3, 8)
    assert torch.equal(got[..., :8], x[..., :8])
    assert torch.allclose(got[..., 8:].double(), want, atol=1e-5)
    assert torch.allclose(ops.choose(x).rope(got, cos, sin, inverse=True), x, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(shift=st.integers(1, 7), top=st.integers(1, 5000), seed=st.integers(0, 2 ** 16))
def test_a_shifted_rope_lookup_is_the_row_at_the_position_minus_the_shift_clamped_at_zero(shift, top, seed):
    """The compressed layers' entry rotary: one gather at p from a table moved down by `shift` rows equals the
    table's row max(p - shift, 0), bit for bit, also past the table's first size (it grows)."""
    table = RopeTable(8, 160000.0, {"factor": 4, "original_max_position_embeddings": 64}, rows=64, shifts=(shift,))
    pos = torch.randint(0, top, (33,), generator=torch.Generator().manual_seed(seed))
    got = table(pos, shift=shift)
    want = table((pos - shift).clamp(min=0))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("input_major", [False, True])
def test_input_major_layout_changes_strides_not_values(input_major):
    moe = _moe(4, 2)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    if input_major:
        _layout_moe(moe)
        assert moe.w13.permute(2, 0, 1).is_contiguous() and moe.shared_experts.w2.weight.t().is_contiguous()
    assert all(torch.equal(before[k], v) for k, v in moe.state_dict().items())


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


@pytest.mark.parametrize("out_f", [5, 6, 7, 9, 11])
def test_a_row_gets_the_same_bits_at_any_place_of_its_call(out_f):
    """A router of 5 to 11 experts is such a narrow weight: a row computed alone (at place 0 of its call)
    equals the same row at any place of a bigger call. Negative control: MKL's own product, padded by the
    row rule (or not), differs at some place where `position_dependent` says so on this CPU."""
    g = torch.Generator().manual_seed(out_f)
    w = exactness.in_major(torch.randn(out_f, 16, generator=g))
    x = torch.randn(40, 16, generator=g)
    whole = layers.linear(x, w)
    assert all(torch.equal(layers.linear(x[s:s + n], w), whole[s:s + n]) for s in range(12) for n in (1, 2, 3, 5))
    if not exactness.position_dependent(w) or exactness.small_call_kc(w):
        pytest.skip("MKL gives a row the same bits at every place for this shape on this CPU: nothing to control")
    m = exactness.min_rows(w)
    padded = lambda xs: F.linear(F.pad(xs, (0, 0, 0, max(0, m - xs.shape[0]))), w)[:xs.shape[0]]  # noqa: E731
    full = F.linear(x, w)
    assert any(not torch.equal(padded(x[s:s + n]), full[s:s + n]) for s in range(12) for n in (1, 2, 3, 5))


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


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 300), st.integers(1, 130), st.integers(0, 2**31))
def test_the_direct_sgemm_call_gets_torchs_bits(out_f, in_f, rows, seed):
    """`blas_linear` calls torch's sgemm with the arguments torch's matmul gives it, so any call of it equals
    torch's matmul of the same rows bit for bit (values other than the probe's); `linear` takes it for a weight
    the probe accepts and no fixed-order kernel serves (few outputs, e.g. a 4-expert router). Swapping the
    operands, a call torch does not make, gives other bits (the arguments are what make them equal)."""
    if exactness.sgemm_address() is None or not kernels.loaded("linear"):
        pytest.skip("torch's sgemm or the linear kernel is not available in this build")
    g = torch.Generator().manual_seed(seed)
    w = exactness.in_major(torch.randn(out_f, in_f, generator=g))
    x = torch.randn(rows, in_f, generator=g) * 3
    assert torch.equal(exactness.blas_linear(x, w), F.linear(x, w))
    p = products.plan(w)
    blas = isinstance(p, products.Blas)
    assert not blas or (exactness.small_call_kc(w) is None and not exactness.position_dependent(w))
    if blas and rows >= p.min_rows:  # (a smaller call pads: the row rule)
        assert torch.equal(layers.linear(x, w), F.linear(x, w))
    part = exactness.in_major(torch.randn(out_f + 3, in_f, generator=g))[:out_f]  # its transpose is not contiguous
    assert not exactness.blas_matches(part)  # (the call would read the wrong columns: wrong logits, not last bits)
    assert torch.allclose(layers.linear(x, part), F.linear(x, part), atol=1e-4)  # (the row rule may pad: last bits)


def test_weight_views_taken_by_the_direct_sgemm_call_give_wrong_logits(monkeypatch):
    """The negative control of the stride condition of `blas_matches`, through the model's forward: with every
    weight the fixed-order kernel leaves (here all of them) accepted, the attention's output groups (row slices
    of the input-major wo_a, whose transposes are not one contiguous matrix) are read with the wrong columns,
    and the logits are wrong, not in the last bits."""
    if exactness.sgemm_address() is None or not kernels.loaded("linear"):
        pytest.skip("torch's sgemm or the linear kernel is not available in this build")
    model = layers.layout_weights_(_init(DeepseekV41(_cfg())))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(exactness, "small_call_kc", lambda weight: None)

    def logits():
        monkeypatch.setattr(products, "_plans", {})
        with torch.no_grad():
            return model.forward_dense(ids, None)
    kept = logits()
    monkeypatch.setattr(exactness, "blas_matches", lambda weight: True)
    assert not torch.allclose(logits(), kept, rtol=1e-2, atol=1e-3)  # (last-bit differences are ~1e-8)


def test_stacked_experts_keep_the_checkpoint_names():
    """The model stacks each layer's experts (`ffn.w13` [E, 2I, D]: w1 then w3; `ffn.w2` [E, D, I]); the
    checkpoint keeps one tensor per expert and projection. Written and read back, the state is the same,
    and the unstacked tensors compute the same expert."""
    model = _init(DeepseekV41(_cfg()))
    out = official_tensors(model, None, Quant(linears=False, experts=None, tables=False))
    cfg = model.config
    names = {n for n in out if ".ffn." in n and n.startswith("layers.0.")}
    want = {f"layers.0.ffn.experts.{e}.w{i}.weight" for e in range(cfg.n_routed_experts) for i in (1, 2, 3)}
    want |= {f"layers.0.ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)} | {"layers.0.ffn.gate.weight",
                                                                            "layers.0.ffn.gate.bias"}
    assert names == want and not any(n.endswith(("w13", "w2")) for n in out)
    again = DeepseekV41(cfg)
    again.load_state_dict(model_state_from_official(again, out))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    moe, x = model.layers[0].ffn, torch.randn(5, cfg.hidden_size)
    w1, w3, w2 = (out[f"layers.0.ffn.experts.2.w{i}.weight"] for i in (1, 3, 2))
    with torch.no_grad():
        f = ops.choose(x, *moe.parameters())
        assert torch.allclose(moe.expert(2, x, f), f.swiglu(torch.cat([x @ w1.T, x @ w3.T], 1), moe.inter,
                                                            cfg.swiglu_limit) @ w2.T, atol=1e-6)


@kernels.override("-token")  # the torch form of the gate, whose sigmoid goes through `pointwise`
def test_gate_rows_differ_without_the_pointwise_rule(monkeypatch):
    """Negative control: with `pointwise` no longer padding sigmoid's input to whole vectors (VEC_PAD 1),
    or with every rule off, a row's gate depends on how many rows share the call."""
    g = torch.Generator().manual_seed(20)
    h, rows = torch.randn(64, 2, 32, generator=g), torch.randn(64, 6, 8, generator=g) * 4
    gate = _init(EngramGate(32, 2, 6, 8, 1e-6))

    def mismatches():
        with torch.no_grad():
            f = ops.choose(h, *gate.parameters())
            whole = gate(h, rows, None, f)
            return sum(not torch.equal(gate(h[:k], rows[:k], None, f), whole[:k]) for k in range(1, 65))
    assert mismatches() == 0
    with exactness.batch_invariant(False):
        assert mismatches() > 0
    monkeypatch.setattr(exactness, "VEC_PAD", 1)  # only the elementwise rule off
    assert mismatches() > 0


def test_a_weight_changed_in_place_is_packed_again():
    """`linear` caches the C kernel's packed copy of a weight: an in-place change (load_state_dict, an
    optimizer step) must reach the next call, and a new weight at a freed one's address is not confused."""
    lin = layers.layout_weights_(_init(layers.Linear(32, 96)))
    x = torch.randn(5, 32)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)
        after = lin(x)
        assert not torch.equal(after, before)
        fresh = layers.Linear(32, 96)
        fresh.load_state_dict(lin.state_dict())
        assert torch.equal(after, layers.layout_weights_(fresh)(x))
    for seed in range(20):  # fresh weights, likely at recycled addresses
        w = exactness.in_major(torch.randn(48, 32, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(layers.linear(x, w), F.linear(x, w))


def test_stacked_weights_are_the_weights_of_this_call():
    """`layers.stacked` (one call for weights sharing an input) returns the rows of the weights it is given, for
    fresh weights of one shape made one after the other (whose addresses the allocator would reuse, were the cache
    not keeping its weights alive) and after an in-place change (a new version)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        a, b = torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)
        assert torch.equal(layers.stacked(a, b), torch.cat([a, b]))
    a.mul_(2)
    assert torch.equal(layers.stacked(a, b), torch.cat([a, b]))


TILES = kernels.loaded("linear") and exactness.amx_supported(kernels.get("linear"))


@pytest.mark.skipif(not TILES, reason="the linear kernel's bfloat16 tiles need AMX-BF16")
def test_linear_takes_the_tiles_only_for_bfloat16_weights(monkeypatch):
    """`linear` multiplies a bfloat16 weight on the tiles, every row count alike, and a float weight by the float
    kernel: both within float32's bound of the exact product. Negative control: tiles for a float weight (the exact
    check off) round it to bfloat16, and the product leaves the bound."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 128, generator=g)
    for w, tiled in ((torch.randn(96, 128, generator=g).to(torch.bfloat16).float(), True),
                     (torch.randn(96, 128, generator=g), False)):
        w = exactness.in_major(w)
        assert products.plan(w).is_tiles == tiled
        y = layers.linear(x, w)
        assert ((y.double() - x.double() @ w.double().t()).abs()
                <= 3 * 128 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())).all()
        assert all(torch.equal(layers.linear(x[i:i + 1], w), y[i:i + 1]) for i in range(40))
    monkeypatch.setattr(exactness, "bf16_check", False)
    monkeypatch.setattr(products, "_plans", {})
    assert products.plan(w).is_tiles
    err = (layers.linear(x, w).double() - x.double() @ w.double().t()).abs()
    assert not (err <= 3 * 128 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())).all()


@pytest.mark.skipif(not (kernels.loaded("linear") and exactness.fp8_supported(kernels.get("linear"))),
                    reason="the linear kernel's FP8 panels need AVX-512")
def test_a_one_row_call_of_an_fp8_weight_equals_its_row_in_a_big_call(monkeypatch):
    """`linear` reads an FP8 weight's FP8 panels for one row and its float panels for more: a row's bits are the
    same either way. Negative control: FP8 panels for a weight they only approximate (the exact check off) give
    the one-row call other bits. (The bfloat16 tiles off: on an AMX CPU an FP8 weight takes its tiles instead.)"""
    monkeypatch.setattr(exactness, "amx_supported", lambda kernel: False)
    monkeypatch.setattr(products, "_plans", {})
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    w = exactness.in_major(fp8_weight(96, 128, 128, 1))
    assert isinstance(products.plan(w), products.Fp8Panels)
    assert all(torch.equal(layers.linear(x[i:i + 1], w), layers.linear(x, w)[i:i + 1]) for i in range(9))
    monkeypatch.setattr(exactness, "fp8_check", False)
    v = exactness.in_major(torch.randn(96, 128, generator=torch.Generator().manual_seed(4)))
    assert isinstance(products.plan(v), products.Fp8Panels)
    assert not torch.equal(layers.linear(x[:1], v), layers.linear(x, v)[:1])
