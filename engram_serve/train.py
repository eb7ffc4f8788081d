"""Train the built-in tiny DeepSeek-V4.1 model on the Python standard library's own sources.

    engram-serve train [--out DIR] [--steps N] [--no-ablation] ...
    python scripts/train_default.py            (the run that produced the shipped weights)

Data: every `.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages skipped), sorted by
relative path, tokenized with the bundled tokenizer. A file is held out iff
sha256(f"{seed}:{relative path}") lands in the first `heldout_pct` percent, so the split is seeded
and by file, and a file's side does not depend on which other files exist. The files of each side
are joined with EOS between them and cut into fixed windows of `seq_len + 1` tokens; every window is
a sequence starting at position 0 (input = its first `seq_len` tokens, target = the next token).

Engram: hash ids come from the inference hash (`hash_step`, history all -1, pad_id = the compressed
id of `engram_pad_token_id`), computed per batch; the tables are trainable parameters gathered with
`F.embedding` into `forward_dense`'s `engram_rows` and saved as the checkpoint's
`layers.{id}.engram.embed.weight`.

What gets no gradient: the indexers' weights (the top-k is a hard choice; as NeMo keeps the released
indexer frozen, they stay at their random init, and the selection they make is part of the model) and the
router biases `ffn.gate.bias` (they only choose experts; DeepSeek balances them with an update rule this
run does not use: they stay 0). The checkpoint is written in the official layout (model/writer.py):
FP8 block-scaled linears, FP8 Engram tables, routed experts as `expert_format` says, the other matrices
in BF16 (as published; bfloat16 weights are what the linear kernel's tiles take); its held-out loss
is measured again after re-loading, so the report states what the rounding costs.

Ablation (on by default): (a) the Engram model; (b) the same budget (steps, batch, length, seed,
data order) without Engram layers, its Engram parameters (tables, wkv, q_weight, k_weight) moved into the
experts' width so the totals match; (c) model (a) evaluated with its Engram output zeroed.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
import tokenize as pytokenize
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .config import EngramConfig, ModelConfig, read_json
from .errors import ConfigError
from .engram.hashing import hash_step
from .engram.layout import EngramLayout, build_layout
from .engram.tables import EngramTables
from .engram.token_map import build_token_map, load_tokenizer
from .config import flatten_config
from .model.checkpoint import INDEX_FILE
from .model.deepseek_v41 import DeepseekV41, init_weights
from .model.loader import CONFIG_FILE, TINY_DIR, TOKENIZER_FILE, LoadedModel, load_model
from .model.writer import Quant, save_v41_checkpoint

DEFAULT_SEED = 0
DEFAULT_HELDOUT_PCT = 5.0
SAMPLE_TOKENS = 40


@dataclass(frozen=True)
class TrainSettings:
    """The whole budget of one run; two runs with equal settings see the same windows in the same order."""

    steps: int = 350
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3  # backbone peak learning rate
    table_lr: float = 1.5e-2  # Engram tables' peak learning rate (sparse rows: each sees few updates)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1  # matrices only; no decay on norms, embeddings and tables
    grad_clip: float = 1.0
    table_init_std: float = 0.05
    eval_every: int = 50
    eval_windows: int = 64  # fixed held-out windows (evenly spaced over the held-out stream)
    seed: int = DEFAULT_SEED
    heldout_pct: float = DEFAULT_HELDOUT_PCT
    max_files: int | None = None  # first N files of the sorted list (smoke tests only)
    init_std: float = 0.05  # matrices' init (model/deepseek_v41.py init_weights)
    expert_format: str | None = None  # the shipped routed experts: None (BF16), "fp4" (MXFP4) or "fp8"


# ---- data --------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths (posix) of every `.py` file under root, site-packages skipped."""
    root = root or stdlib_root()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and "site-packages" not in p.relative_to(root).parts)


def is_heldout(rel: str, seed: int = DEFAULT_SEED, pct: float = DEFAULT_HELDOUT_PCT) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{rel}".encode()).digest()[:8], "little")
    return h % 10_000 < pct * 100


