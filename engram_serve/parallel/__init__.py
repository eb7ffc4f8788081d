"""Tensor and expert parallelism across processes on torch.distributed (gloo on CPU, NCCL on CUDA).

    group.py        the process group of one tensor-parallel model: rendezvous, timeouts, broadcasts
    collectives.py  the deterministic cross-rank sum (all-gather, then a rank-ordered sum) and its
                    asynchronous form, whose buffer belongs to the launching microbatch until awaited
    layers.py       Megatron-style column-parallel q/k/v and MLP, RowParallelLinear, expert-parallel MoE
    tables.py       row-sharded Engram tables (each rank gathers only the rows it owns)
    shard.py        `shard_model`: module replacement of a loaded model for rank r of N
    runner.py       the tensor-parallel model runner (rank 0 broadcasts each step's host arrays)
    launch.py       worker processes (torch.multiprocessing, loopback rendezvous or torchrun env://),
                    the worker loop, failure detection and shutdown

Nothing here is imported by the single-process path; model code reaches collectives only through
duck-typed hooks (`launch_reduce`, `head_mean`), so it reads the same at any parallel size.
"""
