"""Sampler: greedy, the candidate top-k / top-p / min-p path against a plain-loop reference (with
the fallback's negative control), the sampled distribution, batch independence with every extra
(with a negative control), logprobs against an independent float64 computation, penalties against a
plain loop, non-finite rows, no host reads; SamplingParams validation."""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engram_serve.errors import InvalidRequest
from engram_serve.runner import sampler as S
from engram_serve.runner.sampler import Penalties, Sampler, SamplingBatch, hash_uniform, hash_uniform_at
from engram_serve.sampling_params import SamplingParams


def make(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=12345, counter=0, **kw):
    """A SamplingBatch for logits [R, V]; scalars are broadcast, sequences are per row."""
    n, vocab = logits.shape

    def per_row(v):
        return list(v) if isinstance(v, (list, tuple, np.ndarray, torch.Tensor)) else [v] * n

    seeds = per_row(seed0) if not isinstance(seed0, int) else [seed0 + i for i in range(n)]
    return SamplingBatch.build(vocab, per_row(temperature), per_row(top_k), per_row(top_p), seeds,
                               per_row(counter), per_row(min_p), **kw)


def draw(logits, sampler=None, **kw):
    return (sampler or Sampler()).sample(logits, make(logits, **kw)).tokens


# ---- the plain-loop reference of the module docstring's definition ----

def reference_keep(row, temperature, k, p, min_p):
    """Kept vocabulary indices of one row, by a plain loop in float64 (independent of the sampler)."""
    scaled = [float(v) / temperature for v in row]
    order = sorted(range(len(row)), key=lambda i: (-scaled[i], i))
    top = scaled[order[0]]
    kept = [i for i in order if min_p == 0 or scaled[i] >= top + math.log(min_p)]
    if k:
        kept = kept[:k]
    if p < 1:
        z = sum(math.exp(scaled[i] - top) for i in kept)
        out, before = [], 0.0
        for i in kept:
            if before >= p:
                break
            out.append(i)
            before += math.exp(scaled[i] - top) / z
        kept = out
    return kept, scaled


def reference_token(row, temperature, k, p, min_p, noise):
    kept, scaled = reference_keep(row, temperature, k, p, min_p)
    s32 = (torch.tensor(row) / torch.tensor(temperature, dtype=torch.float32)).tolist()  # float32 like the sampler
    scores = {i: float(torch.tensor(s32[i]) + noise[i]) for i in kept}
    best = max(scores.values())
    return min(i for i, v in scores.items() if v == best)


def near_boundary(row, temperature, k, p, min_p, eps=1e-4) -> bool:
    """A row whose top-p or min-p cut sits within float rounding of a token (the two computations
    may round differently there)."""
    scaled = [float(v) / temperature for v in row]
    order = sorted(range(len(row)), key=lambda i: (-scaled[i], i))
    top = scaled[order[0]]
    if min_p and any(abs(scaled[i] - (top + math.log(min_p))) < eps for i in order):
        return True
    kept = [i for i in order if min_p == 0 or scaled[i] >= top + math.log(min_p)][:k or None]
    z = sum(math.exp(scaled[i] - top) for i in kept)
    before = 0.0
    for i in kept:
        if p < 1 and abs(before - p) < eps:
            return True
        before += math.exp(scaled[i] - top) / z
    return False


@given(st.integers(0, 2 ** 31), st.sampled_from([50, 300, 1000]), st.sampled_from([0.5, 1.0, 3.0]))
def test_filtered_rows_match_the_plain_loop_reference(seed, vocab, spread):
    g = torch.Generator().manual_seed(seed)
    n = 12
    logits = torch.randn(n, vocab, generator=g) * spread
    logits[0, 1] = logits[0, 0]  # a tie
    temperature = [0.7, 1.0, 1.3, 0.5] * 3
    top_k = [0, 1, 5, 40, 0, 0, 7, 0, 200, 0, 3, 0]
    top_p = [0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 0.8, 0.99, 1.0, 0.6, 1.0, 0.9]
    min_p = [0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0]
    seeds = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=g)
    counters = torch.randint(0, 10 ** 6, (n,), generator=g)
    tokens = Sampler().sample(logits, make(logits, temperature, top_k, top_p, min_p, seed0=seeds.tolist(),
                                           counter=counters.tolist())).tokens
    noise = S.gumbel(hash_uniform(seeds, counters, vocab))
    for r in range(n):
        args = (logits[r].tolist(), temperature[r], top_k[r], top_p[r], min_p[r])
        if near_boundary(*args):
            continue
        assert int(tokens[r]) == reference_token(*args, noise[r].tolist()), f"row {r}"