def split_files(files: list[str], seed: int = DEFAULT_SEED, pct: float = DEFAULT_HELDOUT_PCT
                ) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths, each in sorted order."""
    held = [f for f in files if is_heldout(f, seed, pct)]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def read_source(path: Path) -> str:
    """A source file decoded by its PEP 263 encoding (bad bytes replaced, deterministically)."""
    raw = path.read_bytes()
    try:
        enc, _ = pytokenize.detect_encoding(iter(raw.splitlines(keepends=True)).__next__)
    except SyntaxError:
        enc = "utf-8"
    return raw.decode(enc, errors="replace")


def tokenize_files(tok, root: Path, rels: list[str]) -> list[np.ndarray]:
    """One int32 id array per file, in the given order (no special tokens added)."""
    texts = [read_source(root / r) for r in rels]
    return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts, add_special_tokens=False)]


def make_windows(docs: list[np.ndarray], seq_len: int, eos_id: int) -> np.ndarray:
    """[W, seq_len + 1] int64: the docs joined with EOS after each, cut every seq_len tokens
    (window i = stream[i*seq_len : i*seq_len + seq_len + 1]; the tail that does not fill one is dropped)."""
    eos = np.array([eos_id], dtype=np.int32)
    stream = np.concatenate([x for d in docs for x in (d, eos)]) if docs else np.zeros(0, np.int32)
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"make_windows: {len(stream)} tokens do not fill one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx].astype(np.int64)


def pick_evenly(windows: np.ndarray, k: int) -> np.ndarray:
    """k windows evenly spaced over the array (all of them when there are at most k)."""
    if len(windows) <= k:
        return windows
    return windows[np.linspace(0, len(windows) - 1, k).round().astype(np.int64)]


@dataclass
class Corpus:
    train: np.ndarray  # [W, S+1] int64
    heldout: np.ndarray  # [E, S+1] int64, the fixed evaluation set
    train_files: list[str]
    heldout_files: list[str]
    train_tokens: int
    heldout_tokens: int


def load_corpus(tok, seq_len: int, eos_id: int, seed: int, pct: float, eval_windows: int,
                max_files: int | None = None, root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    files = source_files(root)[:max_files]
    train_f, held_f = split_files(files, seed, pct)
    if not held_f:  # only with a small max_files (smoke runs): hold out the last file rather than nothing
        train_f, held_f = train_f[:-1], train_f[-1:]
    docs = tokenize_files(tok, root, train_f + held_f)
    tr, he = docs[:len(train_f)], docs[len(train_f):]
    return Corpus(make_windows(tr, seq_len, eos_id), pick_evenly(make_windows(he, seq_len, eos_id), eval_windows),
                  train_f, held_f, sum(map(len, tr)), sum(map(len, he)))


# ---- Engram pieces -----------------------------------------------------------------------------

def gather_rows(tables: list[torch.Tensor], hash_ids: torch.Tensor) -> list[torch.Tensor]:
    """hash ids [B, S, L, C] -> per Engram layer the staged rows [B, S, C, hd] (differentiable)."""
    return [F.embedding(hash_ids[:, :, i, :], t) for i, t in enumerate(tables)]


class WindowHasher:
    """Hash ids of windows that each start at position 0, exactly as inference computes them:
    `hash_step` over the flattened batch with one row per window and history all -1."""

    def __init__(self, layout: EngramLayout, token_map: torch.Tensor, pad_id: int):
        self.layout, self.token_map, self.pad_id = layout, token_map, int(pad_id)
        self.history_len = layout.config.history_len

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> hash ids [B, S, L, C] int64."""
        b, s = ids.shape
        qsl = torch.arange(0, (b + 1) * s, s, dtype=torch.int64)  # [B+1]
        history = torch.full((b, self.history_len), -1, dtype=torch.int64)  # [B, D]: nothing before position 0
        h = hash_step(ids.reshape(-1), qsl, history, self.layout, self.token_map, self.pad_id)  # [B*S, L, C]
        return h.view(b, s, *h.shape[1:])


