"""Train the DSpark drafter (`mtp.*`, model/dspark.py) of a frozen target: the built-in model by default.

    engram-serve train-drafter [--out DIR] [--steps N] [--install] ...
    python scripts/train_drafter_default.py       (the run that produced the shipped drafter)

As NeMo Automodel trains it (components/speculative/dspark/, models/deepseek_v41/dspark.py), with the target
frozen: per step, windows of the stdlib's training files (engram_serve/train.py's data, split by file, seeded)
go through the target under no_grad (`forward_dense(features=True)`: its logits and the drafter's features); in
each window `anchors` positions a are drawn uniformly without replacement; the block [x[a], noise x (k - 1)] at
positions a .. a + k - 1 reads the context keys of a - W .. a - 1 and predicts x[a + 1 .. a + k], the Markov
head's prevs teacher-forced (prev_0 = x[a], prev_j = x[a + j]). The forward is the serving one (`write_context`
then `draft`, whose `pick` returns the true tokens), so training and serving cannot drift apart.

Loss per block position, equally weighted (NeMo's default: no decay), NeMo's three terms and weights:
0.1 * cross-entropy against the data's token + 0.9 * the L1 distance between the draft's and the target's next-token
probabilities (2x the total variation; 1 - L1 / 2 is the probability that a sampled draft token is accepted) +
1.0 * binary cross-entropy of the confidence head against that acceptance probability (detached). Unlike NeMo,
anchors leave room for a whole block inside the window (no partially supervised blocks at a window's end).

The target is never written: its parameters have requires_grad off and are not in the optimizer, and the run
checks a digest of them before and after (`param_digest`). `DrafterSettings.train_embedding_head` (off; NeMo
refuses it for V4.1) puts the target's embedding and head into the optimizer, the negative control of that check.
The checkpoint written is the target's, its tensors byte for byte, with the drafter's `mtp.*` added in the
writer's stored forms and its `dspark_*` fields in config.json (`add_drafter`).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from .config import ModelConfig, read_json
from .model.checkpoint import INDEX_FILE
from .model.deepseek_v41 import DeepseekV41, init_weights
from .model.dspark import DSpark, DSparkState
from .model.loader import CONFIG_FILE, TINY_DIR, TOKENIZER_FILE, LoadedModel, load_model
from .model.writer import Quant, official_tensors, shard_file, write_index
from .train import WindowHasher, load_corpus, loaded_hasher, lr_factor, staged_rows, stdlib_root

# The built-in model's drafter: one draft layer (its cost stays a fraction of a target step), blocks of 5, the
# streams entering the last three target layers, a small MoE and Markov head. The noise token is <|image|> (id
# 5): a special token the stdlib's sources never contain and text requests never carry (image inputs are refused).
TINY_DSPARK = {"num_nextn_predict_layers": 1, "dspark_block_size": 5, "dspark_noise_token_id": 5,
               "dspark_target_layer_ids": [4, 5, 6], "dspark_markov_rank": 32, "dspark_n_routed_experts": 2,
               "dspark_num_experts_per_tok": 1}
# The built-in checkpoint's stored forms (FP8 linears, BF16 experts and other matrices): the drafter's follow them.
TINY_QUANT = Quant(linears=True, experts=None, tables=True, bf16=True)


@dataclass(frozen=True)
class DrafterSettings:
    """One run's budget; equal settings see the same windows and anchors in the same order."""

    steps: int = 500
    batch_size: int = 8  # windows per step
    seq_len: int = 256
    anchors: int = 32  # blocks per window
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # matrices only
    grad_clip: float = 1.0
    init_std: float = 0.05
    ce_weight: float = 0.1  # NeMo's ce_loss_alpha
    l1_weight: float = 0.9  # NeMo's l1_loss_alpha
    confidence_weight: float = 1.0  # NeMo's confidence_head_alpha
    eval_every: int = 100
    eval_windows: int = 32
    seed: int = 0
    heldout_pct: float = 5.0
    max_files: int | None = None
    train_embedding_head: bool = False  # the negative control only: the target's embedding and head trained too


