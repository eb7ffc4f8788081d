"""llama.cpp's `llama-bench` as a peer of `bench peers` (its `llamacpp` suite, peers.py's docstring).

`missing` says why the suite cannot run here; `artifacts` writes the two models once into the cache (a
directory per shape and writer version, made under a temporary name and renamed when complete, so that a
stopped run leaves nothing half-written that a later run would take); `LlamaBench.call` runs one llama-bench
process and returns its own timings and its peak resident set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BINARY = "/work/llama.cpp-build/bin/llama-bench"
BUILD_HINT = "build it with scripts/build_llama_cpp.sh, or pass --llama-bench PATH (or set LLAMA_BENCH)"
VERSION = 1  # of what `artifacts` writes: a change to either writer bumps it


def binary(args: argparse.Namespace) -> Path:
    return Path(args.llama_bench or os.environ.get("LLAMA_BENCH") or DEFAULT_BINARY)


def missing(args: argparse.Namespace) -> str | None:
    """Why the suite cannot run here (a line that says how to fix it), or None."""
    import importlib.util

    from .llama_gguf import INSTALL
    if importlib.util.find_spec("gguf") is None:
        return f"the gguf package is missing: {INSTALL}"
    exe = binary(args)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return f"no llama-bench at {exe}: {BUILD_HINT}"
    return None


def cache_root(args: argparse.Namespace) -> Path:
    if args.cache_dir:
        return Path(args.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "engram-serve"


def artifacts(root: Path, shape: str) -> tuple[Path, Path]:
    """(engram-serve checkpoint directory, GGUF file) of `shape`, written once under `root`."""
    import shutil
    import tempfile

    from ..model.writer import Quant, random_v41_checkpoint
    from . import v41_shapes as vs
    from .llama_gguf import write_gguf
    cfg = vs.text_config(shape)
    key = hashlib.sha256(json.dumps([VERSION, cfg, vs.INIT_STD[shape]], sort_keys=True).encode()).hexdigest()[:12]
    final = root / "peers-llamacpp" / f"{shape}-{key}"
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=final.parent))
        try:
            random_v41_checkpoint(tmp / "checkpoint", cfg, 0, Quant(linears=True, experts="fp4", tables=False, bf16=True),
                                  std=vs.INIT_STD[shape])
            write_gguf(tmp / "model.gguf", cfg, seed=0, std=vs.INIT_STD[shape])
            os.replace(tmp, final)  # complete, or absent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "checkpoint", final / "model.gguf"


def checkpoint_sizes(ckpt: Path) -> dict[str, int]:
    """{tensor name: stored bytes} of a safetensors checkpoint directory, from the shards' headers."""
    sizes = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
    return sizes


@dataclass(frozen=True)
class LlamaBench:
    """One llama-bench run a call: prompt processing of `prompt` tokens from an empty context, and `new`
    generated tokens after `prompt` tokens of context (llama-bench's depth), one repetition each."""

    exe: Path
    model: Path
    threads: int
    prompt: int
    new: int

    def command(self) -> list[str]:
        return [str(self.exe), "-m", str(self.model), "-t", str(self.threads), "-p", str(self.prompt),
                "-n", str(self.new), "-d", f"0,{self.prompt}", "-r", "1", "-o", "json"]

    def call(self, _round=None) -> tuple[dict, dict]:
        """({"prefill": s, "decode": s}, {"max_rss_mib": the process's peak resident set})."""
        import subprocess
        import tempfile
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.command(), stdout=out, stderr=err)
            peak = watch_peak_rss(proc, self.exe.name[:15])
            if proc.returncode:
                err.seek(0)
                tail = err.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{' '.join(self.command())} exited {proc.returncode}:\n{tail}")
            out.seek(0)
            tests = {(t["n_prompt"], t["n_gen"], t["n_depth"]): t["samples_ns"][0] / 1e9 for t in json.load(out)}
        times = {"prefill": tests[(self.prompt, 0, 0)], "decode": tests[(0, self.new, self.prompt)]}
        return times, {"max_rss_mib": peak}


def watch_peak_rss(proc, comm: str, every_s: float = 0.02) -> float | None:
    """Wait for `proc`; returns its peak resident set in MiB (VmHWM, read every `every_s` while it runs, once
    its name is `comm`, i.e. after its exec), None where /proc is not there. wait4's ru_maxrss would not do:
    a child's mark starts at its parent's, which exec records from the address space it leaves."""
    import time
    peak = None
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/comm") as f:
                ours = f.read().strip() == comm
            if ours:
                with open(f"/proc/{proc.pid}/status") as f:
                    kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
                peak = max(peak or 0, kib / 1024)
        except (OSError, StopIteration, ValueError):  # gone between the two reads, or no /proc
            pass
        time.sleep(every_s)
    return peak


def bytes_per_token(ckpt: Path, gguf_path: Path, cfg: dict) -> dict[str, int]:
    """What a B = 1 decode step reads at least (`llama_gguf.active_bytes`) from engram-serve's checkpoint and
    from the GGUF, in their stored formats."""
    from .llama_gguf import active_bytes, gguf_active_bytes
    mine = active_bytes(checkpoint_sizes(ckpt), ".ffn.experts.", "embed.weight", cfg["vocab_size"],
                        cfg["num_experts_per_tok"], cfg["n_routed_experts"])
    return {"engram": mine, "llamacpp": gguf_active_bytes(gguf_path, cfg)}
