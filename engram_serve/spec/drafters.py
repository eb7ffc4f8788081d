"""The `Drafter` protocol and the drafters that need no model of their own.

A drafter proposes up to k tokens to follow each decoding request's committed tokens; the engine verifies
them in one step (docs/contract.md §13) and keeps a draft only where it equals the token plain decoding
samples there. So a drafter changes how many tokens a step gives, never which: the adversarial drafters
below (always wrong, always right, random, the noise token) are how the tests show it.

A drafter that reads the target's features (`feature_layers`, the DSpark drafter of spec/dspark_drafter.py) gets
them for every position the target computed from committed tokens (`StepOutput.features`, never a rejected
draft's), writes its own context in `observe`, drafts in `propose`, and may draw each draft through
`pick(j, z_j)`, the sampler's own choice at that output position (the same seed and Gumbel noise: coupled
drafting, so a drafter close to the target proposes the token the target will sample).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

PickFn = Callable[[int, torch.Tensor], torch.Tensor]
"""`pick(j, z)`: tokens [R] the sampler chooses from draft logits z [R, V] (row i: request i of `propose`) for
draft j (0-based) of each request, i.e. output position `len(token_ids) + j`: greedy rows the argmax, sampling
rows the Gumbel-max with the request's seed and that position's noise, under its temperature and top-k/p/min-p
(no penalties or bias: a draft is only a proposal)."""


@dataclass(frozen=True)
class DraftRequest:
    """One decoding request to draft for: its committed tokens (prompt, then outputs; the last one not yet
    computed by the target: positions 0 .. len - 2 are), how many drafts the engine will verify (`num_drafts` >= 1)
    and its KV blocks (`block_ids`, the engine's: position p lives at slot block_ids[p // block_size] * block_size
    + p % block_size)."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_drafts: int
    block_ids: Sequence[int] = ()


class Drafter(Protocol):
    """What the engine calls. Every call is made from the engine's step loop, in this order per step:
    `propose` (before the step is scheduled), then `observe` once for the rows that ran (those of requests that
    ended in this step too), then `release` for the requests that ended or were preempted. A proposal may hold
    fewer tokens than asked (none: the request decodes plainly)."""

    # () or the checkpoint's `dspark_target_layer_ids`: the target layers whose stream means `observe` gets
    # (StepOutput.features, model/deepseek_v41.py); the engine refuses any other
    feature_layers: tuple[int, ...]
    # the committed positions before a draft's first that its context reads (0: none): after `observe(keep=False)` a
    # drafter may propose nothing for a request until it has observed that many positions with keep
    window: int

    def propose(self, requests: Sequence[DraftRequest], pick: PickFn) -> list[list[int]]:
        """Up to `num_drafts` token ids per request, in order."""
        ...

    def observe(self, positions: torch.Tensor, slots: torch.Tensor, features: torch.Tensor | None,
                keep: bool = True) -> None:
        """What the step computed from committed tokens, in token order: positions [T] int64, their KV slots [T]
        int64 (DraftRequest's `block_ids` rule) and, when `feature_layers` asks, features [T, nL D] (the
        concatenated stream means entering each target layer). Positions past a row's that the step also
        computed held rejected drafts: they are never reported. A recompute after preemption reports positions
        again (from 0, or from the end of a reused prefix, whose positions another request reported). keep=False:
        no draft is asked for `window` steps or more (the planner's choice), so what is kept for them may go, and
        the engine computes no features (None)."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended or lost its state (finished, aborted, preempted): drop what is kept for it."""
        ...


class _Stateless:
    feature_layers: tuple[int, ...] = ()
    window = 0

    def observe(self, positions, slots, features, keep=True) -> None:
        pass

    def release(self, request_id) -> None:
        pass


