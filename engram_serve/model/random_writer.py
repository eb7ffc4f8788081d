"""Write a random DeepSeek-V4.1 checkpoint at disk speed: random bytes in the stored formats, tensor by tensor.

writer.py `random_v41_checkpoint` builds a float model and quantizes it (about 1 MB/s); this writes the same
directory (config.json, tokenizer.json, model.safetensors.index.json and the shards: the same tensor names,
dtypes and shapes, `recipes`, and the same shards for the same `shard_bytes`) with no float model: each
tensor's bytes are drawn in its stored format, a few numpy passes over uniform random bytes, and written with
`safetensors`, shard by shard (one thread writes a shard while the next is drawn).

    MXFP4 routed experts  codes [rows, cols / 2]: uniform bytes (both E2M1 nibbles uniform: values 0 .. 6,
                          RMS 2.93); E8M0 scales [rows, cols / 32]: base + {-1, 0, 0, 1}
    FP8 linears, tables   E4M3 codes: uniform bytes, the NaN codes 0x7f / 0xff moved to 0x7e / 0xfe (values
                          down to the subnormals, as a quantized weight has them); E8M0 scales per 32x32
                          block (per row and 32 columns for a table): base + {-1, 0, 0, 1}
    BF16 / F32 matrices   a random sign and mantissa, the exponent uniform over 4 octaves
    vectors               as `deepseek_v41.init_weights`: norms, mHC scales, Engram q/k weights 1; bases,
                          sinks, router bias 0

Each matrix [out, in] gets the scale of a float model's weights, std = 1 / sqrt(in) (the embedding 1, a table
0.5, as writer.py draws them): the scale base (or exponent) puts the RMS of the values near std, so the
activations stay finite and the logits vary with the input (tests/test_random_writer.py). Deterministic:
each tensor's bytes come from a generator seeded by (seed, its name), the same at any shard size.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..engram.quantized import E8M0_BIAS, SCALE_COLS
from ..engram.tables import scale_key, table_key
from .checkpoint import DTYPES, TINY_DIR
from .writer import (FP8_BLOCK, SMALL_TEXT_CONFIG, STACKED, Quant, assign_shards, shard_file, start_directory,
                     stored_form, with_engram_rows, write_index)

E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # uniform codes
JITTER_RMS = math.sqrt((0.25 + 1 + 1 + 4) / 4)  # scale codes base + {-1, 0, 0, 1}: the RMS of 2^jitter
FORM_DTYPES = {"fp8_rows": ("F8_E4M3", "F8_E8M0"), "fp4": ("I8", "F8_E8M0"), "fp8_blocks": ("F8_E4M3", "F8_E8M0"),
               "bf16": ("BF16",), "f32": ("F32",)}


class Recipe(NamedTuple):
    """How one stored tensor is drawn: its safetensors `dtype` and `shape`, the `form` of its weight
    (writer.py `stored_form`), the weight's logical shape (`logical`: [rows, cols] of a quantized one) and
    whether it is the weight's E8M0 scales."""

    dtype: str
    shape: tuple[int, ...]
    form: str
    logical: tuple[int, ...]
    is_scale: bool = False

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * math.prod(self.shape)