def with_drafter_fields(text: dict, fields: dict = TINY_DSPARK) -> dict:
    """A text config with the drafter's fields: `compress_ratios` gains a 0 per draft layer (NeMo's layers
    num_hidden_layers + i are window-only)."""
    n = text["num_hidden_layers"]
    return {**text, **fields, "compress_ratios": list(text["compress_ratios"][:n]) + [0] * fields["num_nextn_predict_layers"]}


def param_digest(module: nn.Module) -> str:
    """sha256 of every parameter and buffer's bytes, by name (float parameters held as stored included)."""
    h = hashlib.sha256()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for name, m in module.named_modules():
        stored = getattr(m, "stored", None)
        for part in getattr(stored, "parts", ()):
            h.update(name.encode())
            for x in part[:2]:
                if x is not None:  # (BF16 weights have no scales)
                    h.update(x.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---- one step ------------------------------------------------------------------------------------------

def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, block: int, anchors: int) -> np.ndarray:
    """[B, A] int64 sorted anchor positions per window, uniform without replacement over 0 .. S - 1 - k (each
    block's k targets inside the window)."""
    room = seq_len - block
    if anchors > room:
        raise ValueError(f"anchors={anchors}: a window of {seq_len} tokens has {room} whole blocks of {block}")
    return np.sort(np.stack([rng.choice(room, anchors, replace=False) for _ in range(batch)]), 1).astype(np.int64)


@dataclass
class Teacher:
    """What the frozen target gives for windows x [B, S]: logits [B, S, V] and the drafter's features [B, S, F]."""

    logits: torch.Tensor
    features: torch.Tensor


@torch.no_grad()
def teacher(target: DeepseekV41, x: torch.Tensor, rows: list[torch.Tensor] | None) -> Teacher:
    logits, feats = target.forward_dense(x, rows, features=True)
    return Teacher(logits, feats)


def drafter_loss(target: DeepseekV41, drafter: DSpark, x: torch.Tensor, anchors: torch.Tensor, t: Teacher,
                 s: DrafterSettings) -> tuple[torch.Tensor, dict]:
    """The loss of the blocks at `anchors` [B, A] of windows x [B, S] (module docstring), and its terms: `ce`, `l1`,
    `confidence` and `accept` [k] (the fraction of blocks whose first j greedy draft tokens all equal the target's
    greedy tokens, teacher-forced)."""
    b, seq = x.shape
    k, a = drafter.block, anchors.shape[1]
    state = DSparkState(drafter.config, b, seq, max_rows=b * a)
    pos = torch.arange(seq).repeat(b)
    drafter.write_context(state, t.features.reshape(b * seq, -1), pos, torch.arange(b * seq))  # window w: slots w*S..
    offs = anchors.reshape(-1, 1) + 1 + torch.arange(k)  # [R, k] the positions each block predicts
    wid = torch.arange(b).repeat_interleave(a)  # [R] each block's window
    labels = x[wid[:, None], offs]  # [R, k] the data's tokens
    out = drafter.draft(target, state, x[wid, anchors.reshape(-1)], anchors.reshape(-1), wid[:, None], seq,
                        pick=lambda j, z: labels[:, j])  # teacher-forced prevs
    z = out.logits  # [R, k, V]
    tl = t.logits[wid[:, None], offs - 1]  # [R, k, V] the target's distribution for the same tokens
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1))
    dist = (torch.softmax(z, -1) - torch.softmax(tl, -1)).abs().sum(-1)  # [R, k] L1 between the distributions
    loss = s.ce_weight * ce + s.l1_weight * dist.mean()
    conf = torch.zeros(())
    if out.confidence is not None:
        conf = F.binary_cross_entropy_with_logits(out.confidence, (1 - 0.5 * dist).clamp(0, 1).detach())
        loss = loss + s.confidence_weight * conf
    with torch.no_grad():
        hit = (z.argmax(-1) == tl.argmax(-1)).int().cumprod(1).float().mean(0)  # [k]
    return loss, {"ce": float(ce.detach()), "l1": float(dist.detach().mean()), "confidence": float(conf.detach()),
                  "accept": hit.tolist()}


