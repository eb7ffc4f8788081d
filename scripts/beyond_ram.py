"""Serve a DeepSeek-V4.1 checkpoint larger than this machine's memory, and check it against the float64 reference.

    python scripts/beyond_ram.py CHECKPOINT [--new 3] [--decode 64] [--only check|decode] [--plain-paging]

The checkpoint's routed experts (MXFP4), FP8 linears and BF16 matrices stay where the loader maps them
(model/weights.py): a step pages in the experts its tokens choose, read ahead together once the router chose them
(`Mxfp4Experts.prefetch`; --plain-paging: each page read when a product first touches it). Drop the page cache
before a cold run (`echo 3 > /proc/sys/vm/drop_caches`). The script prints, as JSON lines:
- `load`: seconds and resident memory (anonymous, mapped files) after `load_model`;
- `check`: 4 short prompts, greedy, --new tokens each: every prompt and generated token's logprob against the float64
  reference (tests/reference/reference_v41.py, which reads the checkpoint through a mapping: of the routed experts
  only those a token chooses, of the Engram tables only the rows it reads) at the positions where it finds no near
  tie float32 could flip (a router's, an indexer's: `tainted`), the greedy tokens against its argmax, and the same
  prompts once more (warm pages) bit for bit, and once more with the other paging (plain or read ahead) bit for bit;
- `decode`: --decode greedy tokens of one request, tok/s and resident memory every 8 tokens, while 3 more requests
  decode beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "reference")]

PROMPTS = ["def fib(n):", "The capital of France", "import numpy as", "Once upon a time"]


def resident() -> dict[str, float]:
    status = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    return {"anon_mib": round(status["RssAnon"], 1), "file_mib": round(status["RssFile"], 1)}


class Dequantized(Mapping):
    """The checkpoint's tensors as float32 under their official names, read and dequantized when asked for (the
    reference's weights): FP8 block-scaled and MXFP4 ones dequantized, BF16 cast; an Engram table as a row reader."""

    def __init__(self, path: Path):
        from engram_serve.model.checkpoint import CheckpointFiles
        self.files = CheckpointFiles.open(path)

    def __getitem__(self, name: str):
        from engram_serve.engram.quantized import Fp8Table, dequantize_rows
        from engram_serve.model import loader
        dtype, shape = self.files.info(name)
        if ".engram.embed." in name:
            table = self.files.tensor(name, writable=False)
            if dtype != loader.FP8_CODE:
                return table
            scales = self.files.tensor(loader.scale_name(name), writable=False)
            return _Rows(Fp8Table(table, scales), dequantize_rows)
        if dtype in loader.FP4_CODES:
            return loader.read_fp4(self.files, name, [shape[0], shape[1] * 2])
        return loader.read_weight(self.files, name, shape)[0]

    def __iter__(self):
        return iter(self.files.keys())

    def __len__(self):
        return len(self.files.keys())

    def __contains__(self, name) -> bool:
        return name in self.files


class _Rows:
    def __init__(self, table, dequantize_rows):
        self.table, self.dequantize_rows = table, dequantize_rows

    def __getitem__(self, row: int) -> torch.Tensor:
        w, s = self.table.weight[row:row + 1], self.table.scale[row:row + 1]
        return self.dequantize_rows(w, s, torch.empty(w.shape))[0]


