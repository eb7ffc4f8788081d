"""Load a DeepSeek-V4.1 checkpoint directory in the official layout (writer.py writes one).

    config.json                    as published: the text model's fields nested under `text_config` (or flat)
    model.safetensors[.index.json] one file, or an index and shards (checkpoint.py)
    tokenizer.json                 a `tokenizers` tokenizer

Tensor names are the official ones (docs/deepseek_v41.md), which are the model's parameter names but
for the routed experts: one tensor per expert and projection in the checkpoint (`ffn.experts.{e}.w1`),
stacked at load (`ffn.w13` [E, 2I, D], `ffn.w2` [E, D, I]). Tensors are read through
`safetensors.safe_open`: float32 weights are views of a private (copy-on-write) mapping of their shard,
assigned into a model built on the meta device; FP8 block-scaled linears and FP8 experts are
dequantized ONCE, at load, into float32, the compute dtype (so the batch-invariant `linear` runs
unchanged); BF16/F16 weights are cast. MXFP4 routed experts stay as stored on a CPU with the linear
kernel (`read_mxfp4_experts`: model/weights.py `Mxfp4Experts`, views of the memory map, no copy; the MoE
multiplies them in place, or dequantizes once where its plan needs floats); elsewhere they
are dequantized like the FP8 ones. The matmul weights are then copied once into the input-major layout of the row
rule (model/exactness.py). Engram tables are never converted: float or FP8 (E4M3 rows + E8M0
per-32-column scales), they stay mapped and are read on demand (madvise MADV_RANDOM), row by row, by
the staging gather. The DSpark drafter (`mtp.*`, model/dspark.py) loads the same way into `LoadedModel.drafter`
where the config describes one; else it is left out, like the vision tower (`vision.*`, `aligner.*`, `image_*`)
and the image routing bias (`*.ffn.gate.bias_vl`), which are not part of the text forward, with one line at load
saying so.

Every disagreement between config, tokenizer and tensors raises CheckpointMismatch naming the field
(or file and tensor) and both values; a wrongly typed config.json value raises ConfigError naming it.
`load_model` is the one way to load a model: the engine, the CLI, verification and the benchmarks call it.
"""
from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .. import kernels
from ..config import EngramConfig, ModelConfig, read_json
from ..engram.layout import EngramLayout, build_layout
from ..engram.quantized import SCALE_COLS, Fp8Table, advise_random, block_size_of, dequantize_blocks, dequantize_fp4
from ..engram.tables import EngramTables, scale_key, table_key
from ..engram.token_map import build_token_map, load_tokenizer
from ..errors import CheckpointMismatch, ConfigError, EngramServeError
from .checkpoint import (CONFIG_FILE, INDEX_FILE, TINY_DIR, TOKENIZER_FILE, WEIGHTS_FILE, CheckpointFiles, drop_pages,
                         meminfo)
from .deepseek_v41 import DeepseekV41
from .dspark import DSpark
from .exactness import STORED_BF16, STORED_FP8
from .weights import Mxfp4Experts, StoredWeight, experts_fit
from .layers import Linear, layout_weights_

log = logging.getLogger(__name__)
FLOAT_CODES = ("F32", "BF16", "F16")
FP8_CODE, SCALE_CODE = "F8_E4M3", "F8_E8M0"
FP4_CODES = ("I8", "U8")  # packed E2M1 (MXFP4)

Progress = Callable[[int, int, str], None]  # (done, total, what)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DeepseekV41
    tables: EngramTables
    layout: EngramLayout
    tokenizer: Tokenizer
    token_map: torch.Tensor  # [tokenizer vocab] int64 raw id -> compressed id
    path: Path
    drafter: DSpark | None = None  # the DSpark drafter (`mtp.*`), where the config and the checkpoint have one


