"""Command-line options of parallelism and placement, shared by serve, verify, generate and bench step.

Torch-free at import (the CLI parser stays fast). `maybe_run_worker` makes a non-zero torchrun rank
a worker: under `torchrun ... -m engram_serve.cli <command> --tensor-parallel-size N --dist-init env://`
rank 0 runs the command and ranks 1..N-1 serve it.
"""
from __future__ import annotations

import argparse
import os


def _tp_size(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 1")
    return v


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=_tp_size, default=1, metavar="N",
                        help="split the model over N processes (attention heads, MoE experts, Engram table "
                             "rows); workers start on loopback (gloo on CPU, NCCL on CUDA). Default 1")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where weights, the KV cache and staging buffers live (Engram tables stay in "
                             "host memory, pinned with CUDA). Default cpu")
    parser.add_argument("--dist-init", default=None, metavar="URL",
                        help="join an existing rendezvous instead of starting workers: env:// under torchrun "
                             "(README, Parallelism)")


def engine_options(args: argparse.Namespace) -> dict:
    """build_engine keyword arguments from the parsed options."""
    out = {"tensor_parallel_size": args.tensor_parallel_size, "device": args.device}
    if args.dist_init is not None:
        out["dist_init"] = args.dist_init
    return out


def check_device(args: argparse.Namespace) -> None:
    """--device cuda without a usable GPU: a ConfigError naming the option, before anything loads."""
    if getattr(args, "device", None) == "cuda":
        import torch
        if not torch.cuda.is_available():
            from ..errors import ConfigError
            raise ConfigError(f"--device cuda: CUDA is not available (torch {torch.__version__}, "
                              f"{'no CUDA build' if torch.version.cuda is None else 'no visible GPU'})")


def maybe_run_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun (`--dist-init env://`), ranks other than 0 become workers: returns their exit code;
    None on rank 0 and without --dist-init."""
    if getattr(args, "dist_init", None) is None or int(os.environ.get("RANK", "0")) == 0:
        return None
    from .launch import local_device, worker_entry
    return worker_entry(getattr(args, "model", None), local_device(args.device))
