"""Building an engine: `load` a checkpoint (with an optional progress bar) and `build_engine`."""
from __future__ import annotations

import dataclasses
import sys

from ..errors import ConfigError


def load(model=None, progress: bool = False):
    """A LoadedModel from a path or None (the built-in tiny model); a LoadedModel is returned as is.
    With `progress`, a tqdm bar on stderr follows the loading stages."""
    from ..model.loader import LoadedModel, load_model
    if isinstance(model, LoadedModel):
        return model
    if not progress:
        return load_model(model)
    from tqdm import tqdm
    with tqdm(total=1, desc="loading", unit="tensor", file=sys.stderr, leave=False,
              postfix="config, tokenizer, compressed token map") as bar:
        def note(done: int, total: int, what: str) -> None:
            if bar.total != total:
                bar.reset(total=total)
            bar.n = done
            bar.set_postfix_str(what[-40:], refresh=False)
            bar.refresh()
        loaded = load_model(model, progress=note)
    return loaded


def build_engine(model=None, *, enable_prefix_caching: bool = True, progress: bool = False,
                 threads: int | None = None, seed: int | None = None, **runner_options):
    """An LLMEngine over `model` (path, None or LoadedModel); `runner_options` are RunnerConfig
    fields; an unknown one raises ConfigError naming it. `threads`: torch threads (default: the
    cores of the affinity mask); `seed`: seeds the per-request seeds drawn for unseeded requests."""
    from ..runner.model_runner import RunnerConfig
    from .llm_engine import LLMEngine
    known = {f.name for f in dataclasses.fields(RunnerConfig)}
    unknown = sorted(set(runner_options) - known)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {unknown}; known: enable_prefix_caching, threads, seed, "
                          f"{sorted(known)}")
    loaded = load(model, progress)
    options = dict(runner_options)
    options.setdefault("max_model_len", min(RunnerConfig().max_model_len, loaded.config.max_position_embeddings))
    try:
        cfg = RunnerConfig(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"engine options: {e}") from None
    return LLMEngine(loaded, cfg, enable_prefix_caching=enable_prefix_caching, threads=threads, seed=seed)