class TrainableTables(nn.Module):
    """The Engram tables as parameters: table i [engram_num_embeddings[i], engram_head_dim]."""

    def __init__(self, cfg: EngramConfig, seed: int, std: float):
        super().__init__()
        init = EngramTables.random(cfg, seed, std=std, pin=False)
        self.layer_ids = cfg.engram_layer_ids
        self.tables = nn.ParameterList(nn.Parameter(t.clone()) for t in init.tables)

    def export(self) -> EngramTables:
        return EngramTables(self.layer_ids, [t.detach().clone() for t in self.tables], pin=False)


# ---- parameter matching ------------------------------------------------------------------------

def count_params(cfg: ModelConfig) -> dict[str, int]:
    """{'backbone', 'engram' (tables + gate weights), 'total'} for a config (built on the meta device)."""
    with torch.device("meta"):
        m = DeepseekV41(cfg)
    gate = sum(p.numel() for n, p in m.named_parameters() if ".engram." in n)
    tables = sum(cfg.engram.engram_num_embeddings) * cfg.engram.engram_head_dim
    total = sum(p.numel() for p in m.parameters()) + tables
    return {"backbone": total - gate - tables, "engram": gate + tables, "total": total}


def baseline_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without Engram layers, the Engram parameters moved into the experts: moe_intermediate_size (of
    every routed and shared expert) grows, in steps of 32 (MXFP4 scales cover 32 columns), until the total
    parameter count is the closest to `cfg`'s."""
    eng = dataclasses.replace(cfg.engram, engram_layer_ids=(), engram_num_embeddings=())
    base = dataclasses.replace(cfg, engram=eng)
    deficit = count_params(cfg)["total"] - count_params(base)["total"]
    per_unit = 3 * cfg.hidden_size * (cfg.n_routed_experts + 1) * cfg.num_hidden_layers  # w1, w2, w3 of each
    grow = round(deficit / per_unit / 32) * 32
    return dataclasses.replace(base, moe_intermediate_size=cfg.moe_intermediate_size + grow)


# ---- training ----------------------------------------------------------------------------------

def lr_factor(step: int, s: TrainSettings) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    t = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def make_optimizer(model: DeepseekV41, tables: TrainableTables | None, s: TrainSettings) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and name != "embed.weight" else no_decay).append(p)
    groups = [{"params": decay, "lr": s.lr, "weight_decay": s.weight_decay},
              {"params": no_decay, "lr": s.lr, "weight_decay": 0.0}]
    if tables is not None:
        groups.append({"params": list(tables.parameters()), "lr": s.table_lr, "weight_decay": 0.0})
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)


