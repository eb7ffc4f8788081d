"""engram-serve against mlx-lm on DeepSeek-V4.1, against llama.cpp, and against CTranslate2 and HF `generate`.

Three suites, each candidate in its own fresh process (spawned, one thread unless said below, an untimed
warm-up call), the timed calls alternating between the candidates round by round with the order rotated, so
that a change in machine load hits every candidate alike; only one candidate runs at a time. tokens/s is taken
at the median call time; the spread is min..max over the rounds; a ratio is the median of the per-round ratios.

`mlx` (the V4.1 peer): engram-serve against mlx-lm 0.32.2's `deepseek_v41` on the SAME random V4.1 config,
weights and prompts, without Engram (mlx-lm has none), float32 (bench/v41_shapes.py: the built-in model's
shape and a mid-size one). The checkpoint is written once (official layout); engram-serve loads it with
`load_model` and runs `LLMEngine` (prefix caching and microbatching off, greedy, exact); mlx-lm loads the
same tensors through `Model.sanitize` and `load_weights` and runs on MLX's CPU device with its
cache-quantization emulation replaced by the identity (as tests/reference/peers_v41.py does), so both compute the
same float32 model (the greedy tokens of every call are compared: `same_tokens`). Workloads:
- `prefill`: one prompt of --prompt tokens to its first token (tokens/s = prompt tokens / call);
- `decode-B`: B prompts of --prompt tokens prefilled (untimed), then --new - 1 greedy steps timed
  (tokens/s = B x (new - 1) / their time). The same prompts every round: mlx-lm prefills them once
  (its float32 prefill of 32 mid-size prompts takes minutes on this BLAS) and each round starts from a
  copy of that cache; engram-serve prefills them again in every call (untimed). mlx-lm's `batch_generate` refuses V4.1's cache ("does not yet
  support batching with history"), so mlx-lm decodes B > 1 as one [B, 1] batch a step through the
  model's own batch dimension (all prompts have the same length: no padding).
Peak memory: `rss_mib` after setup and warm-up (weights, packed panels, caches), `peak_mib` the growth of
the peak resident set over it during the timed calls. The mid-size rows add the physical limits:
prefill as a fraction of the float32 FMA peak of the one core in use (the FLOPs it runs, `prefill_flops`, over the
clock measured in the run x FMA lanes x 2 FMA units x 2 FLOP), B = 1 decode as a fraction of the memory-bandwidth
bound (weight bytes read per token over the copy bandwidth measured in this run), and of the read bound (the same
bytes over the rate one thread streams loads alone at, a float32 sum of 256 MiB: a copy's 2 x size counts its
stores, which a matrix-vector product does not make).

`llama` (unchanged workload): B prompts of 64 random ids, 32 greedy tokens each, end to end, B = 1, 32,
128. CTranslate2 `generate_batch` and HF `generate` run a Llama with the built-in model's hidden size and
depth (vocab 4096, hidden 128, SwiGLU 384, the built-in's 7 layers, 4 heads, 2 KV heads, head_dim 32, random
weights, `transformers.LlamaConfig`; converted in-process for CTranslate2); engram-serve runs its built-in
V4.1 model (Engram on) through `LLMEngine`, microbatching off (`MicrobatchConfig(1)`) and on (2).

`llamacpp` (not run by default: `--suite llamacpp`): engram-serve against llama.cpp's `llama-bench` on a model
of the same size, at each of --thread-counts (default 1 and 2), on the mid shape (bench/llama_bench.py). Two
files are written once and cached (--cache-dir): the mid shape as engram-serve serves it, FP8 linears, MXFP4
experts and BF16 other matrices in the official layout, and a random `qwen3moe` GGUF with the same hidden size,
layers, experts, top-k, expert width, heads and vocabulary, its experts MXFP4, its other matrices Q8_0
(bench/llama_gguf.py says what differs). Each round runs one `llama-bench -p P -n N -d 0,P -r 1 -o json` process
(its own timings: pp P at depth 0, tg N at depth P, so that its decode reads a P-token context as ours does)
alternating with engram-serve's candidates (prefill, decode-B as in the mlx suite, --new default 64). Rows give
tokens/s (median, spread), engram_over_llamacpp (median of the per-round ratios), the peak resident set of each
(llama-bench's VmHWM, read while it runs; engram-serve's worker), and for B = 1 decode each engine's read
bound: the bytes a token reads in the stored formats (every matrix once, k of the routed experts, one embedding
row) over the rate one thread reads at. The llama-bench binary: --llama-bench, else $LLAMA_BENCH, else
/work/llama.cpp-build/bin/llama-bench (scripts/build_llama_cpp.sh builds it); without it, or without the `gguf`
package, the suite yields one row saying what is missing. engram-serve's exact mode runs one thread whatever
the count asked (model_runner.RunnerConfig); the count is passed to the engine all the same.

Needs the `bench` extras: `pip install -e '.[bench]'` (ctranslate2, transformers, mlx-lm with mlx[cpu], gguf).
"""
from __future__ import annotations

