"""FP8 Engram tables and the staging gather: bit-exact dequantization against a hand-written bit
decoder, dedup and the hot-row cache against a plain row-by-row read, and tables larger than the
memory a process touches (resident memory grows with rows read, not with table size)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.engram.quantized import (Fp8Table, block_size_of, dequantize_blocks, quantize_blocks,
                                           quantize_rows)
from engram_serve.engram.row_cache import RowCache
from engram_serve.engram.tables import EngramTables
from fp8_tables import e4m3, e8m0, reference_rows, same_bits, table_from_bytes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("scales", [[0, 1, 2, 100, 120, 126, 127, 128, 134, 200, 253, 254, 255],
                                    [0, 1, 2, 100, 120, 126, 127, 128, 134]])  # (<= 134: the one-multiply path)
def test_every_e4m3_code_times_every_scale_code_is_bit_exact(scales):
    codes = np.arange(256, dtype=np.uint8)
    scales = np.array(scales, dtype=np.uint8)
    w = np.tile(codes, (len(scales), 1))  # [S, 256]: every E4M3 byte under every scale code
    s = np.repeat(scales[:, None], 8, axis=1)  # [S, 8]
    tab = table_from_bytes(w, s)
    with np.errstate(over="ignore"):  # 448 * 2^127 overflows float32 to inf, in both paths
        ref = reference_rows(w, s, list(range(len(scales))))
    got = tab.dequantize().numpy()
    finite = ~np.isnan(ref)
    assert same_bits(got, ref)  # NaN codes (0x7f, 0xff; scale 255) stay NaN, everything else bit for bit
    assert (ref[finite] != 0).any() and (np.abs(ref[finite & (ref != 0)]) < 2.0 ** -126).any()
    # spot checks of the format itself: 0x7e = 448 (max), 0x01 = 2^-9 (smallest subnormal), scale 127 = x1
    assert e4m3(0x7E) == 448.0 and e4m3(0x01) == 2.0 ** -9 and e8m0(127) == 1.0
    # bfloat16 staging: one rounding of the same exact value
    out = torch.empty(len(scales), 256, dtype=torch.bfloat16)
    from engram_serve.engram.quantized import dequantize_rows
    dequantize_rows(tab.weight, tab.scale, out)
    assert np.array_equal(out.float().numpy()[finite], torch.from_numpy(ref).to(torch.bfloat16).float().numpy()[finite])


def test_quantize_rows_round_trips_within_e4m3_precision():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 64)[:, None]
    x[3] = 0.0
    w, s = quantize_rows(x)
    back = Fp8Table(w, s).dequantize()
    assert torch.equal(back[3], torch.zeros(64))
    # 3 mantissa bits: relative error <= 1/16 for normals; below E4M3's normal range (|x| < 2^-6 of the
    # group's scale 2^k < 2 * amax / 448) the absolute error is at most half the subnormal step 2^(k-9)
    amax = x.abs().view(64, 2, 32).amax(-1, keepdim=True).expand(64, 2, 32).reshape(64, 64)
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + amax * 2 / 448 * 2.0 ** -10).all()


@pytest.mark.parametrize("shape", [(96, 64), (100, 70), (32, 32), (25, 250)])
def test_block_dequantization_equals_a_plain_loop(shape):
    x = torch.randn(*shape) * 3
    w, s = quantize_blocks(x, 32)
    assert block_size_of(shape, tuple(s.shape)) == 32
    got = dequantize_blocks(w, s, 32).numpy()
    wb, sb = w.view(torch.uint8).numpy(), s.view(torch.uint8).numpy()
    ref = np.zeros(shape, dtype=np.float32)
    for o in range(shape[0]):
        for i in range(shape[1]):
            ref[o, i] = np.float32(e4m3(int(wb[o, i])) * e8m0(int(sb[o // 32, i // 32])))
    assert same_bits(got, ref)
    assert block_size_of(shape, (s.shape[0] + 1, s.shape[1])) is None


# ---- the gather: dedup and cache never change the staged values ----

class KeylessCache(RowCache):
    """Negative control: a cache that trusts any filled slot without comparing the row id."""

    def lookup(self, ids):
        slot = ids % self.num_slots
        return self.keys.index_select(0, slot) >= 0, slot


@settings(deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 300), t=st.integers(1, 12), c=st.integers(1, 6),
       cache_rows=st.sampled_from([0, 8, 16, 64, 1000]), dedup=st.booleans(), fp8=st.booleans(),
       steps=st.integers(1, 3), bf16=st.booleans(), backend=st.sampled_from(["torch", "kernel"]))
def test_gather_equals_plain_row_reads(seed, rows, t, c, cache_rows, dedup, fp8, steps, bf16, backend):
    """Both gather paths: torch ops (the gather kernel switched off), and the fused C kernel where it is
    loaded (engram_serve/kernels.py)."""
    with kernels.override("-gather") if backend == "torch" else contextlib.nullcontext():
        gather_equals_plain_row_reads(seed, rows, t, c, cache_rows, dedup, fp8, steps, bf16)


def gather_equals_plain_row_reads(seed, rows, t, c, cache_rows, dedup, fp8, steps, bf16):
    rng = np.random.default_rng(seed)
    hd = 32
    tabs, refs = [], []
    for _ in range(2):  # two Engram layers
        if fp8:  # any bytes at all, NaN codes included
            w = rng.integers(0, 256, (rows, hd), dtype=np.uint8)
            s = rng.integers(0, 256, (rows, hd // 32), dtype=np.uint8)
            tabs.append(table_from_bytes(w, s))
            refs.append(lambda ids, w=w, s=s: reference_rows(w, s, ids))
        else:
            f = rng.standard_normal((rows, hd)).astype(np.float32)
            tabs.append(torch.from_numpy(f))
            refs.append(lambda ids, f=f: np.stack([f[i] for i in ids]) if ids else np.zeros((0, hd), np.float32))
    row_bytes = hd * 4 + 10  # cached rows are dequantized float32 (+ key and CLOCK bit in the kernel's cache)
    tables = EngramTables((1, 2), tabs, pin=False, dedup=dedup, cache_bytes=2 * cache_rows * row_bytes)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for _ in range(steps):  # later steps hit (and collide in) the cache filled by earlier ones
        zipf = np.minimum(rng.zipf(1.3, (t, 2, c)) - 1, rows - 1)  # repeated ids, like real text
        hash_ids = torch.from_numpy(zipf.astype(np.int64))
        out = torch.full((2, t, c, hd), 7.0, dtype=dtype)
        tables.gather(hash_ids, out)
        for layer in range(2):
            with np.errstate(over="ignore"):
                ref = refs[layer](hash_ids[:, layer].reshape(-1).tolist()).reshape(t, c, hd)
            ref = torch.from_numpy(ref).to(dtype).float().numpy()
            assert same_bits(out[layer].float().numpy(), ref)


@kernels.override("-gather")  # the torch path's RowCache (the kernel's: kernels/test_gather_kernel.py)
def test_keyless_cache_serves_wrong_rows():
    """Negative control for the cache's key check: without it, a slot filled by another row id is
    served, and the staged rows differ from the table's."""
    tab = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    tables = EngramTables((1,), [tab], pin=False, cache_bytes=8 * 32 * 4)
    tables.caches = [KeylessCache(8 * 32 * 4, [(32,)], [torch.float32])]
    ids = torch.tensor([[[3]], [[11]]])  # 3 and 11 share slot 3 of 8
    out = torch.empty(1, 2, 1, 32)
    tables.gather(ids[:1], out[:, :1])
    tables.gather(ids[1:], out[:, 1:])
    assert not torch.equal(out[0, 1, 0], tab[11])  # the control fails the property
    good = EngramTables((1,), [tab], pin=False, cache_bytes=8 * 32 * 4)
    good.gather(ids[:1], out[:, :1])
    good.gather(ids[1:], out[:, 1:])
    assert torch.equal(out[0, 1, 0], tab[11])


