"""Named kernel arguments (engram_serve/_kernel_buffers.h): every address kernel takes its arguments by position or
by name, one X-macro list making its struct, parser, raw entry and docstring. A keyword call gives the positional
call's bits; a misspelled or missing name is a TypeError naming it; a keyword call recorded by a capture replays
(raw, from its struct's slots, and through its Python form) with the eager bits."""
from __future__ import annotations

import inspect

import pytest
import torch

from engram_serve import kernels
from engram_serve.model import capture
from engram_serve.runner import cpu_graphs

tok, lin = kernels.get("token"), kernels.get("linear")
pytestmark = pytest.mark.skipif(tok is None or lin is None, reason="the token and linear kernels are not built")

N, HC, DIM = 5, 4, 32
NM, WIDTH = (2 + HC) * HC, HC * DIM


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def hc_next_case(seed: int = 0):
    """hc_next's keyword arguments (tensors kept alive in `keep`) and its outputs, for N tokens."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    keep = dict(o=r(N, DIM), x=r(N, WIDTH), post=torch.rand(N, HC, generator=g) * 2,
                comb=torch.rand(N, HC * HC, generator=g), mix=torch.rand(N, HC, generator=g),
                panels=r(2, WIDTH, 16) * 0.1, scale=torch.rand(3, generator=g) + 0.5, base=r(NM), norm_w=r(DIM))
    outs = dict(out=torch.empty(N, WIDTH), pre=torch.empty(N, HC), post2=torch.empty(N, HC),
                comb2=torch.empty(N, HC * HC), h=torch.empty(N, DIM), mm=torch.empty(N, NM), y=torch.empty(N, DIM))
    kw = {k: t.data_ptr() for k, t in {**keep, **outs}.items()}
    kw.update(n=N, hc=HC, dim=DIM, matmul=kernels.raw_kernels("linear")["linear_packed"].entry, kc=64, eps=1e-6,
              hc_eps=1e-6, iters=20, norm_eps=1e-6)
    return kw, keep, outs


def positional(fn, kw: dict) -> tuple:
    return tuple(kw[name] for name, _ in tok.kernel_fields()[fn] if name in kw)


def test_fields_are_the_positional_order_and_the_signature():
    fields = tok.kernel_fields()["hc_next"]
    assert [n for n, _ in fields][:8] == ["o", "x", "post", "comb", "mix", "n", "hc", "dim"]
    assert dict(fields)["eps"] == "real" and dict(fields)["matmul"] == "addr" and len(fields) == 25
    assert list(inspect.signature(tok.hc_next).parameters) == [n for n, _ in fields]
    assert "norm_eps (real)" in tok.hc_next.__doc__
    raw = kernels.raw_kernels("token")["hc_next"]
    assert raw.fields == fields and isinstance(raw.entry, int)
    assert lin.kernel_fields()["moe_experts"][-2:] == (("tiles", "flag"), ("prefetch", "flag"))


def test_keywords_give_the_positional_bits():
    kw, keep, outs = hc_next_case()
    tok.hc_next(*positional("hc_next", kw))
    want = {k: t.clone() for k, t in outs.items() if k not in ("mm", "y")}
    for t in outs.values():
        t.fill_(float("nan"))
    tok.hc_next(**kw)
    assert all(torch.equal(bits(want[k]), bits(outs[k])) for k in want)
    tok.hc_next(*positional("hc_next", kw)[:10], **{k: v for k, v in kw.items()  # mixed: a head by position
                                                    if k not in [n for n, _ in tok.kernel_fields()["hc_next"]][:10]})
    assert all(torch.equal(bits(want[k]), bits(outs[k])) for k in want)

    gu, a, b = torch.randn(3, 16), torch.empty(3, 8), torch.empty(3, 8)
    tok.swiglu(gu.data_ptr(), 3, 8, 0.5, a.data_ptr())
    tok.swiglu(out=b.data_ptr(), limit=0.5, inter=8, n=3, gu=gu.data_ptr())
    assert torch.equal(bits(a), bits(b))
    x, i1, i2, f = torch.randn(4, 9), torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64), \
        torch.zeros(4, dtype=torch.bool)
    tok.argmax_rows(x.data_ptr(), 4, 9, i1.data_ptr())  # the optional address left out
    tok.argmax_rows(x=x.data_ptr(), rows=4, v=9, out=i2.data_ptr(), finite=f.data_ptr())
    assert torch.equal(i1, i2) and bool(f.all())
    c = torch.empty(3, 8)  # names made at run time (not interned: matched by their text), out of field order
    tok.swiglu(**{"".join(k): v for k, v in (("out", c.data_ptr()), ("gu", gu.data_ptr()), ("n", 3),
                                             ("limit", 0.5), ("inter", 8))})
    assert torch.equal(bits(a), bits(c))


def test_a_wrong_or_missing_name_is_a_type_error_naming_it():
    kw, keep, outs = hc_next_case()
    bad = dict(kw)
    bad["norm_epsilon"] = bad.pop("norm_eps")
    with pytest.raises(TypeError, match="norm_epsilon"):
        tok.hc_next(**bad)
    missing = {k: v for k, v in kw.items() if k != "hc_eps"}
    with pytest.raises(TypeError, match="hc_eps"):
        tok.hc_next(**missing)
    with pytest.raises(TypeError, match="'gu'"):
        tok.swiglu(0, 0, 8, 0.5, 0, gu=0)  # given twice
    with pytest.raises(TypeError, match="limit"):
        tok.swiglu(gu=0, n=0, inter=8, limit="x", out=0)
    with pytest.raises(TypeError, match="kc"):
        lin.linear_packed(x=0, ldx=1, panels=0, y=0, m=0, k=1, n=0, kcc=1, simd=2)
    counts = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="simd is 3"):  # bfloat16 tiles are `tiles`, no simd level
        lin.moe_experts(xs=0, rows=0, counts=counts.data_ptr(), e=1, d=1, inter=1, panels13=counts.data_ptr(), kc13=1,
                        panels2=counts.data_ptr(), kc2=1, limit=0.0, h=0, g=0, ys=0, simd=3)


def test_a_keyword_recorded_call_replays_with_the_eager_bits():
    """A capture records a keyword call as its positional form in field order; its replay (raw from the struct's
    slots, or through the Python form for a kernel without a raw entry) gives the eager call's bits."""
    kw, keep, outs = hc_next_case(1)
    g = torch.Generator().manual_seed(2)
    z, bias = torch.randn(N, 16, generator=g), torch.randn(16, generator=g)
    ids, w = torch.empty(N, 4, dtype=torch.int64), torch.empty(N, 4)
    route = dict(z=z.data_ptr(), bias=bias.data_ptr(), n=N, e=16, k=4, norm=True, scale=2.5, ids=ids.data_ptr(),
                 w=w.data_ptr())
    tape = []
    with capture.recording(tape):
        capture.call(tok.hc_next, **kw)
        capture.call(tok.moe_route, z.data_ptr(), bias.data_ptr(), **{k: v for k, v in route.items()
                                                                        if k not in ("z", "bias")})
        capture.call(tok.argmax_rows, x=z.data_ptr(), rows=N, v=16, out=ids.data_ptr())
    assert tape[0] == (tok.hc_next, positional("hc_next", kw))
    assert tape[2] == (tok.argmax_rows, (z.data_ptr(), N, 16, ids.data_ptr(), 0))
    want = {k: t.clone() for k, t in outs.items() if k not in ("mm", "y")}
    want_ids, want_w = ids.clone(), w.clone()
    graph = cpu_graphs._Graph(tape, {}, outs["h"], [keep, outs], 0)
    assert graph._raw[0] is not None and graph._raw[1] is None  # hc_next raw, moe_route through its Python form
    for t in (*outs.values(), w):
        t.fill_(float("nan"))
    ids.fill_(-7)
    graph.replay({})
    assert all(torch.equal(bits(want[k]), bits(outs[k])) for k in want)
    assert torch.equal(ids, want_ids) and torch.equal(bits(w), bits(want_w))