import argparse
import importlib.util

from ..errors import ConfigError, UsageError
from . import common

NAME = "peers"


def _builtin_depth() -> int:
    """The built-in model's number of layers: the llama suite's dense Llama has its hidden size and depth."""
    import json

    from .v41_shapes import TINY_CONFIG
    with open(TINY_CONFIG) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["num_hidden_layers"]


SUITES = ("mlx", "llama", "llamacpp")
DEFAULT_SUITES = ("mlx", "llama")
PROMPT, NEW = 64, 32
LLAMA = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=_builtin_depth(),
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
             tie_word_embeddings=False)
CANDIDATES = ("ct2", "hf", "engram_off", "engram_on")
LLAMACPP_NEW = 64
LLAMACPP_SHAPE = "mid"
V41_WORKLOADS = ("prefill", "decode-1", "decode-32")
WARMUP_SEED = 1 << 20  # the untimed call's prompts (the timed prefill rounds use seeds 0, 1, ...)
DECODE_SEED = 0  # decode workloads decode the same prompts every round (mlx-lm prefills them once)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default=",".join(DEFAULT_SUITES),
                        help="comma-separated: mlx (V4.1 against mlx-lm), llama (against CTranslate2 and HF generate), "
                             "llamacpp (against llama-bench; not in the default)")
    parser.add_argument("--rounds", type=common.positive_int, default=5, metavar="N",
                        help="timed calls per candidate and size, alternating between candidates (default 5)")
    parser.add_argument("--shapes", default="builtin,mid", help="mlx suite: V4.1 shapes, comma-separated (builtin, mid)")
    parser.add_argument("--workloads", default=",".join(V41_WORKLOADS),
                        help="mlx and llamacpp suites: prefill and/or decode-B (B prompts decoding together), "
                             "comma-separated")
    parser.add_argument("--prompt", type=common.positive_int, default=PROMPT, metavar="TOKENS",
                        help=f"mlx and llamacpp suites: prompt tokens (default {PROMPT})")
    parser.add_argument("--new", type=common.bounded_int(2, 4096, "must be in [2, 4096]"), default=None, metavar="TOKENS",
                        help=f"mlx and llamacpp suites: generated tokens per prompt in decode workloads (default {NEW}, "
                             f"llamacpp {LLAMACPP_NEW})")
    parser.add_argument("--batch", type=common.positive_int_list, default=[1, 32, 128], metavar="B,...",
                        help="llama suite: prompts per call (default 1,32,128)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="llama suite, comma-separated: " + ", ".join(CANDIDATES))
    parser.add_argument("--thread-counts", type=common.positive_int_list, default=[1, 2], metavar="T,...",
                        help="llamacpp suite: threads of both engines, one set of rounds each (default 1,2)")
    parser.add_argument("--llama-bench", default=None, metavar="PATH",
                        help="llamacpp suite: the llama-bench binary (default $LLAMA_BENCH, else "
                             "/work/llama.cpp-build/bin/llama-bench)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="llamacpp suite: where the checkpoint and GGUF are kept (default ~/.cache/engram-serve)")


def missing_extras(suites: list[str]) -> list[str]:
    """The bench extras a suite cannot run without (the llamacpp suite reports its own: a row saying so)."""
    need = {"mlx": ("mlx_lm", "mlx"), "llama": ("ctranslate2", "transformers"), "llamacpp": ()}
    return [m for s in suites for m in need[s] if importlib.util.find_spec(m) is None]


# ---- the llama suite -------------------------------------------------------------------------------------
def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, bos_token_id=0, eos_token_id=1, pad_token_id=0)).eval()


