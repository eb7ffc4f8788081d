"""The llamacpp suite of `bench peers`: the same-size qwen3moe GGUF (engram_serve/bench/llama_gguf.py) reads
back with the names, types and shapes llama.cpp's qwen3moe loader asks for; its MXFP4 blocks hold the values
that were packed (decoded by a float64 loop written from ggml-common.h's block_mxfp4); and the suite says what
is missing, and how to get it, where llama-bench or the gguf package is absent."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from engram_serve.bench import llama_bench as lb
from engram_serve.bench import llama_gguf as lg
from engram_serve.bench.peers import run_llamacpp
from engram_serve.engram.quantized import dequantize_fp4, quantize_fp4

TINY = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=10000.0,
            rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)


def e2m1(code: int) -> float:
    """An E2M1 code's value from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man))


def decode_block_mxfp4(row: bytes) -> list[float]:
    """One ggml row of block_mxfp4 -> its values, float64, by a plain loop: per 17 bytes the E8M0 exponent e,
    then 16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31, each x 2^(e - 127)."""
    out = []
    for b in range(0, len(row), 17):
        scale = 2.0 ** (row[b] - 127)
        qs = row[b + 1:b + 17]
        out += [e2m1(q & 0x0F) * scale for q in qs] + [e2m1(q >> 4) * scale for q in qs]
    return out


def test_mxfp4_repack_holds_the_packed_values():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 7.0  # a block whose scale is 2^1
    packed, scale = quantize_fp4(x)
    want = dequantize_fp4(packed, scale).double().numpy()  # the values the official form holds
    blocks = lg.ggml_mxfp4(packed.numpy(), scale.view(torch.uint8).numpy())
    assert blocks.shape == (6, 3 * 17) and blocks.dtype == np.uint8
    got = np.array([decode_block_mxfp4(bytes(r)) for r in blocks])
    np.testing.assert_array_equal(got, want)
    err = np.abs(want - x.double().numpy()).reshape(6, 3, 32).max(-1)
    amax = x.double().abs().numpy().reshape(6, 3, 32).max(-1)
    assert (err <= amax / 3).all()  # quantized, not garbled: half the widest E2M1 gap (2 x 2^k, 2^k < max / 3)
    # negative control: the official bytes taken as ggml blocks as they are (no repack) hold other values
    raw = np.concatenate([scale.view(torch.uint8).numpy()[:, :, None],
                          packed.view(torch.uint8).numpy().reshape(6, 3, 16)], -1).reshape(6, -1)
    assert not np.array_equal(np.array([decode_block_mxfp4(bytes(r)) for r in raw]), want)


def test_mxfp4_repack_refuses_mismatched_scales():
    with pytest.raises(ValueError, match="not"):
        lg.ggml_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf", reason=f"gguf is missing: {lg.INSTALL}")
    return lg.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TINY, seed=3)


