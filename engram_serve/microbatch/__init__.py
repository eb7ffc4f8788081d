"""Microbatching: one step run as several interleaved forwards (docs/contract.md §1, §4, §5).

A microbatch is a contiguous token range of a step, executed as its own forward and interleaved with
the other microbatches of the same step, so that one's communication or memory traffic (a cross-rank
sum, an Engram gather from host memory) overlaps another's compute. With two microbatches this is
dual-batch overlap. A row whose tokens a microbatch boundary cuts is a straddling row: it runs partly
in microbatch k and partly in k+1. Whatever the cut, every token's result is bit-identical to the
whole step's (docs/contract.md §3, §9): that is what the modules below guarantee between them.

    plan.py      MicrobatchConfig; plan_microbatches, the boundaries of a step; MicrobatchPlanner, the
                 cost model that decides whether a cut hides anything and where each gather runs;
                 check_bounds for boundaries handed in from outside
    slicing.py   SLICE_RULES, one rule per StepBatch field; slice_microbatches, the microbatches of a
                 step (a straddling row's history, computed tokens and sequence length adjusted)
    buffers.py   MicrobatchBuffers: the buffers a forward writes and reads back, one set per microbatch
    executor.py  run_interleaved: the microbatches' stage generators, round-robin in a fixed order

The model only marks where a forward may pause: `DeepseekV41.stages` and `MoE.stages`
(model/deepseek_v41.py) yield a stage name at each overlap point. `ModelRunner` (runner/model_runner.py)
plans, slices, hands each microbatch its own buffers and runs the executor.
"""