def scale_name(name: str) -> str:
    """Where the E8M0 scales of a quantized tensor live: `a.b.weight` -> `a.b.scale`."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def check_tokenizer(cfg: ModelConfig, tok: Tokenizer) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise CheckpointMismatch(f"vocab_size: config says {cfg.vocab_size}, the tokenizer has {n} tokens")
    for name, v in (("engram_pad_token_id", cfg.engram.engram_pad_token_id), ("eos_token_id", cfg.eos_token_id),
                    ("bos_token_id", cfg.bos_token_id)):
        if not 0 <= v < n:
            raise CheckpointMismatch(f"{name}: config says {v}, the tokenizer has only ids 0..{n - 1}")


def read_table(files: CheckpointFiles, e: EngramConfig, index: int) -> torch.Tensor | Fp8Table:
    """The table of Engram layer e.engram_layer_ids[index] as stored: float [rows, hd], or an Fp8Table."""
    lid, rows = e.engram_layer_ids[index], e.engram_num_embeddings[index]
    key = table_key(lid)
    if key not in files:
        raise CheckpointMismatch(f"missing tensor {key!r} (expected shape {[rows, e.engram_head_dim]}) in "
                                 f"checkpoint {files.root}")
    dtype, shape = files.info(key)
    where = files.file_of(key)
    if len(shape) != 2:
        raise CheckpointMismatch(f"{where}: tensor {key!r}: checkpoint shape {shape}, expected {[rows, e.engram_head_dim]}")
    if shape[0] != rows:
        raise CheckpointMismatch(f"engram_num_embeddings for Engram layer {lid}: config says {rows}, "
                                 f"checkpoint table {key!r} has {shape[0]} rows ({where})")
    if shape[1] != e.engram_head_dim:
        raise CheckpointMismatch(f"engram_head_dim for Engram layer {lid}: config says {e.engram_head_dim}, "
                                 f"checkpoint table {key!r} is {shape[1]} wide ({where})")
    if dtype in FLOAT_CODES:
        return files.tensor(key, writable=False)
    if dtype != FP8_CODE:
        raise CheckpointMismatch(f"{where}: table {key!r} has dtype {dtype}, expected {FP8_CODE} or one of {FLOAT_CODES}")
    skey = scale_key(lid)
    if shape[1] % SCALE_COLS:
        raise CheckpointMismatch(f"engram_head_dim for Engram layer {lid}: {shape[1]} is not a multiple of "
                                 f"{SCALE_COLS}, which an FP8 table {key!r} needs")
    if skey not in files:
        raise CheckpointMismatch(f"missing tensor {skey!r}: the E8M0 scales of the FP8 table {key!r} "
                                 f"(expected shape {[rows, shape[1] // SCALE_COLS]})")
    files.expect(skey, (SCALE_CODE,), [rows, shape[1] // SCALE_COLS])
    return Fp8Table(files.tensor(key, writable=False), files.tensor(skey, writable=False))


def read_tables(files: CheckpointFiles, e: EngramConfig, pin: bool | None = None,
                dedup: bool = True, cache_bytes: int = 0) -> EngramTables:
    tabs = [read_table(files, e, i) for i in range(e.num_layers)]
    if not pin and not (pin is None and torch.cuda.is_available()):
        for t in tabs:  # stay mapped: read on demand, one page per row touched
            for part in ((t.weight, t.scale) if isinstance(t, Fp8Table) else (t,)):
                advise_random(part)
    return EngramTables(e.engram_layer_ids, tabs, pin=pin, dedup=dedup, cache_bytes=cache_bytes)


def read_weight(files: CheckpointFiles, name: str, shape: list[int]) -> tuple[torch.Tensor, list[str]]:
    """(float32 weight of `shape`, the checkpoint names it used). Float32 is a zero-copy view; FP8 with
    block scales is dequantized; `{e}` in the name stacks one tensor per expert along a new dim 0."""
    if "{e}" in name:
        parts = [read_weight(files, name.replace("{e}", str(k)), shape[1:]) for k in range(shape[0])]
        return torch.stack([p for p, _ in parts]), [n for _, used in parts for n in used]
    if name not in files:
        raise CheckpointMismatch(f"missing tensor {name!r} (expected shape {shape}) in checkpoint {files.root}")
    dtype, got = files.info(name)
    where = files.file_of(name)
    if dtype in FP4_CODES and len(shape) == 2:
        return read_fp4(files, name, shape), [name, scale_name(name)]
    if got != list(shape):
        raise CheckpointMismatch(f"{where}: tensor {name!r}: checkpoint shape {got}, the config needs {list(shape)}")
    if dtype in FLOAT_CODES:
        t = files.tensor(name)
        return (t if t.dtype == torch.float32 else converted(t.float(), t)), [name]
    if dtype != FP8_CODE:
        raise CheckpointMismatch(f"{where}: tensor {name!r} has dtype {dtype}, expected a float dtype {FLOAT_CODES} "
                                 f"or {FP8_CODE} with {SCALE_CODE} block scales")
    sname, block = fp8_scales(files, name, shape)
    data, scales = files.tensor(name), files.tensor(sname)
    return converted(dequantize_blocks(data, scales, block), data, scales), [name, sname]


def fp8_scales(files: CheckpointFiles, name: str, shape: list[int]) -> tuple[str, int]:
    """(the name of the E8M0 block scales of the FP8 tensor `name` of `shape`, their block size), checked."""
    sname = scale_name(name)
    if sname not in files or len(shape) != 2:
        raise CheckpointMismatch(f"{files.file_of(name)}: FP8 tensor {name!r} needs its {SCALE_CODE} block scales "
                                 f"{sname!r}" + ("" if len(shape) == 2 else f" and a 2-D shape (it is {list(shape)})"))
    sdtype, sshape = files.info(sname)
    block = block_size_of((shape[0], shape[1]), (sshape + [0, 0])[:2] if len(sshape) == 2 else (0, 0))
    if sdtype != SCALE_CODE or block is None:
        raise CheckpointMismatch(f"{files.file_of(sname)}: scales {sname!r} are {sdtype} {sshape}; expected "
                                 f"{SCALE_CODE} [ceil({shape[0]}/b), ceil({shape[1]}/b)] for a block size b in 32..256")
    return sname, block


def converted(out: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
    """`out`, made from `sources` (views of a shard's map), whose pages the map then lets go (checkpoint.py
    `drop_pages`): a converted tensor's stored bytes are not kept resident."""
    for t in sources:
        drop_pages(t)
    return out