def make_optimizer(drafter: DSpark, target: DeepseekV41, s: DrafterSettings) -> torch.optim.AdamW:
    """AdamW over the drafter's parameters (weight decay on matrices); the target's embedding and head join only
    with `s.train_embedding_head` (the negative control)."""
    params = list(drafter.named_parameters())
    if s.train_embedding_head:
        extra = [target.embed.weight] + ([target.head.weight] if target.head is not None else [])
        for p in extra:
            p.requires_grad_(True)
        params += [(f"target.{i}", p) for i, p in enumerate(extra)]
    decay = [p for n, p in params if p.ndim >= 2]
    rest = [p for n, p in params if p.ndim < 2]
    groups = [{"params": decay, "lr": s.lr, "weight_decay": s.weight_decay},
              {"params": rest, "lr": s.lr, "weight_decay": 0.0}]
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)


def train_step(target: DeepseekV41, drafter: DSpark, opt: torch.optim.AdamW, x: torch.Tensor, anchors: torch.Tensor,
               rows: list[torch.Tensor] | None, s: DrafterSettings, step: int) -> dict:
    """One optimizer step on windows x [B, S] (Engram rows `rows` of the target); its loss terms."""
    t = teacher(target, x, rows)
    f = lr_factor(step, s)
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * f
    loss, terms = drafter_loss(target, drafter, x, anchors, t, s)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], s.grad_clip)
    opt.step()
    return {"loss": float(loss.detach()), **terms}


def new_drafter(cfg: ModelConfig, s: DrafterSettings) -> DSpark:
    torch.manual_seed(s.seed)
    return init_weights(DSpark(cfg), s.seed + 7, s.init_std).train()


@torch.no_grad()
def evaluate(lm: LoadedModel, drafter: DSpark, hasher: WindowHasher, windows: np.ndarray, s: DrafterSettings) -> dict:
    """Mean loss terms over fixed held-out windows and anchors (seeded apart from training)."""
    was = drafter.training
    drafter.eval()
    rng = np.random.default_rng(s.seed + 1_000_003)
    acc, n = None, 0
    for i in range(0, len(windows), s.batch_size):
        x = torch.from_numpy(windows[i:i + s.batch_size, :s.seq_len])
        anchors = torch.from_numpy(sample_anchors(rng, x.shape[0], s.seq_len, drafter.block, s.anchors))
        loss, terms = drafter_loss(lm.model, drafter, x, anchors, teacher(lm.model, x, staged_rows(lm, hasher, x)), s)
        vals = {"loss": float(loss), **terms}
        acc = {k: np.asarray(v) * x.shape[0] + (0 if acc is None else acc[k]) for k, v in vals.items()}
        n += x.shape[0]
    drafter.train(was)
    return {k: (v / n).tolist() for k, v in acc.items()}


# ---- the checkpoint ------------------------------------------------------------------------------------

def copy_with_drafter_fields(src: Path, out: Path, fields: dict = TINY_DSPARK) -> Path:
    """`out` = the checkpoint `src` (tensors, index, tokenizer, byte for byte), its config.json with the drafter's
    fields (no `mtp.*` tensors yet: it loads without a drafter)."""
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / INDEX_FILE).read_text())
    for name in sorted(set(index["weight_map"].values())) + [INDEX_FILE, TOKENIZER_FILE]:
        shutil.copyfile(src / name, out / name)
    cfg = read_json(src / CONFIG_FILE)
    if "text_config" in cfg:
        cfg["text_config"] = with_drafter_fields(cfg["text_config"], fields)
    else:
        cfg = with_drafter_fields(cfg, fields)
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def add_drafter(out: Path, drafter: DSpark, quant: Quant = TINY_QUANT) -> Path:
    """Write the drafter's `mtp.*` tensors (the writer's stored forms under `quant`) into the one shard of the
    checkpoint `out`, beside the target's tensors (read and written back as stored: their bytes do not change),
    replacing `mtp.*` tensors that were there; the index follows."""
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    if shards != [shard_file(0, 1)]:
        raise ValueError(f"add_drafter: {out} has shards {shards}; it writes into one shard ({shard_file(0, 1)})")
    tensors = {k: v for k, v in load_file(str(out / shards[0])).items() if not k.startswith("mtp.")}
    tensors.update(official_tensors(None, None, quant, drafter))
    save_file(tensors, str(out / shards[0]), metadata={"format": "pt"})
    write_index(out, [sorted(tensors)], sum(t.numel() * t.element_size() for t in tensors.values()))
    return out