def test_candidate_path_equals_full_sort_and_the_fallback_is_needed():
    """Peaked rows are decided by the candidates, flat ones fall back; both equal the full sort. The
    negative control (no fallback) gets the flat rows wrong."""
    g = torch.Generator().manual_seed(7)
    vocab = 5000
    peaked = torch.randn(16, vocab, generator=g) * 6
    flat = torch.randn(16, vocab, generator=g) * 0.3
    for logits in (peaked, flat):
        b = make(logits, temperature=1.0, top_p=0.9)
        full = Sampler()._draw_full(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.counters)
        assert torch.equal(Sampler().sample(logits, b).tokens, full)

    class NoFallback(Sampler):
        def _draw_full(self, z, *args):
            return torch.full((z.shape[0],), -1, dtype=torch.int64)  # marks the rows that needed it
    assert (NoFallback().sample(peaked, make(peaked, top_p=0.9)).tokens >= 0).all()  # none needed
    assert (NoFallback().sample(flat, make(flat, top_p=0.9)).tokens < 0).all()  # all needed it


# ---- greedy ----

def test_greedy_is_argmax_and_costs_no_noise():
    logits = torch.randn(40, 500, generator=torch.Generator().manual_seed(1))

    class NoNoise(Sampler):
        def noise_at(self, *a):
            raise AssertionError("greedy rows must not draw noise")
    tokens = draw(logits, NoNoise(), temperature=0.0, top_k=[7, 0] * 20, top_p=[0.3, 1.0] * 20)
    assert torch.equal(tokens, logits.argmax(dim=1))


def test_greedy_ties_take_the_first_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert draw(logits, temperature=0.0).tolist() == [1]
    assert draw(logits, top_k=1).tolist() == [1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_equals_greedy(temperature):
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(draw(logits, temperature=temperature, top_k=1), logits.argmax(dim=1))


def test_tiny_top_p_picks_argmax():
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draw(logits, temperature=2.0, top_p=1e-6), logits.argmax(dim=1))


def test_top_k_and_top_p_restrict_the_support_and_renormalise():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    for kw, support, p_first in (({"top_p": 0.7}, {1, 3}, 0.5 / 0.8),  # mass before 2 is 0.8 >= 0.7
                                 ({"top_k": 2}, {1, 3}, 0.5 / 0.8),
                                 ({"top_k": 3, "top_p": 0.9}, {1, 3, 2}, 0.5 / 0.95),
                                 ({"min_p": 0.5}, {1, 3}, 0.5 / 0.8)):  # 0.15 < 0.5 * 0.5
        tokens = draw(logits, **kw)
        assert set(tokens.tolist()) == support
        assert abs((tokens == 1).float().mean().item() - p_first) < 0.03


def test_filters_off_equals_no_filters():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(4)) * 4
    assert torch.equal(draw(logits, temperature=1.3), draw(logits, temperature=1.3, top_k=1000, top_p=1.0))


# ---- the sampled distribution and the noise ----

def chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("vary", ["seed", "counter"])
def test_distribution_matches_softmax(temperature, vary):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 20000
    logits = base.expand(n, 6).contiguous()
    kw = {"seed0": 99, "counter": list(range(n))} if vary == "counter" else {}
    if vary == "counter":
        kw["seed0"] = [99] * n
    tokens = draw(logits, temperature=temperature, **kw)
    assert chi_square(tokens, torch.softmax(base / temperature, 0)) < CHI2_DF5_P001
    # negative control: the same test rejects a slightly different distribution
    assert chi_square(tokens, torch.softmax(base / (temperature * 1.15), 0)) > CHI2_DF5_P001


