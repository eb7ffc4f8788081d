"""Engram n-gram hashing (docs/contract.md §2), vectorised over a whole step.

The production path has three pieces, all torch ops that run unchanged on CPU or CUDA:
  `step_windows`   - for every token, the raw ids of the N tokens ending at it, read from the
                     step's own input ids or from the row's history `[rows, D]`;
  `compress`       - raw ids -> compressed ids (negative = blocked: before position 0 or dead);
  `hash_windows`   - the rolling-XOR hash of every window for every Engram layer.
On CPU, `hash_step` and `hash_windows` run the optional C kernel `_hash_kernel` instead (one fused
loop per token, division by a precomputed reciprocal; single-threaded torch spends most of its time
in int64 `remainder`, which it cannot vectorise). The torch path (`hash_step_torch`,
`hash_windows_torch`) serves CUDA tensors and a process without the kernel (not built, or switched
off: `ENGRAM_SERVE_KERNELS=-hash`, engram_serve/kernels.py); both are property-tested against each
other and the reference.
`reference_hash` (a plain loop over one sequence, written for obviousness) lives beside it for tests.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .layout import EngramLayout

BEFORE_START = -1  # history column whose position is < 0
DEAD = -2  # a dead token (e.g. an image placeholder): blocks every n-gram that reaches it


def step_windows(input_ids: torch.Tensor, qsl: torch.Tensor, history: torch.Tensor, n: int,
                 dead: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N] int64 raw ids: window[t, s] is the token s positions before token t (negative = blocked).

    input_ids [T]; qsl [R+1] row boundaries; history [R, D] with column j = position (first-1-j)
    of the row's first token; D >= N-1. dead [T] bool marks dead tokens of this step.
    Tokens past qsl[-1] (padding) get fully blocked windows.
    """
    num_tokens = input_ids.shape[0]
    dev = input_ids.device
    ids = input_ids.long()
    if dead is not None:
        ids = torch.where(dead, torch.full_like(ids, DEAD), ids)
    tok = torch.arange(num_tokens, device=dev)
    row = torch.searchsorted(qsl[1:].long(), tok, right=True)  # [T]
    valid = row < history.shape[0]
    row = row.clamp(max=max(history.shape[0] - 1, 0))
    offset = tok - qsl.long()[row]  # position of t inside its row
    hist = history.long()
    cols = []
    for s in range(n):  # N is a small constant (<= 5): no per-token loop
        in_step = offset >= s
        from_step = ids[(tok - s).clamp(min=0)]
        j = (s - offset - 1).clamp(min=0, max=max(hist.shape[1] - 1, 0))
        from_hist = hist[row, j] if hist.numel() else torch.full_like(ids, BEFORE_START)
        cols.append(torch.where(in_step, from_step, from_hist))
    win = torch.stack(cols, dim=1)  # [T, N]
    return torch.where(valid[:, None], win, torch.full_like(win, BEFORE_START))