def batch_loss(model: DeepseekV41, tables: list[torch.Tensor] | None, hasher: WindowHasher | None,
               win: torch.Tensor, zero_engram: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of windows [B, S+1] (input = first S tokens, target = next token)."""
    x, y = win[:, :-1], win[:, 1:]
    rows = None if tables is None or zero_engram else gather_rows(tables, hasher(x))
    logits = model.forward_dense(x, rows)  # [B, S, V] float32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate(model: DeepseekV41, tables: list[torch.Tensor] | None, hasher: WindowHasher | None,
             windows: np.ndarray, batch_size: int, zero_engram: bool = False) -> float:
    """Mean token cross-entropy (nats) over every target of the windows."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        win = torch.from_numpy(windows[i:i + batch_size])
        total += float(batch_loss(model, tables, hasher, win, zero_engram, reduction="sum"))
        count += win.shape[0] * (win.shape[1] - 1)
    model.train(was)
    return total / count


def staged_rows(lm: LoadedModel, hasher: WindowHasher, x: torch.Tensor) -> list[torch.Tensor]:
    """`forward_dense`'s engram_rows for windows x [B, S] from a loaded checkpoint's own tables (FP8 or float,
    through the staging gather, as serving stages them): per Engram layer [B, S, C, hd]."""
    e = lm.config.engram
    b, s = x.shape
    staged = torch.empty(e.num_layers, b * s, e.num_columns, e.engram_head_dim)
    lm.tables.gather(hasher(x).reshape(b * s, e.num_layers, e.num_columns), staged)
    return [staged[j].view(b, s, e.num_columns, -1) for j in range(e.num_layers)]


def loaded_hasher(lm: LoadedModel) -> WindowHasher:
    """The WindowHasher of a loaded checkpoint (its layout, token map and pad id)."""
    return WindowHasher(lm.layout, lm.token_map, int(lm.token_map[lm.config.engram.engram_pad_token_id]))


@torch.no_grad()
def evaluate_loaded(lm: LoadedModel, windows: np.ndarray, batch_size: int = 16) -> float:
    """Held-out loss of a checkpoint loaded with `load_model`: its own tables (FP8 or float, through the
    staging gather), layout and token map."""
    hasher = loaded_hasher(lm)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        win = torch.from_numpy(windows[i:i + batch_size])
        x, y = win[:, :-1], win[:, 1:]
        logits = lm.model.forward_dense(x, staged_rows(lm, hasher, x))
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        count += y.numel()
    return total / count


@dataclass
class RunResult:
    name: str
    params: dict[str, int]
    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    final_heldout: float = float("nan")
    wall_s: float = 0.0


def train_model(cfg: ModelConfig, corpus: Corpus, s: TrainSettings, name: str, hasher: WindowHasher | None,
                progress: bool = True) -> tuple[DeepseekV41, TrainableTables | None, RunResult]:
    """Train one model for s.steps; the data order depends only on s.seed (not on the model)."""
    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    model = init_weights(DeepseekV41(cfg), s.seed, s.init_std).train()
    tables = TrainableTables(cfg.engram, s.seed + 1, s.table_init_std) if cfg.engram.num_layers else None
    table_list = list(tables.tables) if tables is not None else None
    result = RunResult(name, count_params(cfg))
    opt = make_optimizer(model, tables, s)
    params = [p for g in opt.param_groups for p in g["params"]]
    order = np.random.default_rng(s.seed)
    perm, cursor = order.permutation(len(corpus.train)), 0
    bar = tqdm(range(s.steps), desc=f"train {name}", disable=not progress, mininterval=2.0, dynamic_ncols=True)
    running = None
    for step in bar:
        if cursor + s.batch_size > len(perm):  # next epoch, new seeded permutation
            perm, cursor = order.permutation(len(corpus.train)), 0
        win = torch.from_numpy(corpus.train[perm[cursor:cursor + s.batch_size]])  # [B, S+1]
        cursor += s.batch_size
        f = lr_factor(step, s)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * f
        loss = batch_loss(model, table_list, hasher, win)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        lv = float(loss.detach())
        running = lv if running is None else 0.98 * running + 0.02 * lv
        result.train_steps.append(step + 1)
        result.train_loss.append(lv)
        bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            ev = evaluate(model, table_list, hasher, corpus.heldout, s.batch_size)
            result.eval_steps.append(step + 1)
            result.eval_loss.append(ev)
            bar.write(f"[{name}] step {step + 1}/{s.steps}  train {running:.4f}  held-out {ev:.4f}")
    bar.close()
    result.final_heldout = result.eval_loss[-1]
    model.eval()
    result.wall_s = time.perf_counter() - t0
    return model, tables, result


@dataclass
class TrainReport:
    settings: TrainSettings
    out_dir: Path
    engram: RunResult
    baseline: RunResult | None
    zeroed_heldout: float | None
    loaded_heldout: float
    corpus_stats: dict
    wall_s: float
    sample_prompt: str = ""
    sample: str = ""
    command: str = ""
    threads: int | None = None

    def summary(self) -> dict:
        d = {"settings": dataclasses.asdict(self.settings), "out_dir": str(self.out_dir),
             "wall_s": round(self.wall_s, 1), "corpus": self.corpus_stats,
             "engram": {"params": self.engram.params, "heldout": self.engram.final_heldout,
                        "wall_s": round(self.engram.wall_s, 1)},
             "engram_zeroed_heldout": self.zeroed_heldout, "loaded_checkpoint_heldout": self.loaded_heldout}
        if self.baseline is not None:
            d["baseline"] = {"params": self.baseline.params, "heldout": self.baseline.final_heldout,
                             "wall_s": round(self.baseline.wall_s, 1)}
        d["sample"] = self.sample
        return d


@torch.no_grad()
def greedy_sample(lm: LoadedModel, prompt: str, new_tokens: int = SAMPLE_TOKENS) -> str:
    """Greedy continuation through `forward_dense`, the whole sequence re-run every token (hash ids
    from `hash_step`, rows gathered by the checkpoint's own `EngramTables.gather`)."""
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False).ids
    pad_id = int(lm.token_map[lm.config.engram.engram_pad_token_id])
    hasher = WindowHasher(lm.layout, lm.token_map, pad_id)
    e = lm.config.engram
    for _ in range(new_tokens):
        x = torch.tensor([ids], dtype=torch.int64)  # [1, S]
        h = hasher(x)[0]  # [S, L, C]
        staged = torch.empty(e.num_layers, x.shape[1], e.num_columns, e.engram_head_dim, dtype=torch.float32)
        lm.tables.gather(h, staged)  # [L, S, C, hd]
        logits = lm.model.forward_dense(x, [staged[i][None] for i in range(e.num_layers)])
        nxt = int(logits[0, -1].argmax())
        if nxt == lm.config.eos_token_id:
            break
        ids.append(nxt)
    return lm.tokenizer.decode(ids, skip_special_tokens=False)


