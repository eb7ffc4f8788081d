"""engram-serve against CTranslate2 and Hugging Face `generate` on one workload, tokens/s and ratios.

Workload, end to end (prefill included): B prompts of 64 random token ids, 32 greedy tokens each
(no early stop), B = 1, 32, 128 by default. Every call draws fresh prompts (so no cache carries over).
- Peers: a Llama with the built-in model's backbone shape (vocab 4096, hidden 128, SwiGLU 384,
  4 layers, 4 heads, 2 KV heads, head_dim 32), random weights, built with `transformers.LlamaConfig`.
  `hf`: `model.generate` (greedy, min_new_tokens = max_new_tokens = 32), torch with one thread.
  `ct2`: the same weights converted in-process by CTranslate2's transformers converter (float32, to a
  temporary directory, offline), `Generator.generate_batch` (greedy, min_length = max_length = 32,
  prompt forwarded at once), intra_threads=1.
- engram-serve: the built-in Engram model (which does more per token: Engram gather and gate, MoE,
  index selection) through `LLMEngine` (the engine under `LLM`), prefix caching off, greedy, with
  microbatching off (`MicrobatchConfig(1)`) and on (`MicrobatchConfig(2)`: the planner cuts a step only
  when a cut hides something). Token ids out, as for the peers (no detokenisation on either side).
Each candidate lives in its own process (spawned fresh, one torch/CTranslate2 thread, a warm-up
call). Timed calls then alternate between the candidates, round by round with the order rotated, so
that a change in machine load hits every candidate alike; only one candidate runs at a time.
tokens/s = B x 32 / median call time; the spread is min..max over the rounds. Needs the `bench`
extras: `pip install -e '.[bench]'` (ctranslate2, transformers).
"""
from __future__ import annotations

import argparse
import importlib.util

from . import common

NAME = "peers"
PROMPT, NEW = 64, 32
LLAMA = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
CANDIDATES = ("ct2", "hf", "engram_off", "engram_on")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=common.positive_int_list, default=[1, 32, 128], metavar="B,...",
                        help="prompts per call (default 1,32,128)")
    parser.add_argument("--rounds", type=common.positive_int, default=5, metavar="N",
                        help="timed calls per candidate and size, alternating between candidates (default 5)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated: " + ", ".join(CANDIDATES))


def missing_extras() -> list[str]:
    return [m for m in ("ctranslate2", "transformers") if importlib.util.find_spec(m) is None]


def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, bos_token_id=0, eos_token_id=1, pad_token_id=0)).eval()


def _prompts(rng, batch: int, vocab: int, low: int = 2) -> list[list[int]]:
    return rng.integers(low, vocab, size=(batch, PROMPT)).tolist()


def _setup_hf(batch: int):
    import numpy as np
    import torch
    model, rng = _llama(), np.random.default_rng(batch)

    def call() -> int:
        ids = torch.tensor(_prompts(rng, batch, LLAMA["vocab_size"]))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
        return (out.shape[1] - PROMPT) * batch
    return call


