"""Building an engine: `build_engine` loads the model (model/loader.py `load_model`) and builds the LLMEngine."""
from __future__ import annotations

import dataclasses
import logging

from .. import kernels
from ..errors import ConfigError
from .scheduler import MAX_WAITING

log = logging.getLogger(__name__)


def build_engine(model=None, *, enable_prefix_caching: bool = True, progress: bool = False,
                 tensor_parallel_size: int = 1, dist_init: str | None = None, cluster=None,
                 threads: int | None = None, seed: int | None = None, max_waiting: int | None = MAX_WAITING,
                 speculative_config=None, **runner_options):
    """An LLMEngine over `model` (path, None or LoadedModel); `runner_options` are RunnerConfig fields
    (`device="cuda"` places weights, KV cache and staging buffers on the GPU; tables stay on the host);
    an unknown one raises ConfigError naming it. `threads`: the C kernels' and torch's threads (default: the cores of
    the affinity mask, engine/threads.py); `seed`: seeds the per-request seeds drawn for unseeded requests;
    `max_waiting`: the scheduler's waiting-queue bound (default `scheduler.MAX_WAITING`; None = none).
    `speculative_config`: speculative decoding, vLLM's JSON or dict (spec/config.py `SpeculativeConfig`).

    `tensor_parallel_size=N` (N >= 2) starts N-1 worker processes (or joins a torchrun group with
    `dist_init="env://"`); this process is rank 0 and owns the scheduler. The engine's close stops them.
    `cluster`: run on an existing TPCluster instead (its owner closes it), e.g. several engines in turn."""
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    from .llm_engine import LLMEngine
    from .threads import set_torch_threads
    known = {f.name for f in dataclasses.fields(RunnerConfig)}
    unknown = sorted(set(runner_options) - known)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {unknown}; known: enable_prefix_caching, "
                          f"tensor_parallel_size, threads, seed, max_waiting, speculative_config, {sorted(known)}")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size!r}: must be an integer >= 1")
    set_torch_threads(threads)  # before loading: the load itself runs torch ops
    log.info("%s", kernels.summary())  # one line: which C kernels run (and why not), the SIMD level
    options = dict(runner_options)
    device = options.get("device", "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ConfigError(f"device={device!r}: must be 'cpu' or 'cuda'")
    if str(device).startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r}: CUDA is not available in this torch build")

    def config(loaded) -> RunnerConfig:
        options.setdefault("max_model_len", min(RunnerConfig().max_model_len, loaded.config.max_position_embeddings))
        try:
            return RunnerConfig(**options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"engine options: {e}") from None

    if tensor_parallel_size == 1 and dist_init is None and cluster is None:
        loaded = load_model(model, device=device, progress=progress)
        return LLMEngine(loaded, config(loaded), enable_prefix_caching=enable_prefix_caching, threads=threads,
                         seed=seed, max_waiting=max_waiting, speculative=speculative_config)
    from ..parallel.launch import TPCluster, local_device
    path = getattr(model, "path", model)  # every rank loads (and shards) the checkpoint itself
    options["device"] = local_device(device)
    owned = cluster is None
    if owned:
        cluster = TPCluster(path, tensor_parallel_size, options["device"], init_method=dist_init)
    try:
        loaded = cluster.loaded
        cfg = config(loaded)
        runner = cluster.make_runner(cfg)
        runner.cluster = cluster if owned else None
        return LLMEngine(loaded, cfg, enable_prefix_caching=enable_prefix_caching, runner=runner, threads=threads,
                         seed=seed, max_waiting=max_waiting, speculative=speculative_config)
    except BaseException:
        if owned:
            cluster.close()
        raise