class NgramDrafter(_Stateless):
    """Prompt lookup (vLLM's "ngram" method): for n from `max_n` down to `min_n`, find the latest earlier
    occurrence of the request's last n tokens in its own tokens and propose the tokens that followed it."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests, pick) -> list[list[int]]:
        return [self.lookup(np.asarray(r.token_ids, dtype=np.int64), r.num_drafts) for r in requests]

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n] earlier n-grams
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the tokens after the latest match
                return tokens[start:start + k].tolist()
        return []


class RandomDrafter(_Stateless):
    """Uniform token ids in [0, vocab), seeded: nearly always wrong on a trained model."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def propose(self, requests, pick) -> list[list[int]]:
        return [self.rng.integers(0, self.vocab, r.num_drafts).tolist() for r in requests]


class NoiseDrafter(_Stateless):
    """Always the same id: the DSpark noise token (the placeholder DSpark's blocks start from), a token the
    target rarely or never samples."""

    def __init__(self, token_id: int):
        self.token_id = int(token_id)

    def propose(self, requests, pick) -> list[list[int]]:
        return [[self.token_id] * r.num_drafts for r in requests]


class OracleDrafter(_Stateless):
    """Tests and `verify`: the outputs of a plain run (request id -> output tokens). `wrong` proposes every
    token plus one (always rejected); `error_rate` replaces each proposed token, with that probability, by a
    seeded random one (rejections at every draft position)."""

    def __init__(self, outputs: dict[str, list[int]], vocab: int, wrong: bool = False, error_rate: float = 0.0,
                 seed: int = 0):
        self.outputs, self.vocab, self.wrong, self.error_rate = outputs, vocab, wrong, error_rate
        self.rng = np.random.default_rng(seed)

    def propose(self, requests, pick) -> list[list[int]]:
        out = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens
            truth = np.asarray(self.outputs.get(r.request_id, [])[done:done + r.num_drafts], dtype=np.int64)
            if self.wrong:
                truth = (truth + 1) % self.vocab
            swap = self.rng.random(len(truth)) < self.error_rate
            out.append(np.where(swap, self.rng.integers(0, self.vocab, len(truth)), truth).tolist())
        return out


class CoupledDrafter(_Stateless):
    """Draws every draft through `pick` from fixed logits (a stand-in for a drafter's head: the target's
    own bias towards token ids seen in the request): exercises the coupled path with the sampler's noise."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def propose(self, requests, pick) -> list[list[int]]:
        k = max((r.num_drafts for r in requests), default=0)
        z = torch.zeros(len(requests), self.vocab)
        for i, r in enumerate(requests):
            z[i, torch.as_tensor(list(r.token_ids[-8:]), dtype=torch.int64)] = 4.0
        drafts = torch.stack([pick(j, z) for j in range(k)], 1) if k else torch.zeros(len(requests), 0)
        return [drafts[i, :r.num_drafts].tolist() for i, r in enumerate(requests)]


def make_drafter(cfg, loaded, runner_cfg=None) -> Drafter:
    """The drafter of `cfg` (SpeculativeConfig) for the model `loaded`, served with `runner_cfg` (RunnerConfig: the
    DSpark drafter's context lives at the KV cache's slots)."""
    from ..errors import ConfigError
    from .config import dspark_noise_token_id
    vocab = min(int(loaded.token_map.shape[0]), loaded.config.vocab_size)
    if cfg.method == "ngram":
        return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "random":
        return RandomDrafter(vocab, cfg.seed)
    if cfg.method == "noise":
        noise = dspark_noise_token_id(getattr(loaded, "path", None))
        return NoiseDrafter(noise if noise is not None and noise < vocab else vocab - 1)
    if getattr(loaded, "drafter", None) is None:
        raise ConfigError(f"speculative config field method={cfg.method!r}: {getattr(loaded, 'path', 'the model')} "
                          f"has no DSpark drafter (no `mtp.*` weights loaded)")
    from .dspark_drafter import DSparkDrafter
    if runner_cfg is None:
        raise ConfigError("speculative config method='dspark': the drafter needs the runner's config (its KV cache)")
    return DSparkDrafter(loaded.drafter, loaded.model, runner_cfg.num_blocks, runner_cfg.block_size,
                         runner_cfg.max_num_seqs, graphs=runner_cfg.cpu_graphs)