def _reference_uniform(seeds, counters, vocab):
    """The counter-based hash written with int64 ops emulating uint32 (the original form)."""
    m32 = 0xFFFFFFFF

    def mul(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & m32

    def fmix(h):
        h = h ^ (h >> 16)
        h = mul(h, 0x85EBCA6B)
        h = h ^ (h >> 13)
        h = mul(h, 0xC2B2AE35)
        return h ^ (h >> 16)
    words = [seeds & m32, (seeds >> 32) & m32, counters & m32, (counters >> 32) & m32]
    k1, k2 = torch.full_like(seeds, 0x9E3779B9), torch.full_like(seeds, 0x7F4A7C15)
    for w in words:
        k1, k2 = fmix(k1 ^ w), fmix((k2 + w * 0x2545) & m32)
    idx = mul(torch.arange(vocab), 0x9E3779B1)
    h = fmix(idx[None, :] ^ k1[:, None])
    h = fmix((h + k2[:, None]) & m32)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def test_int32_hash_equals_the_int64_form_and_candidate_noise_equals_full():
    seeds = torch.tensor([0, 1, -1, 2 ** 63 - 1, -2 ** 63, 123456789012345])
    counters = torch.tensor([0, 5, 2 ** 40, 7, 2 ** 62, 3])
    u = hash_uniform(seeds, counters, 3000)
    assert torch.equal(u, _reference_uniform(seeds, counters, 3000))
    idx = torch.randint(0, 3000, (6, 17))
    assert torch.equal(hash_uniform_at(seeds, counters, idx), u.gather(1, idx))


def test_hash_uniform_is_uniform_and_strictly_inside_0_1():
    u = hash_uniform(torch.arange(200), torch.full((200,), 3), 5000)  # [200, 5000]
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    assert float(((hist - expected) ** 2 / expected).sum()) < 60  # chi-square, 19 df: p << 0.001 at 43
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1])) < 0.2


# ---- batch independence, every extra included ----

class GlobalGeneratorSampler(Sampler):
    """Negative control: Gumbel noise from one shared generator, reseeded per call as a naive
    'deterministic' sampler would be. Row r's noise then depends on the rows before it."""

    def noise_at(self, seeds, counters, index):
        gen = torch.Generator().manual_seed(int(seeds[0]) if len(seeds) else 0)
        shape = (len(seeds), index.shape[-1])
        u = torch.rand(shape, generator=gen).clamp(1e-7, 1 - 1e-7)
        return -torch.log(-torch.log(u))


def mixed(n=24, vocab=300):
    """Logits and per-row requests using every sampling feature."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = []
    for i in range(n):
        rows.append(dict(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[0, 1, 5, 50, 0][i % 5],
                         top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.0, 0.1, 0.0][i % 4 - 1],
                         seed=int(torch.randint(-2 ** 62, 2 ** 62, (1,), generator=g)),
                         counter=int(torch.randint(0, 10 ** 6, (1,), generator=g)),
                         bias={3: 5.0, 7: -100.0} if i % 3 == 0 else {}, ban=[0, 1] if i % 4 == 1 else [],
                         pen=(1.3, 0.4, 0.2) if i % 5 == 2 else None, logprobs=[None, 0, 3][i % 3],
                         tokens=torch.randint(0, vocab, (5 + i,), generator=g).tolist(), prompt_len=3))
    return logits, rows


def batch_of(rows, vocab):
    bias = ([i for i, r in enumerate(rows) for _ in r["bias"]], [t for r in rows for t in r["bias"]],
            [v for r in rows for v in r["bias"].values()])
    ban = ([i for i, r in enumerate(rows) for _ in r["ban"]], [t for r in rows for t in r["ban"]])
    pr = [i for i, r in enumerate(rows) if r["pen"]]
    pen = None
    if pr:
        width = max(len(rows[i]["tokens"]) for i in pr)
        toks = torch.tensor([rows[i]["tokens"] + [0] * (width - len(rows[i]["tokens"])) for i in pr])
        pen = Penalties(torch.tensor(pr), *(torch.tensor([rows[i]["pen"][j] for i in pr]) for j in range(3)), toks,
                        torch.tensor([rows[i]["prompt_len"] for i in pr]),
                        torch.tensor([len(rows[i]["tokens"]) for i in pr]))
    return SamplingBatch.build(vocab, [r["temperature"] for r in rows], [r["top_k"] for r in rows],
                               [r["top_p"] for r in rows], [r["seed"] for r in rows], [r["counter"] for r in rows],
                               [r["min_p"] for r in rows], bias=bias if bias[0] else None,
                               ban=ban if ban[0] else None, penalties=pen, logprobs=[r["logprobs"] for r in rows])


def results(sampler, logits, rows):
    out = sampler.sample(logits, batch_of(rows, logits.shape[1]))
    res = [[int(t)] for t in out.tokens]
    q = [i for i, r in enumerate(rows) if r["logprobs"] is not None]
    for j, i in enumerate(q):
        res[i] += [float(out.logprob[j])] + ([] if out.top_ids is None else
                                             out.top_ids[j, :rows[i]["logprobs"]].tolist())
    return res


def batch_independent(sampler) -> bool:
    """A row's token (and logprobs) are the same alone, in the whole batch, permuted and split."""
    logits, rows = mixed()
    n = len(rows)
    whole = results(sampler, logits, rows)
    alone = [results(sampler, logits[i:i + 1], rows[i:i + 1])[0] for i in range(n)]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(6)).tolist()
    permuted = [None] * n
    for j, r in enumerate(results(sampler, logits[perm], [rows[i] for i in perm])):
        permuted[perm[j]] = r
    split = results(sampler, logits[:10], rows[:10]) + results(sampler, logits[10:], rows[10:])
    return whole == alone == permuted == split