def train(out_dir: str | Path, settings: TrainSettings | None = None, *, ablation: bool = True,
          config_path: str | Path = TINY_DIR / CONFIG_FILE, tokenizer_path: str | Path = TINY_DIR / TOKENIZER_FILE,
          report_dir: str | Path | None = None, sample_prompt: str = "def fibonacci(n):", threads: int | None = 1,
          progress: bool = True, command: str = "") -> TrainReport:
    """Train (and with `ablation`, compare); write the checkpoint to out_dir and, with report_dir,
    TRAINING.md and training_curves.png there. The checkpoint is re-loaded with `load_model` (all checks)."""
    s = settings or TrainSettings()
    t0 = time.perf_counter()
    if report_dir is not None:
        try:  # fail now, not after the training, if the plot cannot be drawn
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(f"report_dir={str(report_dir)!r} needs matplotlib for the training curves: "
                              "pip install -e '.[train]'") from None
    if threads:
        torch.set_num_threads(threads)
    cfg = ModelConfig.from_dict(read_json(config_path))
    if cfg.engram.num_layers == 0:
        raise ValueError(f"{config_path}: engram_layer_ids is empty; there is no Engram model to train")
    tok = load_tokenizer(tokenizer_path)
    token_map = build_token_map(tok, cfg.engram.engram_compressed_vocab_size)
    layout = build_layout(cfg.engram)
    hasher = WindowHasher(layout, token_map, int(token_map[cfg.engram.engram_pad_token_id]))

    log = print if progress else (lambda *a, **k: None)
    log(f"tokenizing the stdlib under {stdlib_root()} ...")
    corpus = load_corpus(tok, s.seq_len, cfg.eos_token_id, s.seed, s.heldout_pct, s.eval_windows, s.max_files)
    stats = {"stdlib": str(stdlib_root()), "python": sys.version.split()[0],
             "train_files": len(corpus.train_files), "heldout_files": len(corpus.heldout_files),
             "train_tokens": corpus.train_tokens, "heldout_tokens": corpus.heldout_tokens,
             "train_windows": len(corpus.train), "eval_windows": len(corpus.heldout),
             "eval_targets": int(corpus.heldout.shape[0] * (corpus.heldout.shape[1] - 1)),
             "tokenize_s": round(time.perf_counter() - t0, 1), "vocab_size": cfg.vocab_size}
    log(f"corpus: {json.dumps(stats)}")

    base_cfg = baseline_config(cfg) if ablation else None
    p_e = count_params(cfg)
    log(f"parameters  engram model: {p_e['total']:,} (backbone {p_e['backbone']:,} + Engram {p_e['engram']:,})")
    if base_cfg is not None:
        p_b = count_params(base_cfg)
        log(f"parameters  baseline (no Engram, moe_intermediate_size {cfg.moe_intermediate_size} -> "
            f"{base_cfg.moe_intermediate_size}): {p_b['total']:,} ({100 * (p_b['total'] / p_e['total'] - 1):+.2f}%)")

    model, tables, res_e = train_model(cfg, corpus, s, "engram", hasher, progress)
    zeroed = None
    if ablation:  # (c): the trained Engram model with its Engram output zeroed
        zeroed = evaluate(model, list(tables.tables), hasher, corpus.heldout, s.batch_size, zero_engram=True)
    text = flatten_config(read_json(config_path))
    text = {k: v for k, v in text.items() if k not in ("architectures", "quantization_config", "vision_config")}
    out = save_v41_checkpoint(out_dir, text, model, tables.export(), tokenizer_path,
                              Quant(experts=s.expert_format, bf16=True), shard_bytes=1 << 30)
    lm = load_model(out)  # the same checks as any user checkpoint
    loaded = evaluate_loaded(lm, corpus.heldout, s.batch_size)  # the rounding of the stored form included
    sample = greedy_sample(lm, sample_prompt) if sample_prompt else ""
    del model, tables

    res_b = None
    if base_cfg is not None:
        _, _, res_b = train_model(base_cfg, corpus, s, "baseline", None, progress)

    report = TrainReport(s, Path(out), res_e, res_b, zeroed, loaded, stats, time.perf_counter() - t0,
                         sample_prompt, sample, command, torch.get_num_threads())
    curves = {r.name: {"train_steps": r.train_steps, "train_loss": r.train_loss, "eval_steps": r.eval_steps,
                       "eval_loss": r.eval_loss} for r in (res_e, res_b) if r is not None}
    (Path(out) / "train_summary.json").write_text(json.dumps({**report.summary(), "curves": curves}) + "\n")
    if report_dir is not None:
        write_report(report, Path(report_dir))
    log(json.dumps(report.summary(), indent=2))
    return report