def read_stored(files: CheckpointFiles, name: str, like: torch.Tensor) -> tuple[StoredWeight, list[str]] | None:
    """A 2-D FP8 block-scaled or BF16 weight as stored (`StoredWeight` over views of the read-only memory map, checked
    as `read_weight` checks it), with the checkpoint names used; None where the checkpoint holds it in another dtype
    or its FP8 block is not a multiple of 16 (the stored product's)."""
    if name not in files or files.info(name)[0] not in (FP8_CODE, "BF16") or like.dim() != 2:
        return None
    if files.info(name)[1] != list(like.shape):
        raise CheckpointMismatch(f"{files.file_of(name)}: tensor {name!r}: checkpoint shape {files.info(name)[1]}, "
                                 f"the config needs {list(like.shape)}")
    if files.info(name)[0] == "BF16":
        weight, names = StoredWeight(STORED_BF16, [(files.tensor(name, writable=False), None, 0)]), [name]
    else:
        sname, block = fp8_scales(files, name, list(like.shape))
        if block % 16:
            return None
        data, scales = files.tensor(name, writable=False), files.tensor(sname, writable=False)
        weight, names = StoredWeight(STORED_FP8, [(data, scales, 0)], block), [name, sname]
    for rows in weight.panel_major():  # the rows repacked let their pages of the map go
        drop_pages(rows)
    return weight, names


def read_fp4(files: CheckpointFiles, name: str, shape: list[int]) -> torch.Tensor:
    """An MXFP4 weight (packed E2M1 [rows, cols / 2], E8M0 scales [rows, cols / 32]) dequantized to float32."""
    stored = read_fp4_stored(files, name, shape)
    return converted(dequantize_fp4(*stored), *stored)