def test_sample_does_not_depend_on_the_batch():
    assert batch_independent(Sampler())


def test_negative_control_shared_generator_is_batch_dependent():
    assert not batch_independent(GlobalGeneratorSampler())


def test_same_inputs_same_token_and_counter_or_seed_change_it():
    logits = torch.zeros(1, 1000)  # flat: every token equally likely
    once = [draw(logits, seed0=7, counter=c).item() for c in range(100)]
    again = [draw(logits, seed0=7, counter=c).item() for c in range(100)]
    other_seed = [draw(logits, seed0=8, counter=c).item() for c in range(100)]
    assert once == again
    assert len(set(once)) > 80
    assert sum(a != b for a, b in zip(once, other_seed)) > 90
    out = Sampler().sample(logits.expand(2, 1000), make(logits.expand(2, 1000), seed0=[-2 ** 63, 2 ** 63 - 1],
                                                         counter=[0, 2 ** 62]))
    assert bool(out.finite.all())


# ---- logprobs and logit processors against independent computations ----

def test_logprobs_equal_float64_log_softmax_of_the_same_logits():
    logits, rows = mixed()
    out = Sampler().sample(logits, batch_of(rows, logits.shape[1]))
    ref = torch.log_softmax(logits.double(), dim=1)  # independent: float64, every row
    q = [i for i, r in enumerate(rows) if r["logprobs"] is not None]
    got = out.logprob.double()
    want = ref[q].gather(1, out.tokens[q][:, None]).squeeze(1)
    assert float((got - want).abs().max()) < 1e-6
    n = max(rows[i]["logprobs"] for i in q)
    top_ref = ref[q].topk(n, dim=1)
    assert float((out.top_logprobs.double() - top_ref.values).abs().max()) < 1e-6
    assert torch.equal(out.top_ids, top_ref.indices)


def reference_processed(row, r):
    """A row's logits after its penalties, bias and ban, by a plain loop."""
    x = [float(v) for v in row]
    if r["pen"]:
        rep, freq, pres = r["pen"]
        prompt, output = r["tokens"][:r["prompt_len"]], r["tokens"][r["prompt_len"]:]
        for t in range(len(x)):
            c = output.count(t)
            if t in prompt or c:
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            x[t] -= freq * c + (pres if c else 0.0)
    for t, v in r["bias"].items():
        x[t] += v
    for t in r["ban"]:
        x[t] = float("-inf")
    return x


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits, rows = mixed(n=40)
    for r in rows:
        r["temperature"] = 0.0
    out = Sampler().sample(logits, batch_of(rows, logits.shape[1]))
    for i, r in enumerate(rows):
        x = reference_processed(logits[i].tolist(), r)
        assert int(out.tokens[i]) == max(range(len(x)), key=lambda t: (x[t], -t)), i
    assert any(r["pen"] for r in rows) and any(r["bias"] for r in rows) and any(r["ban"] for r in rows)