def _prompts(rng, batch: int, vocab: int, low: int = 2, length: int = PROMPT) -> list[list[int]]:
    return rng.integers(low, vocab, size=(batch, length)).tolist()


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
    import os

    from ctranslate2.converters import TransformersConverter
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
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


def _engine(model, batch: int, max_model_len: int, prompt: int, microbatches: int = 1, threads: int | None = None):
    from ..engine.llm_engine import LLMEngine
    from ..microbatch.plan import MicrobatchConfig
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    loaded = load_model(model)
    cfg = RunnerConfig(max_num_seqs=max(batch, 4), max_model_len=max_model_len,
                       max_num_batched_tokens=max(1024, min(8192, batch * prompt)), num_blocks=max(64, batch * 8),
                       microbatch=MicrobatchConfig(microbatches))
    return LLMEngine(loaded, cfg, enable_prefix_caching=False, threads=threads), loaded


def _setup_engram(batch: int, microbatches: int):
    import numpy as np

    from ..sampling_params import SamplingParams
    eng, loaded = _engine(None, batch, PROMPT + NEW, PROMPT, microbatches)
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

    def call() -> float:
        import time
        t0 = time.perf_counter()
        got = fn()
        if got != want:
            raise RuntimeError(f"{candidate} generated {got} tokens for batch {batch}, expected {want}")
        return time.perf_counter() - t0, None
    return call


# ---- the mlx suite: V4.1 on both engines -----------------------------------------------------------------
def _workload(name: str) -> tuple[str, int]:
    if name == "prefill":
        return "prefill", 1
    kind, _, b = name.partition("-")
    if kind != "decode" or not b.isdigit() or int(b) < 1:
        raise UsageError(f"--workloads: {name!r} is neither prefill nor decode-B (B >= 1)")
    return "decode", int(b)


def _v41_prompts(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np
    return np.random.default_rng(seed).integers(6, vocab, size=(batch, length)).tolist()


def _setup_v41_engram(ckpt: str, kind: str, batch: int, prompt: int, new: int, threads: int | None = None):
    import time

    from ..sampling_params import SamplingParams
    eng, loaded = _engine(ckpt, batch, prompt + new, prompt, threads=threads)
    vocab, calls = loaded.config.vocab_size, [0]

    def call(seed: int) -> tuple[float, list]:
        calls[0] += 1
        prompts = _v41_prompts(seed if kind == "prefill" else DECODE_SEED, batch, prompt, vocab)
        params = SamplingParams(max_tokens=1 if kind == "prefill" else new, temperature=0.0, ignore_eos=True)
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"c{calls[0]}-{i}", p, params)
            out[f"c{calls[0]}-{i}"] = []
        t0 = time.perf_counter()
        first = eng.step().events  # the prefill of every prompt (one step: max_num_batched_tokens holds them)
        t1 = time.perf_counter()
        events = list(first)
        while eng.has_unfinished():
            events += eng.step().events
        t2 = time.perf_counter()
        for e in events:
            if e.token is not None:
                out[e.request_id].append(e.token)
        return (t1 - t0 if kind == "prefill" else t2 - t1), list(out.values())
    return call


def _identity(values, *args, **kwargs):
    return values