# ---- report ------------------------------------------------------------------------------------

def plot_curves(report: TrainReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    runs = [(report.engram, "tab:blue")] + ([(report.baseline, "tab:orange")] if report.baseline else [])
    for r, color in runs:
        y = np.asarray(r.train_loss)
        k = max(1, min(25, len(y) // 10))
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(r.train_steps, y, color=color, alpha=0.15, linewidth=0.8)
        ax.plot(r.train_steps[k - 1:], smooth, color=color, linewidth=1.5,
                label=f"{r.name}: train ({r.params['total'] / 1e6:.2f}M params)")
        ax.plot(r.eval_steps, r.eval_loss, "o--", color=color, markersize=4, label=f"{r.name}: held-out")
    if report.zeroed_heldout is not None:
        ax.axhline(report.zeroed_heldout, color="tab:blue", linestyle=":", linewidth=1,
                   label="engram, output zeroed: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("token cross-entropy (nats)")
    lo = min(min(r.eval_loss) for r, _ in runs)
    ax.set_ylim(max(0.0, lo - 0.5), lo + 4.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tiny DeepSeek-V4.1 model on the Python stdlib (seed %d)" % report.settings.seed)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(report: TrainReport, docs: Path) -> None:
    """docs/TRAINING.md and docs/training_curves.png."""
    docs.mkdir(parents=True, exist_ok=True)
    plot_curves(report, docs / "training_curves.png")
    (docs / "TRAINING.md").write_text(report_markdown(report))


def report_markdown(report: TrainReport) -> str:
    s, e, b, c = report.settings, report.engram, report.baseline, report.corpus_stats
    lines = [
        "# Training the built-in tiny DeepSeek-V4.1 model",
        "",
        "Written by `engram_serve.train` for the run below. `python scripts/train_default.py` is "
        "`engram-serve train --out build/train_default --report-dir docs --install`; `--install` copies the "
        "trained checkpoint (official layout) over `engram_serve/data/tiny`, the built-in model.",
        "",
        "```",
        report.command or "engram-serve train",
        "```",
        "",
        f"Data: Python {c['python']}'s standard library (`{c['stdlib']}`): every `.py` file, site-packages skipped, "
        f"sorted; a file is held out iff `sha256(f\"{{seed}}:{{relative path}}\")` falls in the first "
        f"{s.heldout_pct:g}% (`engram_serve.train.is_heldout`). Train: {c['train_files']} files, "
        f"{c['train_tokens']:,} tokens, {c['train_windows']:,} windows. Held-out: {c['heldout_files']} file(s), "
        f"{c['heldout_tokens']:,} tokens; the evaluation set is {c['eval_windows']} fixed windows "
        f"({c['eval_targets']:,} predicted tokens). Every window is a sequence of {s.seq_len} tokens starting "
        "at position 0, Engram hash ids computed exactly as at inference.",
        "",
        "## Budget",
        "",
        f"- seed {s.seed}; {s.steps} steps x batch {s.batch_size} x {s.seq_len} tokens "
        f"= {s.steps * s.batch_size * s.seq_len:,} training tokens per model, same windows in the same order "
        "for both models",
        f"- AdamW (betas 0.9/0.95), peak lr {s.lr:g} (Engram tables {s.table_lr:g}), {s.warmup_steps} warmup "
        f"steps, cosine decay to {s.min_lr_ratio:g}x, weight decay {s.weight_decay:g} on matrices only, "
        f"gradient clip {s.grad_clip:g}",
        f"- wall time: {report.wall_s / 60:.1f} min in all (tokenizing {c['tokenize_s']:.0f} s, Engram model "
        f"{e.wall_s / 60:.1f} min" + (f", baseline {b.wall_s / 60:.1f} min" if b else "") +
        f") with `torch.set_num_threads({report.threads})` on a 2-core CPU shared with other work, so "
        "times are noisy",
        "",
        f"## Results (held-out mean token cross-entropy, nats; uniform guess = ln({c['vocab_size']}) "
        f"= {math.log(c['vocab_size']):.3f})",
        "",
        "| model | parameters | held-out loss |",
        "|---|---|---|",
        f"| (a) Engram | {e.params['total']:,} (backbone {e.params['backbone']:,} + Engram {e.params['engram']:,}) "
        f"| **{e.final_heldout:.4f}** |",
    ]
    if b is not None:
        lines.append(f"| (b) no Engram, experts widened to match | {b.params['total']:,} "
                     f"({100 * (b.params['total'] / e.params['total'] - 1):+.2f}%) | {b.final_heldout:.4f} |")
    if report.zeroed_heldout is not None:
        lines.append(f"| (c) model (a), Engram output zeroed | (same as a) | {report.zeroed_heldout:.4f} |")
    q = report.settings.expert_format or "BF16"
    lines += ["", f"The shipped checkpoint (FP8 block-scaled linears and Engram tables, routed experts in {q}, the "
              "other matrices in BF16), "
              f"re-loaded with `load_model`, scores {report.loaded_heldout:.4f} on the same set: the rounding costs "
              f"{report.loaded_heldout - e.final_heldout:+.4f} nats.", ""]
    if b is not None:
        d = b.final_heldout - e.final_heldout
        verdict = (f"Engram beat the parameter-matched baseline by {d:.4f} nats ({100 * d / b.final_heldout:.1f}%)"
                   if d > 0 else f"Engram did NOT beat the parameter-matched baseline: it is {-d:.4f} nats worse")
        lines += [f"{verdict} at this budget (one seed, one run each; no error bars). The comparison is "
                  "parameter-matched, not compute-matched: the baseline spends its extra parameters as expert "
                  f"width, so it does more arithmetic per token (its training took {b.wall_s / 60:.1f} min against "
                  f"{e.wall_s / 60:.1f} min), while each token touches only (N-1)*H rows of each Engram table.", ""]
    if report.zeroed_heldout is not None:
        cost = report.zeroed_heldout - e.final_heldout
        lines += [f"Zeroing the Engram output of the trained model changes its held-out loss by {cost:+.4f} nats"
                  + (": the backbone relies on what the tables hold." if cost > 0.05 else "."), ""]
    lines += ["![training curves](training_curves.png)", ""]
    if report.sample:
        lines += ["## Greedy sample", "",
                  f"The written checkpoint through `load_model`, prompt `{report.sample_prompt}`, greedy through "
                  "`forward_dense` (hash ids from `hash_step`, rows from `EngramTables.gather`) for up to "
                  f"{SAMPLE_TOKENS} tokens:", "", "```python", report.sample, "```", ""]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------

def install_weights(out_dir: Path, target: Path = TINY_DIR) -> Path:
    """Copy a trained checkpoint (config, shards, index) into the package's built-in model directory, after
    checking that its tokenizer is exactly the built-in one; then load the result with all checks."""
    if (out_dir / TOKENIZER_FILE).read_bytes() != (target / TOKENIZER_FILE).read_bytes():
        raise ValueError(f"install: {out_dir / TOKENIZER_FILE} differs from {target / TOKENIZER_FILE}")
    for old in [*target.glob("*.safetensors"), target / INDEX_FILE]:
        old.unlink(missing_ok=True)
    for f in [*out_dir.glob("*.safetensors"), out_dir / INDEX_FILE, out_dir / CONFIG_FILE]:
        shutil.copyfile(f, target / f.name)
    load_model(target)
    return target


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="engram-serve train", description=__doc__.splitlines()[0])
    d = TrainSettings()
    ap.add_argument("--out", default="engram-tiny-trained", help="output checkpoint directory")
    ap.add_argument("--config", default=str(TINY_DIR / CONFIG_FILE), help="model config.json (default: built-in)")
    ap.add_argument("--tokenizer", default=str(TINY_DIR / TOKENIZER_FILE), help="tokenizer.json (default: built-in)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--table-lr", type=float, default=d.table_lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--heldout-pct", type=float, default=d.heldout_pct)
    ap.add_argument("--max-files", type=int, default=None, help="only the first N stdlib files (smoke runs)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (0: leave torch's default). 1 by default: on a 2-core machine "
                         "shared with other work, 2 OpenMP threads stall whenever one core is busy (measured "
                         "3x slower per step), 1 thread degrades gracefully")
    ap.add_argument("--expert-format", choices=("float", "fp4", "fp8"), default="float",
                    help="the shipped routed experts (default float32)")
    ap.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                    help="also train the parameter-matched baseline and evaluate with Engram zeroed")
    ap.add_argument("--report-dir", default=None, help="write TRAINING.md and training_curves.png here")
    ap.add_argument("--install", action="store_true",
                    help="copy the trained weights over the built-in model (config and tokenizer must match)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def run_args(args: argparse.Namespace, command: str = "") -> int:
    s = TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      table_lr=args.table_lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                      eval_windows=args.eval_windows, seed=args.seed, heldout_pct=args.heldout_pct,
                      max_files=args.max_files, expert_format=None if args.expert_format == "float" else args.expert_format)
    rep = train(args.out, s, ablation=args.ablation, config_path=args.config, tokenizer_path=args.tokenizer,
                report_dir=args.report_dir, threads=args.threads or None, progress=not args.no_progress,
                command=command)
    if args.install:
        print(f"installed {install_weights(rep.out_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_args(build_parser().parse_args(argv), " ".join(["engram-serve train", *argv]))


if __name__ == "__main__":
    raise SystemExit(main())