def test_processed_rows_sample_from_the_processed_logits():
    logits, rows = mixed(n=40)
    b = batch_of(rows, logits.shape[1])
    processed = torch.tensor([reference_processed(logits[i].tolist(), r) for i, r in enumerate(rows)],
                             dtype=torch.float32)
    plain_rows = [dict(r, bias={}, ban=[], pen=None) for r in rows]
    want = Sampler().sample(processed, batch_of(plain_rows, logits.shape[1])).tokens
    got = Sampler().sample(logits, b).tokens
    assert torch.equal(got, want)


# ---- non-finite rows, shapes, no host reads ----

def test_non_finite_rows_are_flagged_and_do_not_disturb_others():
    logits, rows = mixed(n=8)
    good = Sampler().sample(logits, batch_of(rows, 300))
    bad = logits.clone()
    bad[1, 3], bad[4, 0], bad[6, 299] = float("nan"), float("inf"), float("-inf")
    out = Sampler().sample(bad, batch_of(rows, 300))
    assert out.finite.tolist() == [True, False, True, True, False, True, False, True]
    keep = out.finite.nonzero().flatten()
    assert torch.equal(out.tokens[keep], good.tokens[keep])
    assert bool(((out.tokens >= 0) & (out.tokens < 300)).all())


def test_no_host_reads_of_tensor_data_outside_the_filtered_rows():
    """On the meta device there is no data: any .item(), .tolist() or branch on a value raises. Greedy
    rows, plain sampling rows, penalties, bias, bans and logprobs read nothing back; only the
    filtered rows' fallback decision reads one bool per row (module docstring)."""
    logits, rows = mixed(n=6)
    for r in rows:
        r["top_k"], r["top_p"], r["min_p"] = 0, 1.0, 0.0
    b = batch_of(rows, 300)
    meta = SamplingBatch(**{f.name: (getattr(b, f.name).to("meta") if isinstance(getattr(b, f.name), torch.Tensor)
                                     else getattr(b, f.name)) for f in dataclasses.fields(b) if f.name not in (
        "bias", "ban", "penalties")}, bias=tuple(t.to("meta") for t in b.bias), ban=tuple(t.to("meta") for t in b.ban),
                        penalties=Penalties(*(getattr(b.penalties, f.name).to("meta")
                                              for f in dataclasses.fields(b.penalties))))
    out = Sampler().sample(logits.to("meta"), meta)
    assert out.tokens.shape == (6,) and out.tokens.dtype == torch.int64 and out.finite.dtype == torch.bool


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 rows of parameters for 2 rows of logits"):
        Sampler().sample(torch.zeros(2, 5), make(torch.zeros(3, 5)))


# ---- SamplingParams ----