def _setup_v41_mlx(ckpt: str, kind: str, batch: int, prompt: int, new: int):
    import glob
    import json
    import os
    import time
    from unittest import mock

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models import deepseek_v41 as mlx_v41
    from safetensors.numpy import load_file
    mx.set_default_device(mx.cpu)
    with open(os.path.join(ckpt, "config.json")) as f:
        text = json.load(f)["text_config"]
    model = mlx_v41.Model(mlx_v41.ModelArgs.from_dict({**text, "model_type": "deepseek_v41"}))
    arrays = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        arrays.update({k: mx.array(v.astype(np.float32)) for k, v in load_file(f).items()})
    model.load_weights(list(model.sanitize(arrays).items()), strict=True)
    mx.eval(model.parameters())
    del arrays

    prefilled: list = []  # decode: the caches after the prompts' prefill, and the first tokens (made once)

    def call(seed: int) -> tuple[float, list]:
        prompts = mx.array(_v41_prompts(seed if kind == "prefill" else DECODE_SEED, batch, prompt, text["vocab_size"]),
                           dtype=mx.int32)  # [B, P]
        with (mock.patch.object(mlx_v41, "_fake_quant_fp8", _identity),
              mock.patch.object(mlx_v41, "_fake_quant_fp4", _identity)):
            cache = model.make_cache()
            t0 = time.perf_counter()
            if kind == "decode" and prefilled:
                for c, state in zip(cache, prefilled[0]):
                    vars(c).update(state)  # (mlx arrays are immutable: the caches share them safely)
                tok = prefilled[1]
            else:
                tok = mx.argmax(model(prompts, cache)[:, -1], axis=-1)  # [B]
                mx.eval(tok)
                if kind == "decode":
                    prefilled[:] = [[dict(vars(c)) for c in cache], tok]
            t1 = time.perf_counter()
            toks = [tok]
            for _ in range(0 if kind == "prefill" else new - 1):
                tok = mx.argmax(model(tok[:, None], cache)[:, -1], axis=-1)
                mx.eval(tok)
                toks.append(tok)
            t2 = time.perf_counter()
        out = np.stack([np.array(t) for t in toks], 1).tolist()  # [B, tokens]
        return (t1 - t0 if kind == "prefill" else t2 - t1), out
    return call


# ---- workers ------------------------------------------------------------------------------------------------
_WORKER: dict = {}


def _worker_setup(spec: tuple, threads: int) -> dict:
    """In the candidate's own process: build it, make one untimed warm-up call, set the memory baseline."""
    import gc

    import torch
    torch.set_num_threads(threads)
    suite, *rest = spec
    if suite == "llama":
        _WORKER["fn"] = setup(*rest)
    else:  # mlx, llamacpp: a V4.1 engine
        engine, ckpt, kind, batch, prompt, new = rest
        if engine == "engram":
            _WORKER["fn"] = _setup_v41_engram(ckpt, kind, batch, prompt, new, threads)
        else:
            _WORKER["fn"] = _setup_v41_mlx(ckpt, kind, batch, prompt, new)
    _WORKER["fn"]() if suite == "llama" else _WORKER["fn"](WARMUP_SEED)
    gc.collect()
    common._malloc_trim()
    setup_peak = common._status_kib("VmHWM")
    rss = common._status_kib("VmRSS") or 0
    _WORKER["base"] = rss if common._reset_peak_rss() else None
    return {"rss_mib": rss / 1024, "setup_peak_mib": None if setup_peak is None else setup_peak / 1024}


def _worker_call(seed: int | None) -> tuple[float, list | None]:
    fn = _WORKER["fn"]
    return fn(seed) if seed is not None else fn()


def _worker_peak() -> float | None:
    base = _WORKER.get("base")
    return None if base is None else max(0, (common._status_kib("VmHWM") or 0) - base) / 1024


