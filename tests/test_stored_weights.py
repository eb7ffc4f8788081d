"""MXFP4 routed experts kept as stored (model/weights.py `Mxfp4Experts`): after load the MoE holds no
float32 expert weights, only views of the checkpoint's read-only memory map (0.53 bytes a weight); its logits equal those of the same checkpoint
with the experts dequantized to float32 bit for bit; and the float64 reference (tests/reference/reference_v41.py)
agrees within 1e-4, which a single E2M1 code decoded wrong turns red (the negative control)."""
from __future__ import annotations

import pytest
import torch

from engram_serve import kernels
from engram_serve.engram.quantized import Fp8Table, dequantize_rows
from engram_serve.model import exactness
from engram_serve.model.deepseek_v41 import MoE
from engram_serve.model.layers import Linear
from engram_serve.model.checkpoint import CheckpointFiles
from engram_serve.model.loader import load_model
from engram_serve.model.weights import StoredWeight, HoldsStored, Mxfp4Experts
from engram_serve.model.writer import FP8_LINEARS, SMALL_TEXT_CONFIG, Quant, official_tensors, random_v41_checkpoint, with_engram_rows
from reference_v41 import reference_forward
from v41_fixtures import engram_hash_ids, tiny_token_map

TOL = 1e-4
PROMPT = [(7 * i + 3) % 4000 + 10 for i in range(12)]

pytestmark = pytest.mark.skipif(not kernels.loaded("linear"), reason="the linear kernel is not built")


@pytest.fixture(scope="module", params=[False, True], ids=["float32-matrices", "bf16-matrices"])
def ckpt(request, tmp_path_factory):
    """FP8 linears and MXFP4 experts; the other matrices float32 or (as published) BF16"""
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=5, quant=Quant(bf16=request.param),
                                 shard_bytes=256 << 10)


def moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def float_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if t.is_floating_point())


def takes_panels(moe: MoE) -> bool:
    """Whether this CPU's plan for the experts' float weights is the float panels (else the MoE dequantizes)."""
    return moe.stored.kcs() is not None


def logprobs(model, weights: dict, ids: list[int]) -> torch.Tensor:
    cfg = with_engram_rows(dict(SMALL_TEXT_CONFIG))
    hashes = engram_hash_ids(cfg, ids, token_map=tiny_token_map())
    rows = [weights[f"layers.{l}.engram.embed.weight"][hashes[l]][None] for l in cfg["engram_layer_ids"]]
    with torch.no_grad():
        return torch.log_softmax(model.forward_dense(torch.tensor([ids]), rows or None)[0].double(), -1)


@pytest.fixture(scope="module")
def reference_weights(ckpt):
    """The checkpoint's tensors dequantized (the float path of the loader), under official names."""
    lm = load_model(ckpt, pin_tables=False)
    w = official_tensors(lm.model, None, Quant(linears=False, experts=None, tables=False))
    for lid, t in zip(lm.tables.layer_ids, lm.tables.tables):
        w[f"layers.{lid}.engram.embed.weight"] = (dequantize_rows(t.weight, t.scale, torch.empty(t.weight.shape))
                                                  if isinstance(t, Fp8Table) else t.float())
    return w


def test_moe_holds_no_float_expert_weights_after_load(ckpt):
    model = load_model(ckpt, pin_tables=False).model
    cfg = SMALL_TEXT_CONFIG
    e, d, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    for m in moes(model):
        assert isinstance(m.stored, Mxfp4Experts)
        names = [n for n, _ in m.named_parameters()]
        assert not any(n in ("w13", "w2") for n in names), names
        assert float_bytes(m) == float_bytes(m.gate) + float_bytes(m.shared_experts)  # the router and shared expert
        stored = e * 3 * i * d * (1 / 2 + 1 / 32)  # E2M1 nibbles and E8M0 scales
        assert stored <= m.stored.nbytes() <= 1.1 * stored


def stored_linears(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.stored is not None}


def test_fp8_and_bf16_linears_are_held_as_stored(ckpt):
    model = load_model(ckpt, pin_tables=False).model
    held, files = stored_linears(model), CheckpointFiles.open(ckpt)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
    stored = {n for n in linears & set(files.keys()) if files.info(n)[0] in ("F8_E4M3", "BF16")}
    assert {n for n in files.keys() if FP8_LINEARS.fullmatch(n)} <= stored
    assert {f"{n}.weight" for n in held} == stored  # every FP8 or BF16 linear of the checkpoint
    for m in held.values():
        assert isinstance(m.stored, StoredWeight) and "weight" not in m._parameters  # (the router keeps its bias)