def install(out: Path, target: Path = TINY_DIR) -> Path:
    """Copy config.json, the shard and the index of `out` over the built-in model (its tokenizer must be the
    built-in one); then load the result with every check, the drafter included."""
    if (out / TOKENIZER_FILE).read_bytes() != (target / TOKENIZER_FILE).read_bytes():
        raise ValueError(f"install: {out / TOKENIZER_FILE} differs from {target / TOKENIZER_FILE}")
    for f in [out / shard_file(0, 1), out / INDEX_FILE, out / CONFIG_FILE]:
        shutil.copyfile(f, target / f.name)
    if load_model(target, pin_tables=False).drafter is None:
        raise ValueError(f"install: {target} loads without a drafter")
    return target


# ---- the run -------------------------------------------------------------------------------------------

@dataclass
class DrafterReport:
    settings: DrafterSettings
    out_dir: Path
    fields: dict
    params: int
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "loss", "ce", "l1", "confidence", "accept"}
    train_s: float = 0.0
    acceptance: list[dict] = field(default_factory=list)  # bench/acceptance.py rows of the written checkpoint
    target_digest: str = ""
    command: str = ""

    def summary(self) -> dict:
        return {"settings": dataclasses.asdict(self.settings), "out_dir": str(self.out_dir), "fields": self.fields,
                "params": self.params, "train_s": round(self.train_s, 1), "evals": self.evals,
                "acceptance": self.acceptance, "target_digest": self.target_digest, "command": self.command}


def train_drafter(out_dir: str | Path, s: DrafterSettings | None = None, *, target_dir: str | Path = TINY_DIR,
                  fields: dict = TINY_DSPARK, quant: Quant = TINY_QUANT, measure: bool = True,
                  progress: bool = True, command: str = "") -> DrafterReport:
    """Train a drafter for the checkpoint `target_dir`, write target + drafter to `out_dir`, measure acceptance
    on held-out code (bench/acceptance.py) with the written checkpoint."""
    from .bench import acceptance

    s = s or DrafterSettings()
    log = print if progress else (lambda *a, **k: None)
    out = copy_with_drafter_fields(Path(target_dir), Path(out_dir), fields)
    lm = load_model(out, pin_tables=False)
    target, cfg = lm.model, lm.config
    hasher = loaded_hasher(lm)
    log(f"tokenizing the stdlib under {stdlib_root()} ...")
    corpus = load_corpus(lm.tokenizer, s.seq_len, cfg.eos_token_id, s.seed, s.heldout_pct, s.eval_windows, s.max_files)
    drafter = new_drafter(cfg, s)
    rep = DrafterReport(s, out, fields, sum(p.numel() for p in drafter.parameters()), command=command)
    before = param_digest(target)
    opt = make_optimizer(drafter, target, s)
    order, anchor_rng = np.random.default_rng(s.seed), np.random.default_rng(s.seed + 1)
    perm, cursor = order.permutation(len(corpus.train)), 0
    t0 = time.perf_counter()
    bar = tqdm(range(s.steps), desc="train drafter", disable=not progress, mininterval=2.0, dynamic_ncols=True)
    for step in bar:
        if cursor + s.batch_size > len(perm):
            perm, cursor = order.permutation(len(corpus.train)), 0
        x = torch.from_numpy(corpus.train[perm[cursor:cursor + s.batch_size], :s.seq_len])  # [B, S]
        cursor += s.batch_size
        anchors = torch.from_numpy(sample_anchors(anchor_rng, x.shape[0], s.seq_len, drafter.block, s.anchors))
        terms = train_step(target, drafter, opt, x, anchors, staged_rows(lm, hasher, x), s, step)
        rep.steps.append(step + 1)
        rep.losses.append(terms["loss"])
        bar.set_postfix(loss=f"{terms['loss']:.3f}", refresh=False)
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            ev = {"step": step + 1, **evaluate(lm, drafter, hasher, corpus.heldout, s)}
            rep.evals.append(ev)
            bar.write(f"[drafter] step {step + 1}/{s.steps}  held-out loss {ev['loss']:.4f}  "
                      f"accept@1..{drafter.block} " + " ".join(f"{a:.3f}" for a in ev["accept"]))
    bar.close()
    rep.train_s = time.perf_counter() - t0
    rep.target_digest = param_digest(target)
    if rep.target_digest != before:
        raise RuntimeError("train-drafter: the target's parameters changed during training")
    add_drafter(out, drafter.eval(), quant)
    if measure:
        shipped = load_model(out, pin_tables=False)
        rep.acceptance = acceptance.measure(shipped, acceptance.heldout_prompts(shipped.tokenizer, s.seed,
                                                                                s.heldout_pct, s.max_files))
        log(acceptance.format_rows(rep.acceptance))
    (out / "drafter_summary.json").write_text(json.dumps({**rep.summary(), "losses": rep.losses}) + "\n")
    return rep