def _rounds(specs: dict[str, tuple], rounds: int, threads: int, seeded: bool, local: dict | None = None) -> dict:
    """Alternate timed calls between the candidates (one process each; those in `local` are callables
    `round -> (time, output)` run from here, e.g. one that starts a process per call); returns per candidate
    its times, outputs, and for the processes made here rss_mib, setup_peak_mib and peak_mib."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    local = local or {}
    names = list(specs) + list(local)
    pools = {c: ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) for c in specs}
    res = {c: {"times": [], "outs": []} for c in names}
    try:
        for c in specs:  # one at a time: a setup never competes with another candidate
            res[c].update(pools[c].submit(_worker_setup, specs[c], threads).result())
        for r in range(rounds):
            for c in names[r % len(names):] + names[:r % len(names)]:
                call = local[c] if c in local else lambda s: pools[c].submit(_worker_call, s).result()
                t, out = call(r if seeded else None)
                res[c]["times"].append(t)
                res[c]["outs"].append(out)
        for c in specs:
            res[c]["peak_mib"] = pools[c].submit(_worker_peak).result()
    finally:
        for pool in pools.values():
            pool.shutdown(cancel_futures=True)
    return res


def _speed(row: dict, name: str, work: int, times: list[float]) -> None:
    import statistics
    row[f"{name}_tok_s"] = work / statistics.median(times)
    row[f"{name}_tok_s_min"] = work / max(times)
    row[f"{name}_tok_s_max"] = work / min(times)


def run_llama(args: argparse.Namespace) -> list[dict]:
    import statistics
    cands = [c.strip() for c in args.candidates.split(",")]
    bad = [c for c in cands if c not in CANDIDATES]
    if bad:
        raise UsageError(f"--candidates: unknown {bad}; choose from {list(CANDIDATES)}")
    from .v41_shapes import flops_per_token, llama_flops_per_token, text_config
    tiny = {**text_config("builtin")}
    rows = []
    for b in args.batch:
        res = _rounds({c: ("llama", c, b) for c in cands}, args.rounds, args.threads, seeded=False)
        row: dict = {"suite": "llama", "batch": b, "tokens_per_call": b * NEW, "rounds": args.rounds}
        for c in cands:
            _speed(row, c, b * NEW, res[c]["times"])
        for mine in ("engram_off", "engram_on"):
            for peer in ("ct2", "hf"):
                if mine in cands and peer in cands:
                    row[f"{mine}_over_{peer}"] = statistics.median(
                        p / m for m, p in zip(res[mine]["times"], res[peer]["times"]))
        for c in cands:
            row[f"{c}_rss_mib"], row[f"{c}_peak_mib"] = res[c]["rss_mib"], res[c]["peak_mib"]
        ctx = PROMPT + NEW // 2
        row["llama_mflop_per_token"] = llama_flops_per_token(LLAMA, ctx) / 1e6
        row["v41_builtin_mflop_per_token"] = flops_per_token(tiny, ctx) / 1e6  # (Engram's projection not counted)
        row["threads"] = args.threads
        rows.append(row)
    return rows


def run_mlx(args: argparse.Namespace) -> list[dict]:
    import statistics
    import tempfile
    from pathlib import Path

    from . import v41_shapes as vs
    shapes = [s.strip() for s in args.shapes.split(",")]
    work = [_workload(w.strip()) for w in args.workloads.split(",")]
    facts = vs.cpu_facts()
    bandwidth = [vs.copy_bandwidth()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="engram-peers-v41-") as tmp:
        for shape in shapes:
            ckpt = str(vs.write_checkpoint(shape, Path(tmp) / shape))
            cfg = vs.text_config(shape)
            for kind, b in work:
                new = 1 if kind == "prefill" else (args.new or NEW)
                specs = {e: ("mlx", e, ckpt, kind, b, args.prompt, new) for e in ("engram", "mlx")}
                res = _rounds(specs, args.rounds, args.threads, seeded=True)
                tokens = args.prompt if kind == "prefill" else b * (new - 1)
                row: dict = {"suite": "mlx", "shape": shape, "workload": "prefill" if kind == "prefill" else f"decode-{b}",
                             "batch": b, "prompt": args.prompt, "new": new, "rounds": args.rounds}
                for e in ("engram", "mlx"):
                    _speed(row, e, tokens, res[e]["times"])
                row["engram_over_mlx"] = statistics.median(
                    m / e for e, m in zip(res["engram"]["times"], res["mlx"]["times"]))
                row["same_tokens"] = res["engram"]["outs"] == res["mlx"]["outs"]
                for e in ("engram", "mlx"):
                    row[f"{e}_rss_mib"], row[f"{e}_peak_mib"] = res[e]["rss_mib"], res[e]["peak_mib"]
                if kind == "prefill":
                    row["mflop_per_token"] = vs.prefill_flops(cfg, args.prompt) / args.prompt / 1e6
                else:
                    ctxs = range(args.prompt + 1, args.prompt + new)
                    row["mflop_per_token"] = sum(vs.flops_per_token(cfg, c) for c in ctxs) / len(ctxs) / 1e6
                if shape == "mid":
                    _limits(row, cfg, kind, b, facts, bandwidth, args.threads)
                row["threads"] = args.threads
                rows.append(row)
    bandwidth.append(vs.copy_bandwidth())
    rows.append({"suite": "mlx", "shape": "machine", "cpu": facts["cpu"], "mhz": facts["mhz"],
                 "mhz_reported": facts["mhz_reported"],
                 "fma_lanes": facts["fma_lanes"], "fma_units": facts["fma_units"],
                 "copy_gb_s": max(bandwidth) / 1e9, "copy_gb_s_min": min(bandwidth) / 1e9})
    return rows


def _engram_peak(res: dict) -> float | None:
    """A worker's peak resident set: the larger of its setup's and the timed calls' (rss + growth)."""
    timed = None if res.get("peak_mib") is None else res["rss_mib"] + res["peak_mib"]
    return max((p for p in (res.get("setup_peak_mib"), timed) if p is not None), default=None)