def test_stored_weights_give_the_float_paths_logits_bit_for_bit(ckpt, reference_weights):
    stored = load_model(ckpt, pin_tables=False).model
    if not takes_panels(moes(stored)[0]):
        pytest.skip("this CPU's plan for the experts' shape is not the float panels: the MoE dequantizes")
    dense = load_model(ckpt, pin_tables=False).model
    for m in dense.modules():
        if isinstance(m, HoldsStored):
            m.dense_()
            assert m.stored is None
    held = [m for m in stored.modules() if isinstance(m, HoldsStored) and m.stored is not None]
    got = logprobs(stored, reference_weights, PROMPT)
    assert all(m.stored is not None for m in held)  # no forward read them as floats
    assert all(m._panels[1] is not None for m in moes(stored))  # the experts ran on the stored bytes
    in_place = [m.stored for m in stored_linears(stored).values() if m.stored.kc()]
    assert exactness.STORED_FP8 in {s.fmt for s in in_place}
    assert all(w is not None for s in in_place for w in s.words)  # the linears ran panel-major
    assert float_bytes(stored) < float_bytes(dense) - sum(m.stored.nbytes() for m in moes(stored))
    want = logprobs(dense, reference_weights, PROMPT)
    assert torch.equal(got, want)


def test_where_the_plan_is_not_the_float_panels_the_moe_dequantizes_once(ckpt, reference_weights, monkeypatch):
    """Tiles, BLAS, row-wise or padded torch (e.g. a CPU where no kc reproduces MKL for the experts' shape): the MoE
    makes its float Parameters once and runs today's product, with the same logits."""
    want = logprobs(load_model(ckpt, pin_tables=False).model, reference_weights, PROMPT)
    monkeypatch.setattr(MoE, "_stored_panels", lambda self: None)
    model = load_model(ckpt, pin_tables=False).model
    got = logprobs(model, reference_weights, PROMPT)
    assert all(m.stored is None and m.w13.dtype == torch.float32 for m in moes(model))
    assert torch.equal(got, want)


def _decode_one_code_wrong(experts: Mxfp4Experts, code: int = 1, wrong: int = 2) -> None:
    """Every E2M1 nibble `code` (0.5) of the stored experts becomes `wrong` (1.0): the decode of one code wrong (in
    a copy: the memory map is read-only)."""
    def wrong_codes(t):
        lo, hi = t & 15, t >> 4
        lo[lo == code], hi[hi == code] = wrong, wrong
        return lo | (hi << 4)
    for w in (experts.w1, experts.w3, experts.w2):
        w[:] = [(wrong_codes(c), s) for c, s in w]
    repacked, experts.words, experts._addresses = experts.words is not None, None, None
    if repacked:  # the kernel reads the codes' panel-major words: made again from the wrong codes
        assert experts.panel_major()


def test_experts_beyond_half_the_free_memory_stay_in_the_map(ckpt, reference_weights, monkeypatch):
    """The rule of `weights.experts_fit`: experts that fit are repacked panel-major into RAM, others are read where
    the map has them (a checkpoint larger than RAM); both give the same logits, bit for bit."""
    from engram_serve.model import loader
    fit = load_model(ckpt, pin_tables=False).model
    monkeypatch.setattr(loader, "meminfo", lambda key: 0)  # no memory free: every expert stays mapped
    mapped = load_model(ckpt, pin_tables=False).model
    if not takes_panels(moes(fit)[0]):
        pytest.skip("this CPU's plan for the experts' shape is not the float panels: the MoE dequantizes")
    assert all(m.stored.words is not None for m in moes(fit))
    assert all(m.stored.words is None for m in moes(mapped))
    for a, b in zip(moes(fit), moes(mapped)):  # the kernel's addresses: the words in RAM, the codes in the map
        assert not mapping_of(int(a.stored.addresses()[0][0]))[1].endswith(".safetensors")
        assert mapping_of(int(b.stored.addresses()[0][0]))[1].endswith(".safetensors")
    assert torch.equal(logprobs(fit, reference_weights, PROMPT), logprobs(mapped, reference_weights, PROMPT))