def test_keywords_need_a_kernel_with_fields():
    with pytest.raises(TypeError, match="concat_cols"):
        with capture.recording([]):
            capture.positional(tok.concat_cols, (), {"out": 0})


def test_the_c_call_records_the_tape_of_the_python_form():
    """capture.call is the token kernel's C pass-through: a capture through it records what `call_python` records
    (the positional form in field order, an optional address left out as 0), for keyword, mixed and positional
    calls; outside a capture it records nothing, and no hook stays installed."""
    assert capture.call is tok.call
    kw, _keep, outs = hc_next_case(3)
    z, ids = torch.randn(N, 16), torch.empty(N, 4, dtype=torch.int64)
    calls = [(tok.hc_next, (), kw),
             (tok.argmax_rows, (z.data_ptr(),), dict(rows=N, v=16, out=ids.data_ptr())),
             (tok.argmax_rows, (z.data_ptr(), N, 16, ids.data_ptr()), {})]
    tapes = []
    for form in (tok.call, capture.call_python):
        tape = []
        with capture.recording(tape):
            for fn, args, named in calls:
                form(fn, *args, **named)
        tapes.append(tape)
    assert tapes[0] == tapes[1] and len(tapes[0]) == 3
    assert tapes[0][0] == (tok.hc_next, positional("hc_next", kw))
    assert tapes[0][1] == (tok.argmax_rows, (z.data_ptr(), N, 16, ids.data_ptr(), 0))
    assert tapes[0][2] == (tok.argmax_rows, (z.data_ptr(), N, 16, ids.data_ptr()))  # as called, like the Python form
    seen = []
    capture.call(lambda *a, **k: seen.append((a, k)), 1, b=2)  # no capture: a plain call
    assert seen == [((1,), {"b": 2})] and capture._active == 0


