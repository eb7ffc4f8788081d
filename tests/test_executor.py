import time

import pytest

from engram_serve.microbatch.executor import StageMismatch, run_interleaved


def fake_forward(k: int, layers: int, log: list, fail_at: int | None = None):
    for layer in range(layers):
        log.append((k, layer, "write"))
        if fail_at == layer:
            raise RuntimeError(f"boom in microbatch {k}")
        yield f"layer{layer}.attn"
        log.append((k, layer, "mlp"))
        yield f"layer{layer}.mlp"
    return k * 10


def test_layer_l_of_microbatch_k_runs_before_microbatch_k_plus_1():
    log, trace = [], []
    out = run_interleaved([fake_forward(k, 4, log) for k in range(3)], trace)
    assert out == [0, 10, 20]
    for layer in range(4):
        writes = [i for i, e in enumerate(log) if e[1] == layer and e[2] == "write"]
        assert [log[i][0] for i in writes] == [0, 1, 2]
    assert trace[:3] == [(0, "layer0.attn"), (1, "layer0.attn"), (2, "layer0.attn")]


def test_a_failing_microbatch_ends_the_step_fast_and_the_executor_is_reusable():
    log = []
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="boom in microbatch 1"):
        run_interleaved([fake_forward(0, 4, log), fake_forward(1, 4, log, fail_at=2)])
    assert time.monotonic() - t < 1.0
    assert run_interleaved([fake_forward(0, 2, []), fake_forward(1, 2, [])]) == [0, 10]


def test_diverging_stages_are_an_error():
    def other():
        yield "something else"
    with pytest.raises(StageMismatch):
        run_interleaved([fake_forward(0, 1, []), other()])