def recipes(text: dict, quant: Quant = Quant()) -> dict[str, Recipe]:
    """Every tensor writer.py `official_tensors` stores for this text config (with `engram_num_embeddings`)
    and `quant`, by name, from the model built on the meta device (no memory)."""
    from .deepseek_v41 import DeepseekV41
    from .dspark import DSpark
    cfg = ModelConfig.from_dict(text)
    with torch.device("meta"):
        model = DeepseekV41(cfg)
        drafter = DSpark(cfg) if cfg.dspark.enabled else None  # the drafter's `mtp.*`, as writer.py writes them
    logical: dict[str, tuple[int, ...]] = {}
    params = {**model.state_dict(), **(drafter.state_dict() if drafter is not None else {})}
    for name, p in params.items():
        m = STACKED.fullmatch(name)
        if m is None:
            logical[name] = tuple(p.shape)
            continue
        pre, which = m.groups()
        for e in range(p.shape[0]):
            if which == "w13":
                half = (p.shape[1] // 2, p.shape[2])
                logical[f"{pre}.experts.{e}.w1.weight"] = logical[f"{pre}.experts.{e}.w3.weight"] = half
            else:
                logical[f"{pre}.experts.{e}.w2.weight"] = tuple(p.shape[1:])
    e = cfg.engram
    for lid, rows in zip(e.engram_layer_ids, e.engram_num_embeddings):
        logical[table_key(lid)] = (rows, e.engram_head_dim)
    out = {}
    for name, shape in logical.items():
        form = stored_form(name, len(shape), quant)
        dtypes = FORM_DTYPES[form]
        rows, cols = shape[0], shape[-1]
        out[name] = Recipe(dtypes[0], (rows, cols // 2) if form == "fp4" else shape, form, shape)
        if len(dtypes) > 1:
            blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            scales = blocks if form == "fp8_blocks" else (rows, cols // SCALE_COLS)
            out[name[: -len(".weight")] + ".scale"] = Recipe(dtypes[1], scales, form, shape, True)
    return out


def stored_specs(text: dict, quant: Quant = Quant()) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of every tensor of the checkpoint (`recipes`)."""
    return {name: (r.dtype, r.shape) for name, r in recipes(text, quant).items()}


def generator(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor: seeded by (seed, name), so a tensor's bytes do not depend on the others."""
    words = np.frombuffer(hashlib.blake2b(name.encode(), digest_size=16).digest(), dtype=np.uint32)
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence([seed, *words.tolist()])))


def random_bytes(g: np.random.Generator, n: int) -> np.ndarray:
    """n uniform random bytes [n] uint8 (the generator's raw 64-bit words: ~2 GB/s)."""
    return g.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


@functools.cache
def e4m3_rms() -> float:
    """The RMS value of `e4m3_codes` (uniform bytes, the NaN codes moved to their neighbours)."""
    codes = e4m3_codes(np.arange(256, dtype=np.uint8))
    return float(torch.from_numpy(codes).view(torch.float8_e4m3fn).double().pow(2).mean().sqrt())


def e4m3_codes(r: np.ndarray) -> np.ndarray:
    """Uniform random bytes r [n] uint8 -> E4M3 codes, in place: 0x7f and 0xff (NaN) become 0x7e and 0xfe."""
    t = r & 0x7F
    t += 1
    t >>= 7  # 1 where r & 0x7f == 0x7f
    r -= t
    return r


def scale_codes(r: np.ndarray, std: float, code_rms: float) -> np.ndarray:
    """Uniform random bytes r [n] uint8 -> E8M0 codes, in place: base + {-1, 0, 0, 1}, the base putting the RMS
    of a code's value times its scale near std."""
    base = min(max(round(math.log2(std / (code_rms * JITTER_RMS))) + E8M0_BIAS, 1), 253)
    t = r & 1
    r >>= 1
    r &= 1
    r += t  # 0, 1, 1, 2
    r += base - 1
    return r


BF16_UNIT_RMS = math.sqrt(sum((1 + m / 128) ** 2 for m in range(128)) / 128 * (1 + 4 + 16 + 64) / 4)


def float_bits(r: np.ndarray, std: float, dtype: str) -> np.ndarray:
    """Uniform random bytes r [2n] uint8 -> [n] random BF16 bits (int16) or F32 values (the BF16 ones, widened):
    a random sign and mantissa, the exponent uniform over 4 octaves placed so that the RMS is near std."""
    b = min(max(round(math.log2(std / BF16_UNIT_RMS)) + 127, 1), 250)
    r = r.view(np.uint16)
    t = r >> 7
    t &= 3
    t += b
    t <<= 7
    r &= 0x807F
    r |= t
    return r.view(np.int16) if dtype == "BF16" else (r.astype(np.uint32) << 16).view(np.float32)


def std_of(name: str, logical: tuple[int, ...]) -> float:
    """The standard deviation of a float model's weight `name` [.., in] (the module docstring)."""
    if name == "embed.weight":
        return 1.0
    if name.endswith(".engram.embed.weight"):
        return 0.5
    return 1 / math.sqrt(logical[-1])


def tensor_bytes(name: str, r: Recipe, seed: int) -> torch.Tensor:
    """One stored tensor, drawn as its recipe says (the module docstring), as the torch tensor `save_file` writes."""
    from .deepseek_v41 import INIT_ONES, INIT_ZEROS
    g, n = generator(seed, name), math.prod(r.shape)
    if r.is_scale:
        std = std_of(name[: -len(".scale")] + ".weight", r.logical)
        raw = scale_codes(random_bytes(g, n), std, E2M1_RMS if r.form == "fp4" else e4m3_rms())
    elif r.dtype == "I8":  # MXFP4 codes: both nibbles uniform
        raw = random_bytes(g, n)
    elif r.dtype == "F8_E4M3":
        raw = e4m3_codes(random_bytes(g, n))
    elif name.endswith(INIT_ONES + INIT_ZEROS):
        return torch.full(r.shape, 1.0 if name.endswith(INIT_ONES) else 0.0, dtype=DTYPES[r.dtype])
    else:
        raw = float_bits(random_bytes(g, 2 * n), std_of(name, r.logical), r.dtype)
    return torch.from_numpy(raw).view(DTYPES[r.dtype]).view(r.shape)


def fast_v41_checkpoint(out_dir: str | Path, text_config: dict | None = None, seed: int = 0, quant: Quant = Quant(),
                        tokenizer_path: str | Path | None = None, shard_bytes: int = 64 << 20) -> Path:
    """A deterministic random V4.1 checkpoint in the official layout, drawn in the stored formats (the module
    docstring): the names, dtypes, shapes and shards of writer.py `random_v41_checkpoint` for the same
    arguments (SMALL_TEXT_CONFIG by default, the built-in tokenizer). One thread writes a shard while the next
    is drawn: two shards in memory at most."""
    text = with_engram_rows(dict(text_config or SMALL_TEXT_CONFIG))
    drawn = recipes(text, quant)
    out = start_directory(out_dir, text, quant, tokenizer_path or TINY_DIR / "tokenizer.json")
    shards = assign_shards({name: r.nbytes for name, r in drawn.items()}, shard_bytes)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        pending = None
        for k, names in enumerate(shards):
            tensors = {name: tensor_bytes(name, drawn[name], seed) for name in names}
            if pending is not None:
                pending.result()  # the previous shard written (and freed) before the next is queued
            pending = pool.submit(save_file, tensors, str(out / shard_file(k, len(shards))), {"format": "pt"})
            del tensors
        if pending is not None:
            pending.result()
    write_index(out, shards, sum(r.nbytes for r in drawn.values()))
    return out
