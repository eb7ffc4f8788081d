"""The C-kernel registry (engram_serve/kernels.py): the ENGRAM_SERVE_KERNELS syntax and its errors, an
override that really switches every user of a kernel to its torch path, `engram-serve env` in a process
without kernels (switched off, or not built), and the start-up line the engine factory logs and `serve`
prints."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from serve_process import start_serve

from engram_serve import kernels
from engram_serve.engine.factory import build_engine
from engram_serve.engram import hashing, staging
from engram_serve.errors import ConfigError
from engram_serve.model import exactness, ops, ops_c, ops_torch

ALL = set(kernels.MODULES)


def env_command(*args: str, kernels_env: str | None = None, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`engram-serve env ARGS` in a fresh process; `hide`: kernels made unimportable there, as in a build
    without a C compiler (their modules are absent from the import system)."""
    hidden = "".join(f"sys.modules[{kernels.MODULES[name]!r}] = None; " for name in hide)
    code = f"import sys; {hidden}from engram_serve.cli import main; sys.exit(main(['env', *{list(args)!r}]))"
    env = {k: v for k, v in os.environ.items() if k != kernels.ENV}
    if kernels_env is not None:
        env[kernels.ENV] = kernels_env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("spec,want", [
    (None, ALL), ("", ALL), ("all", ALL), (" all ", ALL), ("none", set()),
    ("hash,gather", {"hash", "gather"}), ("linear", {"linear"}),
    ("-linear,-token", ALL - {"linear", "token"}), ("-token", ALL - {"token"}),
])
def test_spec_names_the_kernels_to_load(spec, want):
    assert kernels.parse(spec) == want


@pytest.mark.parametrize("spec,needle", [
    ("fast", r"ENGRAM_SERVE_KERNELS='fast': unknown kernel name\(s\) \['fast'\]"),
    ("hash,-gather", r"ENGRAM_SERVE_KERNELS='hash,-gather': names with and without '-' mixed"),
    ("hash,,gather", r"ENGRAM_SERVE_KERNELS='hash,,gather': unknown kernel name\(s\) \[''\]"),
    ("-", r"ENGRAM_SERVE_KERNELS='-': unknown"),
])
def test_a_bad_spec_names_the_variable_and_its_value(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        kernels.parse(spec)


@pytest.mark.skipif(not kernels.loaded(*kernels.MODULES), reason="needs every C kernel (`engram-serve env`)")
def test_override_switches_every_user_to_its_torch_path_and_back():
    x, w = torch.randn(3, 32), exactness.in_major(torch.randn(48, 32))
    ids, qsl, hist = torch.tensor([5, 6, 7]), torch.tensor([0, 3]), torch.full((1, 3), -1)

    def paths() -> dict[str, bool]:
        return {"token": ops.choose(x) is ops_c, "linear": kernels.simd_level() is not None,
                "hash": hashing.hash_backend(ids, qsl, hist) == "kernel",
                "gather": staging.gather_backend(x, torch.empty(2, 32)) == "kernel"}
    on = paths()
    assert all(on.values())
    with kernels.override("none"):
        assert not any(paths().values())
        assert kernels.get("token") is None and kernels.simd_level() is None
        assert exactness.small_call_kc(w) is None  # the probe asks the registry: no kernel, no kc
        assert {s.reason for s in kernels.status()} == {"switched off by override='none'"}
    with kernels.override("-token"):
        assert paths() == {**on, "token": False}
        assert [s.name for s in kernels.status() if not s.loaded] == ["token"]
    assert paths() == on and kernels.get("token") is not None  # the choice before the block is back


@pytest.mark.skipif(not kernels.loaded("token"), reason="needs the token kernel")
def test_the_torch_form_under_the_override_computes_the_same_function():
    """The override reaches the computation, not only the choice: the Engram gate in C and in torch agree (to
    rounding; they are different code)."""
    g = torch.Generator().manual_seed(0)
    h, kv = torch.randn(7, 2, 32, generator=g), torch.randn(7, 3 * 32, generator=g)
    qw, kw = torch.randn(2, 32, generator=g), torch.randn(2, 32, generator=g)
    c = ops.choose(h).engram_gate(h, kv, qw, kw, None, 1e-6)
    with kernels.override("-token"):
        assert ops.choose(h) is ops_torch
        t = ops.choose(h).engram_gate(h, kv, qw, kw, None, 1e-6)
    assert torch.allclose(c, t, rtol=1e-5, atol=1e-5)


def test_env_without_kernels_says_none_is_loaded():
    r = env_command(kernels_env="none")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for name in kernels.MODULES:
        state = next(ln for ln in lines if ln.startswith(f"kernel {name}: "))
        assert state in (f"kernel {name}: switched off by ENGRAM_SERVE_KERNELS='none'", f"kernel {name}: not built")
    assert "SIMD level: - (no matmul kernel)" in lines
    assert any(ln.startswith("engram-serve ") and f"torch {torch.__version__}" in ln for ln in lines)
    assert any(ln.startswith("threads: ") for ln in lines)


def test_env_of_a_build_without_a_kernel_says_not_built():
    r = env_command("--json", hide=("linear", "gather"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kernels"]["linear"] == out["kernels"]["gather"] == "not built"
    assert out["simd_level"] is None
    assert out["torch"] == torch.__version__ and out["threads"] >= 1
    built = {name for name in kernels.MODULES if kernels.loaded(name)} - {"linear", "gather"}
    assert all(out["kernels"][name] == "loaded" for name in built)


def test_env_with_a_bad_spec_is_one_line_exit_2():
    r = env_command(kernels_env="linear,-hash")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "engram-serve: error: ENGRAM_SERVE_KERNELS='linear,-hash': names with and without '-' mixed; give the "
        "kernels to load (hash,gather) or those to leave out (-linear,-token)"]


def test_summary_is_one_line_naming_loaded_kernels_the_others_and_why_and_the_simd_level():
    with kernels.override("-linear,-hash"):
        line = kernels.summary()
    assert "\n" not in line
    loaded = [n for n in kernels.MODULES if n not in ("linear", "hash") and kernels.loaded(n)]
    assert line.startswith(f"C kernels loaded: {', '.join(loaded) or 'none'}; not loaded: ")
    for name in ("hash", "linear"):
        assert f"{name} (switched off by override='-linear,-hash')" in line or f"{name} (not built)" in line
    assert "SIMD: -" in line
    if kernels.loaded("linear"):
        level = kernels.simd_level()
        assert f"SIMD: {level} ({kernels.SIMD_LEVELS[level]})" in kernels.summary()


def test_the_engine_factory_logs_the_summary_once(caplog):
    caplog.set_level(logging.INFO, logger="engram_serve")
    engine = build_engine(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, num_blocks=16)
    engine.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "engram_serve.engine.factory"]
    assert lines == [kernels.summary()]


def test_serve_prints_the_start_up_line():
    env = {**os.environ, kernels.ENV: "-hash"}
    proc, _ = start_serve([], 120, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.decode().replace("\r", "\n").splitlines() if "C kernels loaded" in ln]
    assert len(lines) == 1 and lines[0].startswith("INFO: C kernels loaded: ")
    assert "hash (switched off by ENGRAM_SERVE_KERNELS='-hash')" in lines[0] or "hash (not built)" in lines[0]
