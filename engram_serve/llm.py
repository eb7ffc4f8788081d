"""Offline generation: `LLM(model).generate(prompts, params) -> list[RequestOutput]`, and the CLI's
`engram-serve generate` (`add_generate_args` / `run_generate`).

    llm = LLM()                      # the built-in tiny model; or LLM("path/to/checkpoint", max_num_seqs=8)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.8, seed=1))
    print(out[0].text, out[0].finish_reason)

Engine options are `RunnerConfig` fields (max_num_seqs, max_model_len, split, ...) plus
`enable_prefix_caching`; an unknown option raises ConfigError naming it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

from .errors import ConfigError, InvalidRequest

Prompt = Union[str, Sequence[int]]


@dataclass
class RequestOutput:
    """The result of one request. `text` is the decoded output (cut before a stop string);
    `token_ids` every sampled token (including an EOS or the tokens of a stop string); `error` is
    set when `finish_reason == "error"`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def load(model=None, progress: bool = False, device: str = "cpu"):
    """A LoadedModel from a path or None (the built-in tiny model) with its weights on `device`; a
    LoadedModel is returned as is (moved to `device` if it is elsewhere). With `progress`, a tqdm bar
    on stderr follows the loading stages."""
    import torch

    from .model.loader import LoadedModel, load_model
    if isinstance(model, LoadedModel):
        if model.model.embed_tokens.weight.device.type != torch.device(device).type:
            model.model.to(device)
        return model
    if not progress:
        return load_model(model, device=device)
    from tqdm import tqdm
    with tqdm(total=1, desc="loading", unit="tensor", file=sys.stderr, leave=False,
              postfix="config, tokenizer, compressed token map") as bar:
        def note(done: int, total: int, what: str) -> None:
            if bar.total != total:
                bar.reset(total=total)
            bar.n = done
            bar.set_postfix_str(what[-40:], refresh=False)
            bar.refresh()
        loaded = load_model(model, progress=note, device=device)
    return loaded


def build_engine(model=None, *, enable_prefix_caching: bool = True, progress: bool = False,
                 tensor_parallel_size: int = 1, dist_init: str | None = None, cluster=None, **runner_options):
    """An LLMEngine over `model` (path, None or LoadedModel); `runner_options` are RunnerConfig fields
    (`device="cuda"` places weights, KV cache and staging buffers on the GPU; tables stay on the host).

    `tensor_parallel_size=N` (N >= 2) starts N-1 worker processes (or joins a torchrun group with
    `dist_init="env://"`); this process is rank 0 and owns the scheduler. The engine's close stops them.
    `cluster`: run on an existing TPCluster instead (its owner closes it), e.g. several engines in turn."""
    from .engine.llm_engine import LLMEngine
    from .runner.model_runner import RunnerConfig
    known = {f.name for f in dataclasses.fields(RunnerConfig)}
    unknown = sorted(set(runner_options) - known)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {unknown}; known: enable_prefix_caching, "
                          f"tensor_parallel_size, {sorted(known)}")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size!r}: must be an integer >= 1")
    options = dict(runner_options)
    device = options.get("device", "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ConfigError(f"device={device!r}: must be 'cpu' or 'cuda'")
    if str(device).startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r}: CUDA is not available in this torch build")
    if tensor_parallel_size == 1 and dist_init is None and cluster is None:
        loaded = load(model, progress, device=device)
        options.setdefault("max_model_len", min(RunnerConfig().max_model_len, loaded.config.max_position_embeddings))
        return LLMEngine(loaded, RunnerConfig(**options), enable_prefix_caching=enable_prefix_caching)
    from .parallel.launch import TPCluster, local_device
    path = getattr(model, "path", model)  # every rank loads (and shards) the checkpoint itself
    options["device"] = local_device(device)
    owned = cluster is None
    if owned:
        cluster = TPCluster(path, tensor_parallel_size, options["device"], init_method=dist_init)
    try:
        loaded = cluster.loaded
        options.setdefault("max_model_len", min(RunnerConfig().max_model_len, loaded.config.max_position_embeddings))
        cfg = RunnerConfig(**options)
        runner = cluster.make_runner(cfg)
        runner.cluster = cluster if owned else None
        return LLMEngine(loaded, cfg, enable_prefix_caching=enable_prefix_caching, runner=runner)
    except BaseException:
        if owned:
            cluster.close()
        raise