def read_fp4_stored(files: CheckpointFiles, name: str, shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 weight as stored: (packed E2M1 [rows, cols / 2], E8M0 scales [rows, cols / 32]), views of the
    memory map, checked against `shape` [rows, cols]."""
    rows, cols = shape
    where, (_, got) = files.file_of(name), files.info(name)
    if got != [rows, cols // 2] or cols % SCALE_COLS:
        raise CheckpointMismatch(f"{where}: MXFP4 tensor {name!r}: checkpoint shape {got}, the config needs "
                                 f"{[rows, cols // 2]} (two values a byte, columns a multiple of {SCALE_COLS})")
    sname = scale_name(name)
    if sname not in files:
        raise CheckpointMismatch(f"{where}: MXFP4 tensor {name!r} needs its {SCALE_CODE} scales {sname!r}")
    files.expect(sname, (SCALE_CODE,), [rows, cols // SCALE_COLS])
    return files.tensor(name, writable=False), files.tensor(sname, writable=False)


def stores_mxfp4_experts(files: CheckpointFiles, cfg: ModelConfig, prefix: str) -> bool:
    """Whether every routed expert projection of the layer `prefix` (`layers.{l}`, `mtp.{i}`: its MoE's cfg) is
    MXFP4 (packed E2M1 bytes) in the checkpoint."""
    names = [f"{prefix}.ffn.experts.{e}.w{j}.weight" for e in range(cfg.n_routed_experts) for j in (1, 2, 3)]
    return all(n in files and files.info(n)[0] in FP4_CODES and len(files.info(n)[1]) == 2 for n in names)


def read_mxfp4_experts(files: CheckpointFiles, cfg: ModelConfig, prefix: str) -> tuple[Mxfp4Experts, list[str]]:
    """The routed experts of the layer `prefix` as stored (`Mxfp4Experts`, no float copy), with the checkpoint
    names used."""
    e_n, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    parts, used = {1: [], 2: [], 3: []}, []
    for e in range(e_n):
        for j, shape in ((1, [i, d]), (3, [i, d]), (2, [d, i])):
            name = f"{prefix}.ffn.experts.{e}.w{j}.weight"
            parts[j].append(read_fp4_stored(files, name, shape))
            used += [name, scale_name(name)]
    return Mxfp4Experts(parts[1], parts[3], parts[2]), used


NOT_TEXT_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")  # the DSpark drafter, the vision tower


def not_text_forward(name: str) -> bool:
    """Tensors of a published V4.1 checkpoint that the text forward does not use (left out at load)."""
    return name.startswith(NOT_TEXT_PREFIXES) or name.endswith(".ffn.gate.bias_vl")


def read_param(files: CheckpointFiles, key: str, shape: list[int]) -> tuple[torch.Tensor, list[str]]:
    """A model parameter (official name) as float32, with the checkpoint names it used; the stacked experts
    `layers.{l}.ffn.w13` [E, 2I, D] and `.w2` [E, D, I] come from one tensor per expert and projection."""
    m = re.fullmatch(r"((?:layers|mtp)\.\d+\.ffn)\.(w13|w2)", key)
    if m is None:
        return read_weight(files, key, shape)
    pre, which = m.groups()
    parts, used = [], []
    for e in range(shape[0]):
        if which == "w13":
            half = [shape[1] // 2, shape[2]]
            (w1, u1), (w3, u3) = (read_weight(files, f"{pre}.experts.{e}.w{j}.weight", half) for j in (1, 3))
            parts.append(torch.cat([w1, w3]))
            used += u1 + u3
        else:
            w2, u2 = read_weight(files, f"{pre}.experts.{e}.w2.weight", shape[1:])
            parts.append(w2)
            used += u2
    return torch.stack(parts), used


def model_state_from_official(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of `model` (a DeepseekV41) from float tensors under the official names (one tensor per
    expert and projection; Engram tables and tensors outside the text forward ignored)."""
    class Given:  # the CheckpointFiles surface read_weight uses, over a dict of float tensors
        root = "<tensors>"

        def __contains__(self, name):
            return name in tensors

        def info(self, name):
            return "F32", list(tensors[name].shape)

        def file_of(self, name):
            return self.root

        def tensor(self, name, writable=True):
            return tensors[name].float()

    return {k: read_param(Given(), k, list(v.shape))[0] for k, v in model.state_dict().items()}


def load_model(path: str | Path | LoadedModel | None = None, *, device: str | torch.device = "cpu",
               pin_tables: bool | None = None, progress: bool | Progress | None = None, dedup: bool = True,
               cache_bytes: int = 0, drafter: bool = True) -> LoadedModel:
    """Load a checkpoint directory (None: the built-in tiny model). Parameters are memory-mapped on CPU
    (copied only when `device` is not the CPU, or dequantized/cast as the module docstring says) and have
    requires_grad off; Engram tables stay on the host, pinned when CUDA is available (pin_tables=None) -
    pinning copies them out of the mapping, so keep pin_tables=False for tables larger than RAM.
    `dedup` and `cache_bytes` configure the staging gather (EngramTables). `drafter`: load the DSpark drafter
    (`LoadedModel.drafter`) where the config describes one (`DSparkConfig.enabled`) and the checkpoint has `mtp.*`
    tensors (a missing one is then a CheckpointMismatch; the confidence head is optional); False, or a config
    without one: `mtp.*` is left out.

    A LoadedModel is returned as is (its weights moved to `device` if they are elsewhere). `progress`:
    a callable (done, total, what) told about each loading stage, or True for a tqdm bar on stderr.
    A TypeError, ValueError or KeyError while loading is a config.json problem: it becomes a ConfigError
    naming the file and the error."""
    if isinstance(path, LoadedModel):
        if path.model.embed.weight.device.type != torch.device(device).type:
            path.model.to(device)
            if path.drafter is not None:
                path.drafter.to(device)
        return path
    root = Path(path) if path is not None else TINY_DIR
    try:
        if progress is True:
            return _load_with_bar(root, device, pin_tables, dedup, cache_bytes, drafter)
        return _load(root, device, pin_tables, progress or None, dedup, cache_bytes, drafter)
    except EngramServeError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{root / CONFIG_FILE}: {type(e).__name__}: {e}") from e


def _load_with_bar(root: Path, device, pin_tables, dedup: bool, cache_bytes: int, drafter: bool) -> LoadedModel:
    """`_load` with a tqdm bar on stderr following the loading stages."""
    from tqdm import tqdm
    with tqdm(total=1, desc="loading", unit="tensor", file=sys.stderr, leave=False,
              postfix="config, tokenizer, compressed token map") as bar:
        def note(done: int, total: int, what: str) -> None:
            if bar.total != total:
                bar.reset(total=total)
            bar.n = done
            bar.set_postfix_str(what[-40:], refresh=False)
            bar.refresh()
        return _load(root, device, pin_tables, note, dedup, cache_bytes, drafter)


def _load(root: Path, device, pin_tables, progress: Progress | None, dedup: bool, cache_bytes: int,
          drafter: bool = True) -> LoadedModel:
    note = progress or (lambda done, total, what: None)
    for f in (CONFIG_FILE, TOKENIZER_FILE):
        if not (root / f).is_file():
            raise CheckpointMismatch(f"checkpoint {root} has no {f}")
    if not (root / WEIGHTS_FILE).is_file() and not (root / INDEX_FILE).is_file():
        raise CheckpointMismatch(f"checkpoint {root} has no {WEIGHTS_FILE} (nor {INDEX_FILE})")
    cfg = ModelConfig.from_dict(read_json(root / CONFIG_FILE))
    tok = load_tokenizer(root / TOKENIZER_FILE)
    check_tokenizer(cfg, tok)
    token_map = build_token_map(tok, cfg.engram.engram_compressed_vocab_size)  # raises on a V' mismatch
    layout = build_layout(cfg.engram)  # raises on a row-count mismatch
    note(0, 1, "config and tokenizer")
    files = CheckpointFiles.open(root)
    tables = read_tables(files, cfg.engram, pin_tables, dedup, cache_bytes)
    used = {n for lid in cfg.engram.engram_layer_ids for n in (table_key(lid), scale_key(lid))}
    with torch.device("meta"):
        model = DeepseekV41(cfg)
    as_stored = torch.device(device).type == "cpu" and kernels.loaded("linear")  # MXFP4, FP8, BF16 stay as stored
    state = read_state(files, model, {f"layers.{l}": b.ffn for l, b in enumerate(model.layers)}, as_stored, used,
                       note)
    draft = None
    if drafter and cfg.dspark.enabled and any(k.startswith("mtp.") for k in files.keys()):
        with torch.device("meta"):
            draft = DSpark(cfg)
        if f"mtp.{cfg.dspark.num_layers - 1}.confidence_head.proj.weight" not in files:
            draft.drop_confidence()  # (optional in a checkpoint)
        draft_state = read_state(files, draft, {f"mtp.{i}": m.ffn for i, m in enumerate(draft.mtp)}, as_stored, used,
                                 note)
        draft.load_state_dict(draft_state, strict=True, assign=True)
        layout_weights_(draft)
        draft.requires_grad_(False).eval()
    experts = [m.stored for net in (model, draft) if net is not None for m in net.modules()
               if isinstance(getattr(m, "stored", None), Mxfp4Experts)]
    if experts_fit(sum(e.nbytes() for e in experts), meminfo("MemAvailable")):
        for rows in (r for e in experts for r in e.panel_major()):
            drop_pages(rows)
    left_out = sorted(k for k in files.keys() if k not in used and not_text_forward(k)
                      and not (draft is not None and k.startswith("mtp.")))  # (a loaded drafter's are all used)
    unexpected = sorted(set(files.keys()) - used - set(left_out))
    if unexpected:
        raise CheckpointMismatch(f"unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                                 f"(checkpoint shapes {[files.info(k)[1] for k in unexpected[:5]]}) in {root}")
    if left_out:
        kinds = sorted({"*.ffn.gate.bias_vl" if k.endswith("bias_vl") else k.split(".")[0] + ".*" for k in left_out})
        log.info("left out %d tensor(s) that are not part of the text forward: %s", len(left_out), ", ".join(kinds))
    model.load_state_dict(state, strict=True, assign=True)
    layout_weights_(model)  # one copy of the matmul weights, input-major (the row rule of model/exactness.py)
    model.requires_grad_(False).eval()
    if torch.device(device).type != "cpu":
        model = model.to(device)
        draft = None if draft is None else draft.to(device)
    return LoadedModel(cfg, model, tables, layout, tok, token_map, root, draft)


def read_state(files: CheckpointFiles, module, moes: dict, as_stored: bool, used: set[str], note: Progress) -> dict:
    """The float state of `module` (a DeepseekV41 or a DSpark, built on the meta device) by official name, the
    checkpoint names read added to `used`. With `as_stored`, the MoEs `moes` (layer prefix -> MoE) whose experts are
    all MXFP4 and the FP8 / BF16 Linears take their weights as stored (`use_stored`) and are not in the state."""
    expected, state = module.state_dict(), {}
    if as_stored:
        for prefix, moe in moes.items():
            if stores_mxfp4_experts(files, moe.cfg, prefix):
                experts, names = read_mxfp4_experts(files, moe.cfg, prefix)
                moe.use_stored(experts)
                used.update(names)
                del expected[f"{prefix}.ffn.w13"], expected[f"{prefix}.ffn.w2"]
        for name, m in module.named_modules():
            key = f"{name}.weight"
            if isinstance(m, Linear) and key in expected and (stored := read_stored(files, key, expected[key])):
                m.use_stored(stored[0])
                used.update(stored[1])
                del expected[key]
    for i, (key, ref) in enumerate(expected.items()):
        state[key], names = read_param(files, key, list(ref.shape))
        used.update(names)
        note(i + 1, len(expected), key)
    return state