def test_the_gguf_reads_back_with_qwen3moe_names_types_and_shapes(tiny_gguf):
    import gguf
    r = gguf.GGUFReader(str(tiny_gguf))
    T = gguf.GGMLQuantizationType
    got = {t.name: (t.tensor_type, [int(n) for n in t.shape]) for t in r.tensors}  # shapes in ggml order
    d, v, e, f, q, kv, hd = 64, 4096, 4, 32, 128, 32, 32
    want = {"token_embd.weight": (T.Q8_0, [d, v]), "output_norm.weight": (T.F32, [d]), "output.weight": (T.Q8_0, [d, v])}
    for i in range(2):
        want.update({f"blk.{i}.{k}": w for k, w in {
            "attn_norm.weight": (T.F32, [d]), "ffn_norm.weight": (T.F32, [d]),
            "attn_q_norm.weight": (T.F32, [hd]), "attn_k_norm.weight": (T.F32, [hd]),
            "attn_q.weight": (T.Q8_0, [d, q]), "attn_k.weight": (T.Q8_0, [d, kv]), "attn_v.weight": (T.Q8_0, [d, kv]),
            "attn_output.weight": (T.Q8_0, [q, d]), "ffn_gate_inp.weight": (T.F32, [d, e]),
            "ffn_gate_exps.weight": (T.MXFP4, [d, f, e]), "ffn_up_exps.weight": (T.MXFP4, [d, f, e]),
            "ffn_down_exps.weight": (T.MXFP4, [f, d, e])}.items()})
    assert got == want
    fields = {k: r.fields[k].contents() for k in r.fields if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "qwen3moe"
    assert (fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"]) == (4, 2)
    assert (fields["qwen3moe.attention.head_count"], fields["qwen3moe.attention.head_count_kv"]) == (4, 1)
    assert fields["qwen3moe.attention.key_length"] == hd and fields["qwen3moe.expert_feed_forward_length"] == f
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == v
    assert len(fields["tokenizer.ggml.merges"]) > 0 and fields["tokenizer.ggml.token_type"][0] == 3  # <|endoftext|>


def test_the_gguf_experts_decode_alike_in_gguf_and_the_float64_loop(tiny_gguf):
    """The loop above and the gguf package's decoder read the file's expert bytes alike (so the loop reads
    ggml's format), and the values are what random experts of std 0.02 quantize to."""
    import gguf
    t = next(t for t in gguf.GGUFReader(str(tiny_gguf)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    rows = np.asarray(t.data).reshape(-1, 17)  # [E * 64 rows, one block of 32 values]
    loop = np.array([decode_block_mxfp4(bytes(r)) for r in rows])
    theirs = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.MXFP4).reshape(loop.shape)
    np.testing.assert_array_equal(loop, theirs)
    assert np.isfinite(loop).all() and 0.01 < loop.std() < 0.03


def test_active_bytes_count_k_experts_and_one_embedding_row():
    sizes = {"embed.weight": 4096 * 10, "layers.0.ffn.experts.3.w1.weight": 800, "layers.0.attn.wq.weight": 7}
    assert lg.active_bytes(sizes, ".ffn.experts.", "embed.weight", 4096, 2, 8) == 10 + 200 + 7


def _args(tmp_path, **kw) -> argparse.Namespace:
    return argparse.Namespace(llama_bench=str(tmp_path / "no-llama-bench"), cache_dir=str(tmp_path), rounds=1,
                              thread_counts=[1], workloads="prefill", prompt=8, new=None, **kw)


def test_the_suite_skips_with_the_build_line_without_llama_bench(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason=f"gguf is missing: {lg.INSTALL}")
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    rows = run_llamacpp(_args(tmp_path))
    assert rows == [{"suite": "llamacpp", "skipped": f"no llama-bench at {tmp_path / 'no-llama-bench'}: {lb.BUILD_HINT}"}]
    assert "scripts/build_llama_cpp.sh" in lb.BUILD_HINT
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_suite_skips_with_the_install_line_without_gguf(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert run_llamacpp(_args(tmp_path)) == [{"suite": "llamacpp", "skipped": f"the gguf package is missing: {lg.INSTALL}"}]


def test_the_binary_comes_from_the_flag_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_BENCH", "/from/env")
    assert str(lb.binary(_args(tmp_path))) == str(tmp_path / "no-llama-bench")
    assert str(lb.binary(argparse.Namespace(llama_bench=None))) == "/from/env"
    monkeypatch.delenv("LLAMA_BENCH")
    assert str(lb.binary(argparse.Namespace(llama_bench=None))) == lb.DEFAULT_BINARY


def test_a_llama_bench_run_is_parsed_from_its_json(tmp_path):
    """A stand-in llama-bench that prints what the real one prints for -p 8 -n 4 -d 0,8 -o json."""
    import json
    import os
    import stat
    import subprocess
    tests = [(8, 0, 0, 2e9), (0, 4, 0, 5e9), (8, 0, 8, 3e9), (0, 4, 8, 7e9)]
    fake = tmp_path / "llama-bench"
    out = json.dumps([{"n_prompt": p, "n_gen": n, "n_depth": d, "samples_ns": [ns]} for p, n, d, ns in tests])
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{out}\nEOF\nsleep 0.3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    times, info = lb.LlamaBench(fake, tmp_path / "m.gguf", 2, 8, 4).call()
    assert times == {"prefill": 2.0, "decode": 7.0}
    assert 0 < info["max_rss_mib"] < 64  # its own peak (a shell's few MiB), not this process's
    # negative control: wait4's ru_maxrss of the same child carries this process's peak over
    proc = subprocess.Popen([str(fake)], stdout=subprocess.DEVNULL)
    assert os.wait4(proc.pid, 0)[2].ru_maxrss / 1024 > 64
    assert lb.LlamaBench(fake, tmp_path / "m.gguf", 2, 8, 4).command()[-8:] == ["-n", "4", "-d", "0,8", "-r", "1", "-o", "json"]


def test_bench_peers_runs_the_suite_from_the_command_line(tmp_path, capsys, monkeypatch):
    import json

    from engram_serve.cli import main
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    assert main(["bench", "peers", "--suite", "llamacpp", "--llama-bench", str(tmp_path / "none"),
                 "--thread-counts", "1,2", "--cache-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["suite"] == "llamacpp" and "skipped" in rows[0]