def test_experts_read_ahead_give_plain_pagings_logits(ckpt, reference_weights, monkeypatch):
    """Experts read in place from the map have each step's read ahead (`Mxfp4Experts.prefetch`: moe_experts' madvise
    WILLNEED of the chosen experts' pages); from cold pages (dropped from the map and the page cache), with it and
    without it (plain paging), the same logits, bit for bit."""
    import os
    from engram_serve.model import loader
    from engram_serve.model.checkpoint import drop_pages
    monkeypatch.setattr(loader, "meminfo", lambda key: 0)  # no memory free: every expert stays mapped
    model = load_model(ckpt, pin_tables=False).model
    if moes(model)[0]._stored_panels() is None:
        pytest.skip("this CPU's plan for the experts' shape is neither the float panels nor the tiles: it dequantizes")

    def cold(prefetch: bool) -> torch.Tensor:
        for m in moes(model):
            m.stored.prefetch = prefetch
            for t in (t for w in (m.stored.w1, m.stored.w3, m.stored.w2) for pair in w for t in pair):
                drop_pages(t)
        for shard in ckpt.glob("*.safetensors"):
            fd = os.open(shard, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        got = logprobs(model, reference_weights, PROMPT)
        assert all(m._panels[1].prefetch == prefetch for m in moes(model))  # the experts' kernel call read ahead
        return got

    assert torch.equal(cold(True), cold(False))


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds `address` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], fields[-1] if len(fields) > 5 else ""
    raise LookupError(hex(address))


def test_the_stored_weights_are_views_of_the_read_only_map(ckpt):
    """No copy: every stored tensor lies in a read-only mapping of its shard, so a page is read from disk when a
    step first touches it (and the page cache may drop it again)."""
    model = load_model(ckpt, pin_tables=False).model
    experts = [t for m in moes(model) for w in (m.stored.w1, m.stored.w3, m.stored.w2) for pair in w for t in pair]
    linears = [t for m in stored_linears(model).values() for d, s, _ in m.stored.parts for t in (d, s) if t is not None]
    for t in experts + linears:
        perms, path = mapping_of(t.data_ptr())
        assert perms.startswith("r-") and path.endswith(".safetensors"), (perms, path)


def test_reference_agrees_and_one_wrong_e2m1_code_turns_it_red(ckpt, reference_weights):
    cfg = with_engram_rows(dict(SMALL_TEXT_CONFIG))
    ref = reference_forward(cfg, reference_weights, PROMPT, engram_hash_ids(cfg, PROMPT, token_map=tiny_token_map()))
    clean = [p for p in range(len(PROMPT)) if not ref.tainted(p)]
    assert len(clean) > len(PROMPT) // 2

    def diff(wrong: bool) -> float:
        model = load_model(ckpt, pin_tables=False).model
        if wrong:  # before the first forward: whichever product this CPU takes reads the wrong code
            for m in moes(model):
                _decode_one_code_wrong(m.stored)
        got = logprobs(model, reference_weights, PROMPT)
        return max((got[p] - ref.logprobs[p]).abs().max().item() for p in clean)

    assert diff(False) <= TOL
    assert diff(True) > TOL


def test_bf16_words_read_out_of_their_tiles_order_turn_the_reference_red(ckpt, reference_weights, monkeypatch):
    """Negative control of BF16 words in the tiles' order (an AMX CPU, BF16 matrices): the same bytes multiplied as
    plain panel-major words (TILED left out of their calls) take the logits far from the reference, which the
    tiled calls meet (the test above)."""
    cfg = with_engram_rows(dict(SMALL_TEXT_CONFIG))
    model = load_model(ckpt, pin_tables=False).model
    bf16 = [m.stored for m in stored_linears(model).values() if m.stored.fmt == exactness.STORED_BF16]
    tiled = [s for s in bf16 if s.on_tiles() and exactness.tiled_words(s.fmt, s.shape[1]) and None not in s.words]
    if not tiled:
        pytest.skip("no BF16 words in the tiles' order here (they need an AMX CPU and BF16 matrices)")
    ref = reference_forward(cfg, reference_weights, PROMPT, engram_hash_ids(cfg, PROMPT, token_map=tiny_token_map()))
    clean = [p for p in range(len(PROMPT)) if not ref.tainted(p)]
    tiled_words = exactness.tiled_words
    monkeypatch.setattr(exactness, "tiled_words", lambda fmt, *a: fmt != exactness.STORED_BF16 and tiled_words(fmt, *a))
    got = logprobs(model, reference_weights, PROMPT)
    assert max((got[p] - ref.logprobs[p]).abs().max().item() for p in clean) > TOL