def run_llamacpp(args: argparse.Namespace) -> list[dict]:
    """The llamacpp suite (module docstring): one row per thread count and workload, then the machine's."""
    import os
    import statistics

    from . import v41_shapes as vs
    from .llama_bench import LlamaBench, artifacts, binary, bytes_per_token, cache_root, missing
    from .llama_gguf import GgufShape
    why = missing(args)
    if why is not None:
        return [{"suite": "llamacpp", "skipped": why}]
    work = [_workload(w.strip()) for w in args.workloads.split(",")]
    prompt, new = args.prompt, args.new or LLAMACPP_NEW
    cfg = vs.text_config(LLAMACPP_SHAPE)
    ckpt, gguf_path = artifacts(cache_root(args), LLAMACPP_SHAPE)
    g = GgufShape.of_config(cfg)
    per_token = bytes_per_token(ckpt, gguf_path, cfg)
    reads = [vs.read_bandwidth()]
    rows = []
    for threads in args.thread_counts:
        llama = LlamaBench(binary(args), gguf_path, threads, prompt, new)
        specs = {f"engram_{k}-{b}": ("llamacpp", "engram", str(ckpt), k, b, prompt, 1 if k == "prefill" else new)
                 for k, b in work}
        res = _rounds(specs, args.rounds, threads, seeded=True, local={"llamacpp": llama.call})
        llama_rss = max(o["max_rss_mib"] for o in res["llamacpp"]["outs"])
        for kind, b in work:
            mine = res[f"engram_{kind}-{b}"]
            tokens = prompt if kind == "prefill" else b * (new - 1)
            row: dict = {"suite": "llamacpp", "shape": LLAMACPP_SHAPE, "threads": threads,
                         "workload": "prefill" if kind == "prefill" else f"decode-{b}", "prompt": prompt,
                         "new": 1 if kind == "prefill" else new, "rounds": args.rounds}
            _speed(row, "engram", tokens, mine["times"])
            if b == 1:  # llama-bench runs one sequence: its counterpart
                theirs = [t[kind] for t in res["llamacpp"]["times"]]
                their_tokens = prompt if kind == "prefill" else new
                _speed(row, "llamacpp", their_tokens, theirs)
                row["engram_over_llamacpp"] = statistics.median(
                    (t / their_tokens) / (m / tokens) for m, t in zip(mine["times"], theirs))
                row["llamacpp_max_rss_mib"] = llama_rss
            row["engram_rss_mib"], row["engram_peak_rss_mib"] = mine["rss_mib"], _engram_peak(mine)
            if kind == "decode" and b == 1:
                reads.append(vs.read_bandwidth())
                for e in ("engram", "llamacpp"):
                    row[f"{e}_mib_per_token"] = per_token[e] / 2**20
                    row[f"{e}_read_bound_tok_s"] = reads[-1] / per_token[e]
                    row[f"{e}_fraction_of_read_bound"] = row[f"{e}_tok_s"] / row[f"{e}_read_bound_tok_s"]
                row["read_gb_s"] = reads[-1] / 1e9
            rows.append(row)
    facts = vs.cpu_facts()
    rows.append({"suite": "llamacpp", "shape": "machine", "cpu": facts["cpu"], "cores": os.cpu_count(),
                 "read_gb_s": max(reads) / 1e9, "read_gb_s_min": min(reads) / 1e9,
                 "gguf": f"qwen3moe: {g.heads} heads of {g.head_dim}, {g.kv_heads} KV, {g.experts} experts "
                         f"({g.top_k} a token) of {g.expert_width}, no shared expert",
                 "llama_bench": str(binary(args)), "cache": str(ckpt.parent)})
    return rows