def test_a_call_on_another_thread_during_a_capture_is_not_recorded():
    """The C `call`'s recorder is process-wide while any capture runs, but it appends to the calling thread's tape
    only: another thread's calls meanwhile run and are not recorded; its own capture records its own calls."""
    import threading
    z, ids = torch.randn(N, 16), torch.empty(N, 4, dtype=torch.int64)
    mine, theirs, ran = [], [], []

    def other(record: bool):
        def fn(x):
            ran.append(x)
        try:
            if record:
                with capture.recording(theirs):
                    capture.call(fn, 2)  # (a function without kernel_fields: by position)
            else:
                capture.call(fn, x=1)  # not recorded: its keywords are never normalised
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            ran.append(e)
    with capture.recording(mine):
        capture.call(tok.argmax_rows, x=z.data_ptr(), rows=N, v=16, out=ids.data_ptr())
        for record in (False, True):
            t = threading.Thread(target=other, args=(record,))
            t.start()
            t.join()
        capture.call(tok.argmax_rows, z.data_ptr(), N, 16, ids.data_ptr())
    assert ran == [1, 2]
    assert [fn for fn, _ in mine] == [tok.argmax_rows, tok.argmax_rows]
    assert len(theirs) == 1 and theirs[0][1] == (2,) and capture._active == 0


@pytest.mark.parametrize("form", ["c", "python"])
def test_a_kernel_returning_a_value_raises_and_is_not_recorded(form):
    call = tok.call if form == "c" else capture.call_python

    def returns_one(x=0):
        return 1
    tape = []
    with capture.recording(tape):
        with pytest.raises(RuntimeError, match="returns_one returned a value"):
            call(returns_one, x=3)
        with pytest.raises(ValueError):  # a kernel's own error passes through
            call(lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert tape == []
    with pytest.raises(TypeError, match="missing fn"):
        tok.call()


def test_the_call_follows_the_loaded_kernels():
    """capture.call is the C one while the token kernel is loaded, the Python one inside an override without it,
    and the C one again after the block (kernels.on_change); a capture that spans the change records both."""
    assert capture.call is tok.call
    z, ids = torch.randn(N, 16), torch.empty(N, 4, dtype=torch.int64)
    tape = []
    with capture.recording(tape):
        with kernels.override("-token"):
            assert capture.call is capture.call_python
            capture.call(tok.argmax_rows, x=z.data_ptr(), rows=N, v=16, out=ids.data_ptr())
        assert capture.call is tok.call
        capture.call(tok.argmax_rows, x=z.data_ptr(), rows=N, v=16, out=ids.data_ptr())
    assert tape == [(tok.argmax_rows, (z.data_ptr(), N, 16, ids.data_ptr(), 0))] * 2
