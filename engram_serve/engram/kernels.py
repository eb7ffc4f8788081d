"""The choice between an optional C kernel and its torch path.

Each kernel (`_hash_kernel` for the n-gram hash, `_gather_kernel` for the staging gather) is built by
setup.py where a C compiler exists, and has a torch path that serves everything else. An environment
variable per kernel, read per call, picks: `auto` (default) takes the kernel when it was built and
every tensor is on the CPU; `torch` always takes the torch path; `kernel` is `auto` but raises if the
kernel was not built.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "kernel")


def choose_backend(env: str, kernel: ModuleType | None, name: str, tensors: tuple[torch.Tensor, ...]) -> str:
    """'kernel' or 'torch' for these tensors under the environment variable `env` (see the module doc)."""
    choice = os.environ.get(env, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "kernel" and kernel is None:
        raise RuntimeError(f"{env}=kernel, but engram_serve.engram.{name} was not built "
                           "(reinstall with a C compiler: pip install -e .)")
    if choice == "torch" or kernel is None or any(t.device.type != "cpu" for t in tensors):
        return "torch"
    return "kernel"
