"""`engram-serve plan`: the memory one rank of the engine holds for a checkpoint, before loading it.

The model is a checkpoint directory (config.json and the safetensors headers: names, dtypes, shapes; no tensor
is read) or a config.json alone (then the published layout: FP8 block-scaled linears, MXFP4 routed experts,
BF16 other matrices, FP8 Engram tables, as model/random_writer.py `recipes` lists them). Per rank:

    weights    each stored tensor as the engine HOLDS it, by stored format: `held_copies`, the one rule of
               how a stored tensor is held (the loader's copy, the product strategies' panels or tiles,
               `stacked` copies, the MXFP4 panels), on the rank's shard (`rank_shape`)
    tables     the Engram tables: file-backed at tensor-parallel size 1 (mapped, read on demand: resident as
               rows are read, evictable page cache), each rank's rows copied into RAM above it
    state      per request at max-model-len: the paged pools (model/paged_state.py: every token's window KV on
               every layer, compressed entries, index keys and open pairs on the kv sources, float32) and the
               token store, times max-num-seqs (the cache the engine needs to hold them all at full length)
    buffers    the rope tables (positions up to max-model-len) and the microbatch buffers (staging rows,
               hash ids, top-k and candidate blocks) of max-num-batched-tokens tokens

Not counted: a step's activations (freed after the step; `keep_freed_memory` keeps the largest step's in the
heap), Python, torch and the tokenizer, the page cache. At tensor-parallel size N > 1 every rank first loads
the whole checkpoint as at size 1, then keeps its shard (parallel/launch.py): `load_peak` is that moment, one
layer's routed experts densified to float32 (parallel/layers.py `ExpertParallelMoE` reads `w13`). Measured
against a process's resident memory in tests/test_memory_plan.py (within 10% at two shapes).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from .config import ModelConfig, flatten_config, read_json
from .errors import ConfigError

MXFP4_CODES = ("I8", "U8")  # packed E2M1
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FORMATS = {"F8_E4M3": "FP8 E4M3 (E8M0 blocks)", "I8": "MXFP4", "U8": "MXFP4", "BF16": "BF16", "F16": "F16",
           "F32": "F32"}
PANEL, TILE = 16, 32  # outputs per float/FP8/MXFP4 panel; per bfloat16 tile (model/exactness.py)


# ---- how a stored tensor is held: follows model/loader.py, model/products.py, model/layers.py, parallel/ ----

@dataclass(frozen=True)
class Machine:
    """What decides how a weight is held: the linear kernel loaded (engram_serve/kernels.py), and whether it
    multiplies bfloat16 tiles (AMX: model/exactness.py `amx_supported`)."""

    kernel: bool
    amx: bool = False
    expert_words: bool = False  # the routed experts repacked into RAM (`experts_fit`)

    @classmethod
    def local(cls) -> Machine:
        from . import kernels
        from .model import exactness
        k = kernels.get("linear")
        return cls(k is not None, exactness.amx_supported(k))


class Copy(NamedTuple):
    """One copy the engine keeps of a stored weight: `per_param` bytes per parameter of the logical [out, in]
    weight (None: as stored), its outputs rounded up to a multiple of `pad`, file-backed or in RAM."""

    what: str
    per_param: float | None
    pad: int = 1
    file_backed: bool = False


FLOAT32 = Copy("float32 (input-major)", 4)
STACK = Copy("stacked float32 copy", 4)
PANELS = Copy("float panels", 4, PANEL)
TILES = Copy("bfloat16 tiles", 2, TILE)
STORED = ("F8_E4M3", "BF16")  # the formats a Linear's weight stays in (model/loader.py `read_stored`)


AS_STORED = Copy("as stored, mapped", None, 1, True)
WORDS = Copy("rows panel-major", None, PANEL)  # the mapped rows' pages let go (weights.py `panel_major`) ...
EDGES = Copy("the repacked rows' edge pages, mapped", None, 1, True)  # ... but the two a neighbour shares
PAGE = 4096


def held_copies(role: str, stored: str, outputs: int, m: Machine, tp: int = 1) -> tuple[Copy, ...]:
    """THE RULE of how the engine holds one stored tensor. It must follow the code that makes the copies (change
    it with them; tests/test_memory_plan.py compares it with a loaded model's tensors):

      model/loader.py    at tensor-parallel size 1 where the linear kernel is loaded: MXFP4 routed experts
                         (weights.py `Mxfp4Experts`) kept as stored, views of the read-only memory map
                         (file-backed: resident as steps touch their pages), or repacked panel-major in RAM where
                         they fit (`experts_fit`); FP8 block-scaled and BF16 weights of Linear modules
                         (`StoredWeight`) repacked panel-major in RAM where the kernel multiplies them as stored
                         (`panel_major`: the same bytes, rows padded to 16), FP8 scales mapped; F32 weights mapped; other FP8 and BF16/F16 weights (the
                         embedding, the mHC's hc_*_fn) dequantized or cast ONCE to float32; scales used up at load
      model/exactness.py `stored_kc`, `tiles_admit`: a weight as stored is multiplied in place where the float
                         plan of its shape is the float panels (no AMX, a probed block size) or, on an AMX CPU, the
                         bfloat16 tiles (scales that keep every value a normal bfloat16: not read here), at least
                         16 outputs either way; else a float32 copy (`dense`, input-major) and its plan, at the
                         first forward
      model/layers.py    `layout_weights_`: the float matmul weights copied once, input-major; `stacked`: one more
                         float32 copy of float weights that share an input (weights as stored stay so)
      model/products.py  `plan`, made at the first forward: a float matmul weight's float panels (4 bytes), plus
                         its FP8 panels where every value is an E4M3 times one power of two per 64 inputs x 16
                         outputs (`pack_fp8`; not counted: see below), or instead its bfloat16 tiles on an AMX CPU
                         where every value is a bfloat16 (any outputs); else none for fewer than 16 outputs (BLAS
                         or padded torch)
      parallel/          at size > 1 the weights are sliced as floats (the stored ones made float first), the
                         routed experts densified to float32 (`ExpertParallelMoE`) and each rank's Engram rows
                         copied (`ShardedEngramTables`)

    `role`: "matmul" (a float matmul weight), "linear" (a Linear module's weight), "stacked" / "stacked linear"
    (weights that share an input), "expert" (a routed expert projection), "embed", "vector" (anything else the
    forward reads whole), "table" (an Engram table or its scales), "scale" (a weight's E8M0 scales)."""
    if role == "scale":
        return ()
    if role == "table":
        return (Copy("as stored, mapped" if tp == 1 else "the rank's rows, copied", None, 1, tp == 1),)
    if role in ("vector", "embed"):
        return (Copy("float32, mapped", 4, 1, True),) if stored == "F32" else (Copy("float32 (cast)", 4),)
    in_place = m.kernel and tp == 1 and outputs >= PANEL
    if in_place and (role.endswith("linear") and stored in STORED or
                     role == "expert" and stored in MXFP4_CODES and m.expert_words):
        return (WORDS, EDGES)
    if in_place and role == "expert" and stored in MXFP4_CODES:
        return (AS_STORED,)
    tiles = m.amx and stored != "F32"  # (every FP8, MXFP4, BF16 value a bfloat16: tiles for any outputs)
    if not m.kernel or (outputs < PANEL and not tiles):
        return (FLOAT32,)
    products = (TILES,) if tiles else (PANELS,)
    return ((FLOAT32, STACK) if role.startswith("stacked") else (FLOAT32,)) + products


# ---- what a rank holds at tensor-parallel size N: follows parallel/shard.py and parallel/layers.py ----

SHARDED = (  # (name, the dimension divided by N)
    (re.compile(r"layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight)"), 0),  # heads, output groups
    (re.compile(r"layers\.\d+\.attn\.wo_b\.weight"), 1),  # RowParallelLinear
    (re.compile(r"layers\.\d+\.ffn\.shared_experts\.w[13]\.weight"), 0),  # the intermediate dimension
    (re.compile(r"layers\.\d+\.ffn\.shared_experts\.w2\.weight"), 1),
)
EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.w[123]\.(weight|scale)")  # (mtp: the drafter's)
TABLE = re.compile(r"layers\.\d+\.engram\.embed\.(weight|scale)")
NOT_TEXT = ("vision.", "aligner.", "image_")  # and `mtp.*` where the config has no drafter (loader.py)


def rank_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> tuple[int, ...] | None:
    """The shape of tensor `name` that rank 0 of `tp` holds (None: another rank's expert). Engram tables:
    ceil(rows / tp) rows plus one zero row; everything not in SHARDED is replicated."""
    if tp == 1:
        return shape
    m = EXPERT.fullmatch(name)
    if m and m.group(1) == "layers":  # (the drafter is not sharded: replicated)
        return shape if int(m.group(2)) < cfg.n_routed_experts // tp else None
    if TABLE.fullmatch(name):
        return (-(-shape[0] // tp) + 1, *shape[1:])
    for pattern, dim in SHARDED:
        if pattern.fullmatch(name):
            return tuple(n // tp if d == dim else n for d, n in enumerate(shape))
    return shape


def roles(cfg: ModelConfig, tp: int) -> dict[str, str]:
    """The role (`held_copies`) of every matmul weight of the text model by official name, from the model built
    on the meta device; names not here are experts, tables, scales, the embedding or vectors."""
    import torch

    from .model.deepseek_v41 import DeepseekV41
    from .model.dspark import DSpark
    from .model.layers import Linear
    with torch.device("meta"):
        models = [DeepseekV41(cfg)] + ([DSpark(cfg)] if cfg.dspark.enabled else [])  # (the drafter: `mtp.*`)
    names = {id(mod): name for model in models for name, mod in model.named_modules()}
    out = {}
    for mod, pname, _ in (p for model in models for p in model.matmul_params()):
        name = f"{names[id(mod)]}.{pname}"
        stacked = re.fullmatch(r"layers\.(\d+)\.attn\.compressor\.(wkv|wgate)\.weight", name)
        kind = "linear" if isinstance(mod, Linear) else "matmul"
        if stacked and cfg.ratios[int(stacked.group(1))] == 2 or (
                tp == 1 and re.fullmatch(r"layers\.\d+\.ffn\.shared_experts\.w[13]\.weight", name)):
            out[name] = f"stacked {kind}"
        elif not re.fullmatch(r"(layers|mtp)\.\d+\.ffn\.(w13|w2)", name):
            out[name] = kind
    return out


def role_of(name: str, matmul: dict[str, str]) -> str:
    if EXPERT.fullmatch(name):
        return "scale" if name.endswith(".scale") else "expert"
    if TABLE.fullmatch(name):
        return "table"
    if name.endswith(".scale"):
        return "scale"
    if name == "embed.weight":
        return "embed"
    return matmul.get(name, "vector")


# ---- the plan ----

@dataclass
class Weights:
    """One stored format's weights on a rank: bytes as stored, bytes held (by copy), of which file-backed."""

    stored: int = 0
    held: int = 0
    file_backed: int = 0
    copies: dict[str, int] = field(default_factory=dict)

    def add(self, copy: Copy, n: int) -> None:
        self.held += n
        self.file_backed += n if copy.file_backed else 0
        self.copies[copy.what] = self.copies.get(copy.what, 0) + n


@dataclass
class MemoryPlan:
    """What one rank (rank 0) holds. Invariant: `ram + file_backed` is the sum of every `Weights.held`, the
    tables' `held`, `state` and the `buffers`; `fits` compares the larger of `ram` and `load_peak` with
    `memory`."""

    source: str  # "checkpoint" (safetensors headers) or "config" (the published layout assumed)
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    machine: dict
    weights: dict[str, Weights]  # by stored format
    tables: Weights
    state_per_token: int  # bytes of per-request state per token position
    state: int  # max_num_seqs requests at max_model_len, with their token store rows and block tables
    buffers: dict[str, int]
    load_peak: int  # bytes held while loading (tensor-parallel size > 1: the whole checkpoint at size 1 first)
    memory: int  # what the total is compared with
    memory_source: str

    @property
    def ram(self) -> int:
        """Bytes of RAM a rank holds once serving (file-backed weights and tables apart)."""
        w = sum(x.held - x.file_backed for x in self.weights.values())
        return w + self.tables.held - self.tables.file_backed + self.state + sum(self.buffers.values())

    @property
    def file_backed(self) -> int:
        return sum(x.file_backed for x in self.weights.values()) + self.tables.file_backed

    @property
    def fits(self) -> bool:
        return max(self.ram, self.load_peak) <= self.memory

    def to_dict(self) -> dict:
        return {**asdict(self), "ram": self.ram, "file_backed": self.file_backed, "fits": self.fits}


def memory_plan(model: str | Path, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                memory: int | None = None, machine: Machine | None = None) -> MemoryPlan:
    """The plan of `model` (a checkpoint directory or a config.json); defaults as the engine's (RunnerConfig;
    max_model_len capped by max_position_embeddings), `memory` default this machine's MemTotal."""
    from .microbatch.plan import MicrobatchConfig
    from .parallel.shard import check_divisible
    from .runner.model_runner import RunnerConfig
    path, tp = Path(model), tensor_parallel_size
    specs, text, source = read_specs(path)
    cfg = ModelConfig.from_dict(text)
    check_divisible(cfg, tp)
    d = RunnerConfig()
    max_model_len = max_model_len or min(d.max_model_len, cfg.max_position_embeddings)
    max_num_seqs = max_num_seqs or d.max_num_seqs
    max_num_batched_tokens = max_num_batched_tokens or d.max_num_batched_tokens
    mem_source = "--memory"
    if memory is None:
        memory, mem_source = mem_total(), "MemTotal of /proc/meminfo"
    experts = sum(ITEMSIZE[t] * math.prod(shape) for n, (t, shape) in specs.items() if ROUTED.search(n))
    from .model.weights import experts_fit
    m = replace(machine or Machine.local(), expert_words=experts_fit(experts, memory))
    weights, one_layer_experts = held_weights(specs, cfg, tp, m)
    tables = weights.pop("tables", Weights())
    per_token = state_per_token(cfg)
    slots = -(-max_model_len // d.block_size) * d.block_size
    state = max_num_seqs * (slots * per_token + (slots // d.block_size) * 8 + 8)
    buffers = runtime_buffers(cfg, max_model_len, max_num_batched_tokens, MicrobatchConfig().num_microbatches)
    load_peak = 0
    if tp > 1:  # every rank loads the whole checkpoint first, then densifies one layer's experts at a time
        ram = lambda ws: sum(x.held - x.file_backed for x in ws.values())  # noqa: E731
        loaded = ram(held_weights(specs, cfg, 1, m, products=False)[0])
        shard = ram(held_weights(specs, cfg, tp, m, products=False)[0])
        load_peak = max(loaded, shard) + one_layer_experts
    return MemoryPlan(source, tp, max_model_len, max_num_seqs, max_num_batched_tokens, asdict(m), weights, tables,
                      per_token, state, buffers, load_peak, memory, mem_source)


def read_specs(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict, str]:
    """({name: (dtype, shape)}, the flat text config, source) of a checkpoint directory or a config.json."""
    from .model.checkpoint import CONFIG_FILE, CheckpointFiles
    if path.is_dir():
        text = flatten_config(read_json(path / CONFIG_FILE))
        files = CheckpointFiles.open(path)  # reads the headers only
        skip = NOT_TEXT + (() if ModelConfig.from_dict(text).dspark.enabled else ("mtp.",))
        specs = {k: (files.info(k)[0], tuple(files.info(k)[1])) for k in files.keys() if not k.startswith(skip)}
        return specs, text, "checkpoint"
    from .model.random_writer import stored_specs
    from .model.writer import Quant, with_engram_rows
    text = flatten_config(read_json(path))
    if "engram_num_embeddings" not in text:
        text = with_engram_rows(text)
    return stored_specs(text, Quant(bf16=True)), text, "config"


def held_weights(specs: dict, cfg: ModelConfig, tp: int, m: Machine,
                 products: bool = True) -> tuple[dict[str, Weights], int]:
    """({stored format or "tables": Weights} of rank 0, the float32 bytes of one layer's routed experts);
    `products` False: without the product strategies' copies (made at the first forward, after loading)."""
    matmul = roles(cfg, tp)
    out: dict[str, Weights] = {}
    expert_params: dict[str, int] = {}
    for name, (dtype, shape) in specs.items():
        if name.endswith(".ffn.gate.bias_vl"):
            continue  # not part of the text forward (loader.py `not_text_forward`)
        role = role_of(name, matmul)
        owner = name[: -len(".scale")] + ".weight" if role == "scale" else name
        wdtype = specs.get(owner, (dtype,))[0]
        shp = rank_shape(name, shape, cfg, tp)
        if shp is None:
            continue
        copies = held_copies(role, dtype, 1, m, tp)
        if role == "scale" and owner in specs:  # held as stored with its weight (else used up at load)
            oshape = specs[owner][1]
            outputs = oshape[0] if len(oshape) > 1 else 1
            held = held_copies(role_of(owner, matmul), wdtype, outputs, m, tp)
            copies = (AS_STORED,) if AS_STORED in held or WORDS in held else ()
        key = "tables" if role == "table" else FORMATS.get(wdtype, wdtype)
        w = out.setdefault(key, Weights())
        w.stored += ITEMSIZE[dtype] * math.prod(shp)
        logical = (shp[0], shp[-1] * 2) if dtype in MXFP4_CODES else shp
        if role == "expert":
            layer = ".".join(name.split(".")[:2])  # layers.{l} or mtp.{i}
            expert_params[layer] = expert_params.get(layer, 0) + math.prod(logical)
        if role != "scale":
            copies = held_copies(role, dtype, logical[0] if len(logical) > 1 else 1, m, tp)
        for c in copies:
            if not products and c in (PANELS, TILES):
                continue
            rows = -(-logical[0] // c.pad) * c.pad if len(logical) > 1 else logical[0]
            n = rows * math.prod(logical[1:])
            stored_bytes = ITEMSIZE[dtype] * math.prod(shp)
            if c is EDGES:
                w.add(c, min(stored_bytes, 2 * PAGE))
            else:
                w.add(c, stored_bytes * rows // logical[0] if c.per_param is None else math.ceil(c.per_param * n))
    one_layer = 4 * max(expert_params.values(), default=0) * (tp if tp > 1 else 1)
    return out, one_layer


def state_per_token(cfg: ModelConfig) -> int:
    """Bytes a request holds per token position (model/paged_state.py, float32; the drafter's window keys,
    model/dspark.py `DSparkState`; inputs/token_store.py)."""
    kv = cfg.kv_source_layer_ids
    floats = ((cfg.num_hidden_layers + cfg.dspark.num_layers) * cfg.head_dim + len(kv) * (cfg.head_dim + cfg.index_head_dim)
              + sum(2 * cfg.head_dim for s in kv if cfg.ratios[s] == 2))
    return 4 * floats + 4 + 1  # + the token id (int32) and its dead flag (bool)


def runtime_buffers(cfg: ModelConfig, max_model_len: int, tokens: int, microbatches: int) -> dict[str, int]:
    """The rope tables (deepseek_v41.py `RopeTable`: cos and sin [rows, rope dim / 2] float32, the compressed
    layers' once more per shift) and the microbatch buffers (microbatch/buffers.py `MicrobatchBuffers`)."""
    rows, half = max(max_model_len, 4096), cfg.qk_rope_head_dim // 2
    shifts = len({r - 1 for r in cfg.ratios if r > 1})
    e = cfg.engram
    per_token = (e.num_layers * e.num_columns * (4 * e.engram_head_dim + 8)
                 + 8 * (cfg.index_topk + cfg.candidate_topk_blocks))
    return {"rope tables": rows * half * 4 * 2 * (2 + shifts), "microbatch buffers": microbatches * tokens * per_token}


def mem_total() -> int:
    from .model.checkpoint import meminfo
    total = meminfo("MemTotal")
    if total is None:
        raise ConfigError("/proc/meminfo has no MemTotal: give --memory")
    return total


ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")  # a routed expert's codes and scales


def parse_bytes(text: str) -> int:
    """argparse type: bytes, with an optional K, M, G or T suffix (powers of 1024; `64G`, `64GiB`, `1.5T`)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a byte count: {text!r} (e.g. 68719476736, 64G, 64GiB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_plan(p: MemoryPlan) -> list[str]:
    """The lines `engram-serve plan` prints."""
    src = "checkpoint headers" if p.source == "checkpoint" else "config alone: the published layout assumed"
    mach = p.machine
    lines = [f"per rank of {p.tensor_parallel_size} (rank 0), from the {src}; max-model-len {p.max_model_len}, "
             f"max-num-seqs {p.max_num_seqs}, max-num-batched-tokens {p.max_num_batched_tokens}; linear kernel "
             f"{'loaded' if mach['kernel'] else 'not loaded'}, AMX tiles {'yes' if mach['amx'] else 'no'}",
             f"  {'':34s} {'stored':>14s} {'held':>14s}"]
    for fmt, w in sorted(p.weights.items(), key=lambda kv: -kv[1].held):
        lines.append(f"  weights {fmt:26s} {gib(w.stored):>14s} {gib(w.held):>14s}"
                     + (f"  ({gib(w.file_backed)} file-backed)" if w.file_backed else ""))
        for what, n in sorted(w.copies.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {what:47s} {gib(n):>14s}")
    t = p.tables
    lines.append(f"  Engram tables {'':20s} {gib(t.stored):>14s} {gib(t.held):>14s}  "
                 + ("file-backed: mapped, read on demand" if t.file_backed else "in RAM: the rank's rows, copied"))
    lines.append(f"  per-request state {gib(p.state):>31s}  ({p.state_per_token:,} bytes a token x "
                 f"{p.max_model_len} x {p.max_num_seqs} requests)")
    for what, n in p.buffers.items():
        lines.append(f"  {what:34s} {'':>14s} {gib(n):>14s}")
    lines.append(f"  total in RAM {gib(p.ram):>36s}  (+ {gib(p.file_backed)} file-backed; activations not counted)")
    if p.load_peak:
        lines.append(f"  while loading {gib(p.load_peak):>35s}  (the whole checkpoint at size 1, then one layer's "
                     f"experts in float32)")
    need = max(p.ram, p.load_peak)
    lines.append(f"  {'fits' if p.fits else 'does NOT fit'} in {gib(p.memory)} ({p.memory_source}): "
                 f"{gib(need)} needed per rank"
                 + (f", {gib(need * p.tensor_parallel_size)} for all {p.tensor_parallel_size} ranks on one machine"
                    if p.tensor_parallel_size > 1 else ""))
    return lines