def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == \
        (16, 1.0, 1.0, 0, None, [], [], False)
    assert (p.min_p, p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
            p.logprobs) == (0.0, 0, 0.0, 0.0, 1.0, {}, None)
    q = SamplingParams(temperature=0, stop="\n\n", stop_token_ids=(np.int64(5),), seed=np.int64(3), max_tokens=1,
                       logit_bias={"7": 1})
    assert q.greedy and q.stop == ["\n\n"] and q.stop_token_ids == [5] and type(q.seed) is int
    assert isinstance(q.temperature, float) and q.logit_bias == {7: 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_p = 2.0


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": 0}, "max_tokens=0: must be >= 1"),
    ({"max_tokens": 1.5}, "max_tokens=1.5: must be an integer, got float"),
    ({"max_tokens": True}, "max_tokens=True: must be an integer, got bool"),
    ({"temperature": -0.1}, "temperature=-0.1: must be >= 0"),
    ({"temperature": math.nan}, "temperature=nan: must be finite"),
    ({"temperature": 10 ** 400}, "must be finite"),
    ({"temperature": "1"}, "temperature='1': must be a number, got str"),
    ({"top_p": 1.5}, "top_p=1.5: must be in (0, 1]"),
    ({"top_p": 0}, "top_p=0.0: must be in (0, 1]"),
    ({"top_p": 1e-46}, "rounds to 0 in float32"),
    ({"top_p": None}, "top_p=None: must be a number"),
    ({"top_k": -1}, "top_k=-1: must be 0 (off) or >= 1"),
    ({"top_k": 2.0}, "top_k=2.0: must be an integer"),
    ({"top_k": 2 ** 63}, "must fit in a signed 64-bit integer"),
    ({"seed": 2 ** 64}, f"seed={2 ** 64}: must fit in a signed 64-bit integer"),
    ({"seed": "42"}, "seed='42': must be an integer"),
    ({"stop": [""]}, "stop[0]='': must be non-empty"),
    ({"stop": ["ok", 1]}, "stop[1]=1: must be a string"),
    ({"stop": 5}, "stop=5: must be a string or a list of strings"),
    ({"stop": ["x"] * 33}, "at most 32 stop strings"),
    ({"stop": ["x" * 5000]}, "4096 characters in all"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]=-1: must be >= 0"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]='a': must be an integer"),
    ({"stop_token_ids": 3}, "stop_token_ids=3: must be a list of integers"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes': must be true or false"),
    ({"min_p": 1.5}, "min_p=1.5: must be in [0, 1]"),
    ({"min_tokens": 20}, "min_tokens=20: must be in [0, max_tokens=16]"),
    ({"presence_penalty": 3}, "presence_penalty=3.0: must be in [-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5: must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty=0.0: must be in [0.01, 100]"),
    ({"logit_bias": {5: 101}}, "logit_bias[5]=101.0: must be in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias key='x': must be an integer"),
    ({"logit_bias": [1]}, "logit_bias=[1]: must be a mapping"),
    ({"logprobs": 21}, "logprobs=21: must be in [0, 20]"),
])
def test_sampling_params_validation_names_field_and_value(kwargs, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_with_seed_is_replace_with_the_seed_and_containers_of_its_own():
    p = SamplingParams(temperature=0.7, top_k=5, stop=["x"], stop_token_ids=[3], logit_bias={7: 1.5}, logprobs=2)
    q = p.with_seed(2**62 - 1)
    assert q == dataclasses.replace(p, seed=2**62 - 1) and p.seed is None
    assert q.stop is not p.stop and q.stop_token_ids is not p.stop_token_ids and q.logit_bias is not p.logit_bias
    for bad in (2**63, True, 1.0):
        with pytest.raises(InvalidRequest, match="seed="):
            p.with_seed(bad)


def test_sampling_params_from_dict():
    assert SamplingParams.from_dict({"temperature": 0.5, "stop": ["x"]}) == SamplingParams(temperature=0.5, stop=["x"])
    with pytest.raises(InvalidRequest, match=r"unknown sampling parameter\(s\) \['best_of'\]"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(InvalidRequest, match="top_k=-2"):
        SamplingParams.from_dict({"top_k": -2})


@given(rows=st.integers(1, 12), vocab=st.integers(2, 300), seed=st.integers(0, 2**31), bad=st.sets(st.integers(0, 11)),
       ties=st.booleans())
def test_the_greedy_shortcut_gives_what_sample_gives_greedy_rows(rows, vocab, seed, bad, ties):
    """Sampler.greedy (the engine's path when every row is plain greedy) gives the tokens and finite
    flags that Sampler.sample gives the same rows: ties to the lowest id, a NaN or inf row flagged."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if ties:
        logits = logits.round()  # many equal maxima
    for r in bad:
        if r < rows:
            logits[r, r % vocab] = (float("nan"), float("inf"), float("-inf"))[r % 3]
    batch = SamplingBatch.build(vocab, [0.0] * rows, [0] * rows, [1.0] * rows, list(range(rows)), [0] * rows)
    full, short = Sampler().sample(logits, batch), Sampler().greedy(logits)
    assert torch.equal(full.tokens, short.tokens) and torch.equal(full.finite, short.finite)