@kernels.override("-gather")  # the torch RowCache (the kernel's: kernels/test_gather_kernel.py)
def test_cache_hits_and_byte_bound():
    tab = Fp8Table.from_float(torch.randn(1000, 64))
    tables = EngramTables((1,), [tab], pin=False, cache_bytes=100 * 64 * 4)
    cache = tables.caches[0]
    assert cache.num_slots == 100 and cache.row_bytes == 256 and cache.nbytes <= 100 * 256 + 100 * 8
    ids = torch.tensor([5, 5, 17, 5, 17, 42]).view(6, 1, 1)
    out = torch.empty(1, 6, 1, 64)
    tables.gather(ids, out)
    assert (cache.lookups, cache.hits) == (3, 0)  # deduplicated: 3 distinct rows, all cold
    tables.gather(ids, out)
    assert (cache.lookups, cache.hits) == (6, 3)


# ---- tables larger than the memory a process touches ----

CHILD = r"""
import json, resource, sys, torch
from engram_serve.model.checkpoint import CheckpointFiles
from engram_serve.engram.quantized import Fp8Table, advise_random
from engram_serve.engram.tables import EngramTables
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
root, n_rows, writable = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "writable"
limit = status("VmData") + 2**30  # this process may commit 1 GiB more than it has now
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
files = CheckpointFiles.open(root)
before = status("VmRSS")
w = files.tensor("layers.1.engram.embed.weight", writable=writable)
s = files.tensor("layers.1.engram.embed.scale", writable=writable)
for t in (w, s):
    advise_random(t)
tables = EngramTables((1,), [Fp8Table(w, s)], pin=False)
warm = torch.empty(1, 64, 1, w.shape[1])
tables.gather(torch.arange(64).view(64, 1, 1), warm)  # kernels' first-call set-up is not table memory
opened = status("VmRSS")
g = torch.Generator().manual_seed(0)
growth = []
for _ in range(2):  # n_rows more random rows each time: growth after n_rows, then after 2 * n_rows
    ids = torch.randint(0, w.shape[0], (n_rows, 1, 1), generator=g)
    out = torch.empty(1, n_rows, 1, w.shape[1])
    tables.gather(ids, out)
    growth.append((status("VmRSS") - opened) / 2**20)
print(json.dumps({"open_mib": (opened - before) / 2**20, "gather_mib": growth,
                  "table_gib": tables.nbytes / 2**30, "limit_gib": 1.0, "zeros": bool((out == 0).all())}))
"""