def _limits(row: dict, cfg: dict, kind: str, batch: int, facts: dict, bandwidth: list[float], threads: int) -> None:
    """The physical-limit figures of a mid-size row (module docstring)."""
    from .v41_shapes import copy_bandwidth, read_bandwidth, weight_bytes_per_token
    if kind == "prefill" and facts["mhz"]:
        peak = facts["mhz"] * 1e6 * facts["fma_lanes"] * facts["fma_units"] * 2 * threads
        row["engram_gflop_s"] = row["engram_tok_s"] * row["mflop_per_token"] / 1e3
        row["fma_peak_gflop_s"] = peak / 1e9
        row["engram_fraction_of_fma_peak"] = row["engram_gflop_s"] * 1e9 / peak
    if kind == "decode" and batch == 1:
        bandwidth.append(copy_bandwidth())
        bound = bandwidth[-1] / weight_bytes_per_token(cfg)
        row["weight_mib_per_token"] = weight_bytes_per_token(cfg) / 2**20
        row["bandwidth_bound_tok_s"] = bound
        row["engram_fraction_of_bandwidth_bound"] = row["engram_tok_s"] / bound
        read = read_bandwidth()  # the rate one thread streams loads alone at
        row["read_gb_s"] = read / 1e9
        row["engram_fraction_of_read_bound"] = row["engram_tok_s"] * weight_bytes_per_token(cfg) / read


def run(args: argparse.Namespace) -> list[dict]:
    suites = [s.strip() for s in args.suite.split(",")]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise UsageError(f"--suite: unknown {bad}; choose from {list(SUITES)}")
    from .v41_shapes import SHAPES
    if bad := [s for s in args.shapes.split(",") if s.strip() not in SHAPES]:  # before any work
        raise UsageError(f"--shapes: unknown {bad}; choose from {list(SHAPES)}")
    missing = missing_extras(suites)
    if missing:
        raise ConfigError(f"bench peers needs {', '.join(missing)}: pip install -e '.[bench]'")
    rows = []
    if "mlx" in suites:
        rows += run_mlx(args)
    if "llama" in suites:
        rows += run_llama(args)
    if "llamacpp" in suites:
        rows += run_llamacpp(args)
    return rows