def report_markdown(rep: DrafterReport) -> str:
    """docs/drafter.md: the run, the held-out terms, the acceptance on held-out code."""
    s, last = rep.settings, rep.evals[-1]
    k = len(last["accept"])
    lines = ["# Training the built-in model's DSpark drafter", "",
             "Written by `engram_serve.train_drafter` for the run below (`--install` copies the checkpoint, the "
             "target's tensors unchanged plus `mtp.*`, over `engram_serve/data/tiny`).", "",
             "```", rep.command or "engram-serve train-drafter", "```", "",
             f"Drafter: `{json.dumps(rep.fields)}`, {rep.params:,} parameters (the target's embedding and head "
             "shared, not counted). Target frozen; its parameter digest before and after the run: equal "
             f"(`{rep.target_digest[:16]}`).", "",
             f"Budget: seed {s.seed}; {s.steps} steps x {s.batch_size} windows of {s.seq_len} tokens x "
             f"{s.anchors} anchors; AdamW (0.9/0.95), lr {s.lr:g}, {s.warmup_steps} warmup steps, cosine to "
             f"{s.min_lr_ratio:g}x, weight decay {s.weight_decay:g}, clip {s.grad_clip:g}; loss {s.ce_weight:g} CE + "
             f"{s.l1_weight:g} L1 + {s.confidence_weight:g} confidence (NeMo's). {rep.train_s / 60:.1f} min with "
             f"`torch.set_num_threads({torch.get_num_threads()})`.", "",
             "## Held-out windows, teacher-forced", "",
             "| step | loss | CE | L1 | " + " | ".join(f"greedy match @{j + 1}" for j in range(k)) + " |",
             "|---:|---:|---:|---:|" + "---:|" * k]
    for ev in rep.evals:
        lines.append(f"| {ev['step']} | {ev['loss']:.4f} | {ev['ce']:.4f} | {ev['l1']:.4f} | "
                     + " | ".join(f"{a:.3f}" for a in ev["accept"]) + " |")
    if rep.acceptance:
        from .bench.acceptance import markdown_table
        lines += ["", "## Acceptance on held-out code (`engram-serve bench acceptance`)", "",
                  markdown_table(rep.acceptance)]
    return "\n".join(lines) + "\n"


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="engram-serve train-drafter", description=__doc__.splitlines()[0])
    d = DrafterSettings()
    ap.add_argument("--out", default="engram-tiny-drafter", help="output checkpoint directory")
    ap.add_argument("--target", default=str(TINY_DIR), help="the target checkpoint (default: built-in)")
    for name in ("steps", "batch_size", "seq_len", "anchors", "warmup_steps", "eval_every", "eval_windows", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--max-files", type=int, default=None, help="only the first N stdlib files (smoke runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--no-measure", action="store_true", help="skip the acceptance measurement")
    ap.add_argument("--report-dir", default=None, help="write drafter.md here")
    ap.add_argument("--install", action="store_true", help="copy the result over the built-in model")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def run_args(args: argparse.Namespace, command: str = "") -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    s = DrafterSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, anchors=args.anchors,
                        lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                        eval_windows=args.eval_windows, seed=args.seed, max_files=args.max_files)
    rep = train_drafter(args.out, s, target_dir=args.target, measure=not args.no_measure,
                        progress=not args.no_progress, command=command)
    if args.report_dir:
        Path(args.report_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.report_dir) / "drafter.md").write_text(report_markdown(rep))
    if args.install:
        print(f"installed {install(rep.out_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_args(build_parser().parse_args(argv), " ".join(["engram-serve train-drafter", *argv]))


if __name__ == "__main__":
    raise SystemExit(main())