def compress(window: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """Raw ids -> compressed ids; negatives (blocked) pass through."""
    return torch.where(window >= 0, token_map[window.clamp(min=0)], window)


def hash_backend(*tensors: torch.Tensor) -> str:
    """'kernel' or 'torch': the path that hashes these tensors: the kernel where it is loaded
    (engram_serve/kernels.py) and every tensor is on the CPU."""
    if kernels.get("hash") is None or any(t.device.type != "cpu" for t in tensors):
        return "torch"
    return "kernel"


def _host(t: torch.Tensor) -> np.ndarray:
    """Zero-copy int64 C-contiguous numpy view of a CPU tensor (copies only to convert)."""
    return t.long().contiguous().numpy()


def _new_output(num_tokens: int, layout: EngramLayout) -> np.ndarray:
    """[T, L, C] int64, uninitialised (the kernel writes every element).

    Allocated by numpy rather than torch.empty: calling `torch.empty((65536, 2, 24))` repeatedly
    (glibc, torch 2.13) grew the resident set by 24 MiB per call up to 192 MiB, as freed blocks were
    kept rather than reused; with `np.empty` it stays at one output (measured in a plain loop)."""
    return np.empty((num_tokens, *layout.moduli.shape), dtype=np.int64)


_memo: dict[tuple, tuple] = {}


def _once(tensors: tuple[torch.Tensor, ...], convert) -> tuple[np.ndarray, ...]:
    """convert(tensors): host arrays of constant tensors (the layout's, the token map), made once, not
    every step. Memoised by identity and version; the entry keeps the tensors alive, so an id is not
    reused while cached."""
    key = tuple((id(t), t._version) for t in tensors)
    hit = _memo.get(key)
    if hit is None:
        if len(_memo) >= 64:
            _memo.clear()
        hit = _memo[key] = (tensors, convert(*tensors))
    return hit[1]


def _kernel_constants(layout: EngramLayout) -> tuple[np.ndarray, ...]:
    return _once((layout.multipliers, layout.moduli, layout.offsets, layout.div_magic),
                 lambda m, d, o, r: (_host(m), _host(d), _host(o), r.contiguous().numpy()))  # r: uint64


def hash_windows(window_c: torch.Tensor, layout: EngramLayout, pad_id: int) -> torch.Tensor:
    """[T, L, (N-1)*H] int64 hash ids from compressed windows [T, N] (negative = blocked)."""
    if hash_backend(window_c, layout.moduli) == "torch":
        return hash_windows_torch(window_c, layout, pad_id)
    out = _new_output(window_c.shape[0], layout)  # [T, L, C]
    kernels.get("hash").hash_windows(_host(window_c), *_kernel_constants(layout), int(pad_id), out)
    return torch.from_numpy(out)


def hash_windows_torch(window_c: torch.Tensor, layout: EngramLayout, pad_id: int) -> torch.Tensor:
    """`hash_windows` in torch ops (any device)."""
    num_layers, n = layout.multipliers.shape
    heads = layout.config.engram_n_heads
    blocked = torch.cummax((window_c < 0).to(torch.int8), dim=1).values.bool()  # once blocked, stays blocked
    v = torch.where(blocked, torch.full_like(window_c, pad_id), window_c)  # [T, N]
    prod = v[:, None, :] * layout.multipliers[None, :, :]  # [T, L, N]; cannot overflow (docs/contract.md §2)
    rolling = [prod[:, :, 0]]
    for s in range(1, n):
        rolling.append(torch.bitwise_xor(rolling[-1], prod[:, :, s]))
    roll = torch.stack(rolling[1:], dim=2)  # [T, L, N-1]
    mod = layout.moduli.view(num_layers, n - 1, heads)
    off = layout.offsets.view(num_layers, n - 1, heads)
    out = torch.remainder(roll[:, :, :, None], mod[None]) + off[None]  # [T, L, N-1, H]
    return out.reshape(window_c.shape[0], num_layers, (n - 1) * heads)


def hash_step(input_ids: torch.Tensor, qsl: torch.Tensor, history: torch.Tensor, layout: EngramLayout,
              token_map: torch.Tensor, pad_id: int, dead: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The production hash of one step (or one microbatch): [T, L, (N-1)*H] int64.

    `out`, a persistent [T, L, C] int64 buffer (e.g. a microbatch's), receives the result in place:
    a fresh multi-MiB output per step costs page faults as the allocator hands memory back and forth."""
    shape = (input_ids.shape[0], *layout.moduli.shape)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.int64):
        raise ValueError(f"hash_step: out is {tuple(out.shape)} {out.dtype}; expected {shape} torch.int64")
    tensors = (input_ids, qsl, history, token_map, layout.moduli) + (() if dead is None else (dead,))
    if hash_backend(*tensors) == "torch" or (out is not None and not (out.device.type == "cpu"
                                                                      and out.is_contiguous())):
        res = hash_step_torch(input_ids, qsl, history, layout, token_map, pad_id, dead)
        return res if out is None else out.copy_(res)
    host = _new_output(input_ids.shape[0], layout) if out is None else out.numpy()  # [T, L, C]
    dead_np = None if dead is None else dead.bool().contiguous().numpy()
    hash_step_host(_host(input_ids), _host(qsl), _host(history), dead_np, layout, token_map, pad_id, host)
    return torch.from_numpy(host) if out is None else out


def hash_step_host(input_ids: np.ndarray, qsl: np.ndarray, history: np.ndarray, dead: np.ndarray | None,
                   layout: EngramLayout, token_map: torch.Tensor, pad_id: int, out: np.ndarray) -> None:
    """`hash_step` by the kernel on host arrays (int64, dead bool; C-contiguous) into out [T, L, C] int64: the
    C loop is step_windows + compress + hash_windows fused, no [T, N] or [T, L, C] temporaries. The caller
    checked `hash_backend`."""
    token_map_np = _once((token_map,), lambda t: (_host(t),))[0]
    kernels.get("hash").hash_step(input_ids, qsl, history, dead, token_map_np, *_kernel_constants(layout),
                                  int(pad_id), out)


def hash_step_torch(input_ids: torch.Tensor, qsl: torch.Tensor, history: torch.Tensor, layout: EngramLayout,
                    token_map: torch.Tensor, pad_id: int, dead: torch.Tensor | None = None) -> torch.Tensor:
    """`hash_step` in torch ops (any device)."""
    n = layout.config.engram_max_ngram_size
    return hash_windows_torch(compress(step_windows(input_ids, qsl, history, n, dead), token_map), layout, pad_id)


def reference_hash(tokens: list[int], dead: list[bool], layout: EngramLayout, token_map: list[int],
                   pad_id: int) -> list[list[list[int]]]:
    """docs/contract.md §2 pseudo-code, verbatim, for one whole sequence starting at position 0. Tests only."""
    cfg = layout.config
    n, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    moduli, offsets, mults = layout.moduli.tolist(), layout.offsets.tolist(), layout.multipliers.tolist()
    out = []
    for p in range(len(tokens)):
        per_layer = []
        for li in range(cfg.num_layers):
            hashes = [0] * ((n - 1) * heads)
            blocked, rolling = False, 0
            for s in range(n):
                q = p - s
                if q < 0 or dead[q]:
                    blocked = True
                v = pad_id if blocked else token_map[tokens[q]]
                rolling ^= v * mults[li][s]
                if s >= 1:
                    for h in range(heads):
                        c = (s - 1) * heads + h
                        hashes[c] = rolling % moduli[li][c] + offsets[li][c]
            per_layer.append(hashes)
        out.append(per_layer)
    return out