class LLM:
    """Synchronous generation: queue every prompt, step the engine until all finish."""

    def __init__(self, model=None, *, enable_prefix_caching: bool = True, progress: bool = False,
                 tensor_parallel_size: int = 1, **runner_options):
        self.engine = build_engine(model, enable_prefix_caching=enable_prefix_caching, progress=progress,
                                   tensor_parallel_size=tensor_parallel_size, **runner_options)
        from .engine.async_engine import EngineDriver  # here, not at import: the CLI's parser stays torch-free
        self.driver = EngineDriver(self.engine)
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    @property
    def loaded(self):
        return self.engine.loaded

    @property
    def stats(self):
        return self.engine.stats

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt).ids
        return None, list(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt], params=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `prompts`: a string, a list of strings, a list of
        token-id lists (or one token-id list). `params`: one SamplingParams for all, or one per prompt.
        Every request is validated before any runs: a bad one raises InvalidRequest naming its index."""
        from .sampling_params import SamplingParams
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequest(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                text, ids = self.encode(prompt)
                rid = str(next(self._ids))
                try:
                    self.driver.add(rid, ids, p)
                except InvalidRequest as e:
                    raise InvalidRequest(f"prompts[{i}]: {e}") from None
                outputs[rid] = RequestOutput(rid, text, list(ids))
            done = 0
            while done < len(outputs):
                if not self.driver.has_work():
                    raise RuntimeError(f"the engine went idle with {len(outputs) - done} request(s) unfinished")
                for d in self.driver.step():
                    out = outputs[d.request_id]
                    out.text += d.text
                    if d.token_id is not None:
                        out.token_ids.append(d.token_id)
                    if d.finished:
                        out.finish_reason, out.error = d.finish_reason, d.error
                        done += 1
        except BaseException:
            for rid in outputs:  # leave the engine clean for the next call (KV blocks, slots)
                self.driver.abort(rid)
            raise
        return list(outputs.values())

    def close(self) -> None:
        self.engine.close()


# ---- CLI: engram-serve generate ---------------------------------------------------------------

def add_generate_args(parser: argparse.ArgumentParser) -> None:
    from .bench.common import positive_int
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=positive_int, default=32, metavar="N", help="tokens to generate (32)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)")
    parser.add_argument("--model", type=Path, default=None, metavar="PATH",
                        help="checkpoint directory (default: the built-in tiny model)")
    parser.add_argument("--ubatches", type=positive_int, default=2, metavar="N",
                        help="microbatches per step (default 2: dual-batch overlap)")
    parser.add_argument("--split-threshold", type=positive_int, default=2, metavar="TOKENS",
                        help="steps with fewer tokens stay whole (default 2, so that a one-prompt run is cut "
                             "at all; the serving defaults are 32 for decode and 128 for prefill steps)")
    parser.add_argument("--json", action="store_true",
                        help='print {"text", "token_ids", "finish_reason", "microbatch": {...}} as JSON')
    from .parallel.options import add_parallel_args
    add_parallel_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    """Generate once with microbatching, again unsplit, print the text and how the two compare."""
    import random

    from .inputs.ubatch import SplitConfig
    from .sampling_params import SamplingParams
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
    from .parallel.options import engine_options
    opts = engine_options(args)
    cluster = None
    if opts["tensor_parallel_size"] > 1 or "dist_init" in opts:  # one group of ranks for both runs
        from .parallel.launch import TPCluster, local_device
        opts = {"device": local_device(args.device)}
        cluster = TPCluster(args.model, args.tensor_parallel_size, opts["device"], init_method=args.dist_init)
        opts["cluster"] = cluster
    try:
        loaded = load(args.model, progress=True, device=args.device) if cluster is None else args.model
        split = SplitConfig(num_ubatches=args.ubatches, decode_threshold=args.split_threshold,
                            prefill_threshold=args.split_threshold, when="always")  # a demonstration: cut
        llm = LLM(loaded, split=split, **opts)
        out = llm.generate(args.prompt, params)[0]
        stats = dataclasses.replace(llm.stats)
        llm.close()
        whole = LLM(loaded, split=SplitConfig(num_ubatches=1), **opts)
        ref = whole.generate(args.prompt, params)[0]
        whole.close()
    finally:
        if cluster is not None:
            cluster.close()
    same = ref.token_ids == out.token_ids
    micro = {"steps": stats.steps, "split_steps": stats.microbatched_steps, "straddling_rows": stats.straddling_rows,
             "num_ubatches": args.ubatches, "seed": seed, "identical_to_unsplit": same}
    if out.finish_reason == "error":
        print(f"error: {out.error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "microbatch": micro}))
    else:
        print(out.text)
        print(f"microbatching: {stats.microbatched_steps}/{stats.steps} steps split, {stats.straddling_rows} rows "
              f"straddled a cut, tokens identical to the unsplit run: {'yes' if same else 'NO'}")
    return 0 if same and out.finish_reason != "error" else 1