def write_sparse_table(root: Path, rows: int, hd: int = 256) -> int:
    """A safetensors file with one FP8 table and its scales, written sparse (header only, the rest a hole)."""
    header = {"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": [rows, hd], "data_offsets": [0, rows * hd]},
              "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [rows, hd // 32],
                                              "data_offsets": [rows * hd, rows * hd + rows * hd // 32]}}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    size = 8 + len(h) + rows * hd + rows * hd // 32
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(size)
    return size


def _child(root: Path, n: int, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(root), str(n), mode], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status, RLIMIT_DATA")
def test_table_four_times_the_memory_limit_opens_and_resident_memory_follows_rows_touched(tmp_path):
    """A 4.1 GiB table (sparse on disk) in a process allowed to commit 1 GiB more (RLIMIT_DATA): it
    opens and serves rows, because tables are mapped read-only (not committed memory); resident
    memory grows by about one page per row read (4 KiB), never towards the table size. Negative
    control: the same table mapped copy-on-write (as weights are, and as safe_open's torch backend
    maps whole files) is refused under the same limit. (`bench tables` opens a table larger than
    the machine's RAM.)"""
    rows = 16 * 2**20 + 2**16  # x 264 bytes = 4.14 GiB > 4 x the 1 GiB limit
    write_sparse_table(tmp_path, rows)
    n = 4000
    res = _child(tmp_path, n, "read-only")
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["table_gib"] > 4 * r["limit_gib"]
    assert r["zeros"] and r["open_mib"] < 16
    for k, grown in enumerate(r["gather_mib"], 1):
        # <= 2 pages (row + scale) and the float32 staging row per row read, + slack for the allocator
        assert grown < k * n * (2 * 4096 + 256 * 4) / 2**20 + 12, r
    assert r["gather_mib"][1] > r["gather_mib"][0] + n * 4096 / 2**20 / 2  # it grows with the rows touched
    assert r["gather_mib"][1] < 0.05 * r["table_gib"] * 1024  # not with the table
    control = _child(tmp_path, 1000, "writable")
    assert control.returncode != 0 and "Cannot allocate memory" in control.stderr
