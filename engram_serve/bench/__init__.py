"""Benchmarks run by `engram-serve bench NAME`, each printing rows as a table or, with --json, as JSON.

A benchmark is a module with a docstring (its first line is the help text), `add_args(parser)` and
`run(args) -> list[dict]`; `engram_serve.bench.common` holds the shared timing, memory and output
helpers. To add one, write the module and add it to `registry()`.
"""
from __future__ import annotations

from types import ModuleType


def registry() -> dict[str, ModuleType]:
    """Subcommand name -> benchmark module. Bench modules import torch and the engine inside their
    functions, so building the command-line parser stays cheap."""
    from . import acceptance, attention, draft, ops, peers, prep, sampler, serve, spec, step, tables, threads
    from . import hash as hash_bench
    return {"hash": hash_bench, "prep": prep, "step": step, "attention": attention, "serve": serve, "ops": ops,
            "peers": peers, "tables": tables, "sampler": sampler, "threads": threads, "acceptance": acceptance,
            "spec": spec, "draft": draft}