def check(path: Path, loaded, new: int) -> dict:
    from reference_v41 import reference_forward
    from v41_fixtures import engram_hash_ids

    from engram_serve.config import flatten_config, read_json
    from engram_serve.llm import LLM
    from engram_serve.sampling_params import SamplingParams
    cfg = flatten_config(read_json(path / "config.json"))
    llm = LLM(loaded, max_num_seqs=4, max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=new, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    t0 = time.perf_counter()
    cold = llm.generate(PROMPTS, params)
    cold_s = time.perf_counter() - t0
    warm = llm.generate(PROMPTS, params)
    ahead = prefetching(loaded)
    set_prefetch(loaded, not ahead)  # the other paging, in an engine of its own (its CPU graphs captured so)
    other = LLM(loaded, max_num_seqs=4, max_model_len=256, enable_prefix_caching=False).generate(PROMPTS, params)
    set_prefetch(loaded, ahead)
    weights, worst, greedy, clean, tainted, near = Dequantized(path), 0.0, True, 0, 0, []
    vocab = loaded.tokenizer.get_vocab_size(with_added_tokens=True)
    for out in cold:
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        ref = reference_forward(cfg, weights, ids, engram_hash_ids(cfg, ids, token_map=loaded.token_map))
        logprobs = torch.log_softmax(ref.logits[:, :vocab], -1)  # over the tokens the engine samples from
        scored = [lp[0] for lp in out.prompt_logprobs[1:]] + [lp for lp, _ in out.logprobs]  # of ids[1:]
        for pos, (tok, lp) in enumerate(zip(ids[1:], scored)):  # the logprob of ids[pos + 1] at position pos
            if ref.tainted(pos):  # a near tie float32 could flip at or before pos: not comparable
                tainted += 1
                near.append(abs(lp - float(logprobs[pos][tok])))
                continue
            clean += 1
            worst = max(worst, abs(lp - float(logprobs[pos][tok])))
            greedy &= pos < len(out.prompt_token_ids) - 1 or int(logprobs[pos].argmax()) == tok
    def same(xs, ys) -> bool:
        return all(a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs
                   for a, b in zip(xs, ys))
    return {"prompts": len(PROMPTS), "new_tokens": new, "compared_positions": clean, "tainted_positions": tainted,
            "tainted_within_1e-4": sum(d <= 1e-4 for d in near), "tainted_max_diff": max(near, default=0.0),
            "max_logprob_diff": worst, "greedy_equal": greedy, "cold_equals_warm_bit_for_bit": same(cold, warm),
            "read_ahead": ahead, "other_paging_equal_bit_for_bit": same(cold, other),
            "cold_seconds": round(cold_s, 2), **resident()}


def moes(loaded) -> list:
    from engram_serve.model.deepseek_v41 import MoE
    return [m for m in loaded.model.modules() if isinstance(m, MoE) and m.stored is not None]


def prefetching(loaded) -> bool:
    return all(m.stored.prefetch for m in moes(loaded))


def set_prefetch(loaded, on: bool) -> None:
    for m in moes(loaded):
        m.stored.prefetch = on


def decode(loaded, tokens: int) -> list[dict]:
    """4 requests decoding --decode greedy tokens together: every 8 steps, the window's tok/s and resident memory."""
    from engram_serve.llm import LLM
    from engram_serve.sampling_params import SamplingParams
    llm = LLM(loaded, max_num_seqs=4, max_model_len=512, enable_prefix_caching=False)
    engine, params = llm.engine, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"decode-{i}", loaded.tokenizer.encode(prompt).ids, params)
    rows, steps, t0 = [], 0, time.perf_counter()
    last, made = t0, 0
    while engine.has_unfinished():
        made += sum(1 for s in engine.seqs.values() if not s.is_finished)
        engine.step()
        steps += 1
        if steps % 8 == 0 or not engine.has_unfinished():
            now = time.perf_counter()
            rows.append({"step": steps, "elapsed_s": round(now - t0, 2), "tok_s": round(made / (now - last), 1),
                         **resident()})
            last, made = now, 0
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--new", type=int, default=3)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--only", choices=("check", "decode"), default=None,
                   help="one part alone (the reference's float64 weights take memory from the page cache)")
    p.add_argument("--plain-paging", action="store_true",
                   help="no read-ahead of the experts a step chose: each page read when a product touches it")
    args = p.parse_args()
    from engram_serve.model.loader import load_model
    torch.set_num_threads(1)
    before = resident()
    t0 = time.perf_counter()
    loaded = load_model(args.checkpoint, pin_tables=False)
    set_prefetch(loaded, not args.plain_paging)
    print(json.dumps({"load": {"seconds": round(time.perf_counter() - t0, 2), "before": before, "after": resident(),
                                "read_ahead": prefetching(loaded)}}),
          flush=True)
    if args.only != "decode":
        print(json.dumps({"check": check(args.checkpoint, loaded, args.new)}), flush=True)
    if args.only != "check":
        for row in decode(loaded, args.decode):
            print(json.dumps({"decode": row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