def _convert_ct2(out_dir: str) -> None:
    """Save the Llama with a word-level tokenizer (token i is "t<i>") and convert it for CTranslate2."""
    from ctranslate2.converters import TransformersConverter
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    import os
    hf_dir = os.path.join(out_dir, "hf")
    _llama().save_pretrained(hf_dir)
    vocab = {f"t{i}": i for i in range(LLAMA["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t0",
                            pad_token="t0").save_pretrained(hf_dir)
    TransformersConverter(hf_dir).convert(os.path.join(out_dir, "ct2"), quantization="float32", force=True)


def _setup_ct2(batch: int):
    import os
    import tempfile

    import ctranslate2
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="engram-peers-")
    _convert_ct2(tmp)
    gen = ctranslate2.Generator(os.path.join(tmp, "ct2"), device="cpu", compute_type="float32", intra_threads=1)
    rng = np.random.default_rng(batch)

    def call() -> int:
        start = [[f"t{i}" for i in p] for p in _prompts(rng, batch, LLAMA["vocab_size"])]
        res = gen.generate_batch(start, max_length=NEW, min_length=NEW, sampling_topk=1,
                                 include_prompt_in_result=False)
        return sum(len(r.sequences_ids[0]) for r in res)
    return call


def _setup_engram(batch: int, microbatches: int):
    import numpy as np

    from ..engine.llm_engine import LLMEngine
    from ..microbatch.plan import MicrobatchConfig
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    from ..sampling_params import SamplingParams
    loaded = load_model()
    cfg = RunnerConfig(max_num_seqs=max(batch, 4), max_model_len=PROMPT + NEW,
                       max_num_batched_tokens=max(1024, min(8192, batch * PROMPT)), num_blocks=max(64, batch * 8),
                       microbatch=MicrobatchConfig(microbatches))
    eng = LLMEngine(loaded, cfg, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    rng, calls = np.random.default_rng(batch), [0]

    def call() -> int:
        calls[0] += 1
        for i, p in enumerate(_prompts(rng, batch, loaded.config.vocab_size, low=6)):
            eng.add_request(f"c{calls[0]}-{i}", p, params)
        n = 0
        while eng.has_unfinished():
            n += sum(e.token is not None for e in eng.step().events)
        return n
    return call


def setup(candidate: str, batch: int):
    if candidate == "hf":
        fn = _setup_hf(batch)
    elif candidate == "ct2":
        fn = _setup_ct2(batch)
    else:
        fn = _setup_engram(batch, 1 if candidate == "engram_off" else 2)
    want = batch * NEW

    def call() -> None:
        got = fn()
        if got != want:
            raise RuntimeError(f"{candidate} generated {got} tokens for batch {batch}, expected {want}")
    return call


_WORKER: dict = {}


def _worker_setup(candidate: str, batch: int, threads: int) -> None:
    """In the candidate's own process: build it and make one untimed warm-up call."""
    import torch
    torch.set_num_threads(threads)
    _WORKER["fn"] = setup(candidate, batch)
    _WORKER["fn"]()


def _worker_call() -> float:
    import time
    t0 = time.perf_counter()
    _WORKER["fn"]()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing
    import statistics
    from concurrent.futures import ProcessPoolExecutor
    missing = missing_extras()
    if missing:
        from ..errors import ConfigError
        raise ConfigError(f"bench peers needs {', '.join(missing)}: pip install -e '.[bench]' "
                          f"(or: pip install 'ctranslate2==4.8.5' transformers)")
    cands = [c.strip() for c in args.candidates.split(",")]
    bad = [c for c in cands if c not in CANDIDATES]
    if bad:
        raise ValueError(f"--candidates: unknown {bad}; choose from {list(CANDIDATES)}")
    rows = []
    for b in args.batch:
        pools = {c: ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) for c in cands}
        try:
            for c in cands:  # one at a time: a setup never competes with another candidate
                pools[c].submit(_worker_setup, c, b, args.threads).result()
            times: dict[str, list[float]] = {c: [] for c in cands}
            for r in range(args.rounds):
                for c in cands[r % len(cands):] + cands[:r % len(cands)]:
                    times[c].append(pools[c].submit(_worker_call).result())
        finally:
            for pool in pools.values():
                pool.shutdown(cancel_futures=True)
        row: dict = {"batch": b, "tokens_per_call": b * NEW, "rounds": args.rounds}
        for c in cands:
            t = times[c]
            row[f"{c}_tok_s"] = b * NEW / statistics.median(t)
            row[f"{c}_tok_s_min"] = b * NEW / max(t)
            row[f"{c}_tok_s_max"] = b * NEW / min(t)
        for mine in ("engram_off", "engram_on"):
            for peer in ("ct2", "hf"):
                if mine in cands and peer in cands:
                    # ratio of medians, and its spread: the median of the per-round ratios
                    row[f"{mine}_over_{peer}"] = row[f"{mine}_tok_s"] / row[f"{peer}_tok_s"]
                    row[f"{mine}_over_{peer}_round_median"] = statistics.median(
                        p / m for m, p in zip(times[mine], times[peer]))
        row["threads"] = args.threads
        rows.append(row)
    return rows
