"""Sampler: greedy, masks, the sampled distribution, batch independence (with a negative control),
non-finite rows, no host reads of tensor data; SamplingParams validation."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from engram_serve.errors import InvalidRequest
from engram_serve.runner.sampler import Sampler, hash_uniform
from engram_serve.sampling_params import SamplingParams


def rows(n, temperature=1.0, top_k=0, top_p=1.0, seed0=12345, counter=0):
    """Per-row parameter tensors for n rows with seeds seed0, seed0+1, ..."""
    return (torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.int64),
            torch.full((n,), float(top_p)), torch.arange(n, dtype=torch.int64) + seed0,
            torch.full((n,), counter, dtype=torch.int64))


def sample(logits, params, sampler=None, **kw):
    return (sampler or Sampler()).sample(logits, *params, **kw)


# ---- greedy and masks ----

def test_greedy_is_argmax():
    logits = torch.randn(40, 500, generator=torch.Generator().manual_seed(1))
    params = rows(40, temperature=0.0)
    params[1][::3] = 7  # top-k / top-p do not move an argmax
    params[2][::2] = 0.3
    tokens, finite = sample(logits, params)
    assert torch.equal(tokens, logits.argmax(dim=1)) and bool(finite.all())


def test_greedy_ties_take_the_first_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(logits, rows(1, temperature=0.0))[0].tolist() == [1]
    assert sample(logits, rows(1, top_k=1))[0].tolist() == [1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_equals_greedy(temperature):
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    tokens, _ = sample(logits, rows(300, temperature=temperature, top_k=1))
    assert torch.equal(tokens, logits.argmax(dim=1))


def test_tiny_top_p_picks_argmax():
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    tokens, _ = sample(logits, rows(300, temperature=2.0, top_p=1e-6))
    assert torch.equal(tokens, logits.argmax(dim=1))


def test_top_k_and_top_p_restrict_the_support_and_renormalise():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    for params, support, p_first in ((rows(n, top_p=0.7), {1, 3}, 0.5 / 0.8),  # mass before 2 is 0.8 >= 0.7
                                     (rows(n, top_k=2), {1, 3}, 0.5 / 0.8),
                                     (rows(n, top_k=3, top_p=0.9), {1, 3, 2}, 0.5 / 0.95)):
        tokens, _ = sample(logits, params)
        assert set(tokens.tolist()) == support
        assert abs((tokens == 1).float().mean().item() - p_first) < 0.03


def test_filters_off_equals_filters_with_nothing_to_filter():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(4)) * 4
    params = rows(64, temperature=1.3)
    assert torch.equal(sample(logits, params)[0], sample(logits, params, filters=False)[0])


# ---- the sampled distribution ----

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
    params = list(rows(n, temperature=temperature))
    if vary == "counter":  # one request, many output positions
        params[3], params[4] = torch.full((n,), 99, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    tokens, _ = sample(logits, params)
    assert chi_square(tokens, torch.softmax(base / temperature, 0)) < CHI2_DF5_P001
    # negative control: the same test rejects a slightly different distribution
    assert chi_square(tokens, torch.softmax(base / (temperature * 1.15), 0)) > CHI2_DF5_P001


def test_hash_uniform_is_uniform_and_strictly_inside_0_1():
    u = hash_uniform(torch.arange(200), torch.full((200,), 3), 5000)  # [200, 5000]
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    assert float(((hist - expected) ** 2 / expected).sum()) < 60  # chi-square, 19 df: p << 0.001 at 43
    # neighbouring rows and columns are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1])) < 0.2


# ---- batch independence ----

class GlobalGeneratorSampler(Sampler):
    """Negative control: Gumbel noise from one shared generator (torch.rand), reseeded per call as a
    naive 'deterministic' sampler would be. Row r's noise then depends on the rows before it."""

    def noise(self, seeds, counters, vocab):
        gen = torch.Generator().manual_seed(int(seeds[0]) if len(seeds) else 0)
        u = torch.rand(len(seeds), vocab, generator=gen).clamp(1e-7, 1 - 1e-7)
        return -torch.log(-torch.log(u))


def mixed_batch(n=24, vocab=300):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5])[torch.arange(n) % 4]
    top_k = torch.tensor([0, 1, 5, 50, 0])[torch.arange(n) % 5]
    top_p = torch.tensor([1.0, 0.9, 0.5])[torch.arange(n) % 3]
    seeds = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=g)
    counters = torch.randint(0, 10 ** 6, (n,), generator=g)
    return logits, (temperature, top_k, top_p, seeds, counters)


def batch_independent(sampler) -> bool:
    """A row's token is the same alone, in the whole batch, in a permuted batch and in microbatches."""
    logits, params = mixed_batch()
    n = len(logits)
    whole, _ = sample(logits, params, sampler)
    alone = torch.cat([sample(logits[i:i + 1], [p[i:i + 1] for p in params], sampler)[0] for i in range(n)])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    permuted = torch.empty_like(whole)
    permuted[perm] = sample(logits[perm], [p[perm] for p in params], sampler)[0]
    cut = 10
    split = torch.cat([sample(logits[:cut], [p[:cut] for p in params], sampler)[0],
                       sample(logits[cut:], [p[cut:] for p in params], sampler)[0]])
    return all(torch.equal(whole, other) for other in (alone, permuted, split))


def test_sample_does_not_depend_on_the_batch():
    assert batch_independent(Sampler())


def test_negative_control_shared_generator_is_batch_dependent():
    assert not batch_independent(GlobalGeneratorSampler())


def test_same_inputs_same_token_and_counter_or_seed_change_it():
    logits = torch.zeros(1, 1000)  # flat: every token equally likely
    once = [sample(logits, rows(1, seed0=7, counter=c))[0].item() for c in range(100)]
    again = [sample(logits, rows(1, seed0=7, counter=c))[0].item() for c in range(100)]
    other_seed = [sample(logits, rows(1, seed0=8, counter=c))[0].item() for c in range(100)]
    assert once == again
    assert len(set(once)) > 80  # the counter moves the noise
    assert sum(a != b for a, b in zip(once, other_seed)) > 90  # so does the seed
    huge = sample(logits.expand(2, 1000), (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                                           torch.tensor([-2 ** 63, 2 ** 63 - 1]), torch.tensor([0, 2 ** 62])))
    assert bool(huge[1].all())


# ---- non-finite rows, shapes, no host reads ----

def test_non_finite_rows_are_flagged_and_do_not_disturb_others():
    logits, params = mixed_batch(n=8)
    good, _ = sample(logits, params)
    bad = logits.clone()
    bad[1, 3], bad[4, 0], bad[6, 299] = float("nan"), float("inf"), float("-inf")
    tokens, finite = sample(bad, params)
    assert finite.tolist() == [True, False, True, True, False, True, False, True]
    keep = finite.nonzero().flatten()
    assert torch.equal(tokens[keep], good[keep])
    assert bool(((tokens >= 0) & (tokens < 300)).all())  # bad rows still give an index, never a crash


def test_no_host_reads_of_tensor_data():
    """On the meta device there is no data: any .item(), .tolist() or branch on a value raises."""
    logits, params = mixed_batch(n=6)
    tokens, finite = Sampler().sample(logits.to("meta"), *[p.to("meta") for p in params])
    assert tokens.shape == (6,) and tokens.dtype == torch.int64 and finite.dtype == torch.bool


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"top_p has shape \(3,\), expected \(2,\)"):
        Sampler().sample(torch.zeros(2, 5), torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(3),
                         torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


# ---- SamplingParams ----

def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == \
        (16, 1.0, 1.0, 0, None, [], [], False)
    q = SamplingParams(temperature=0, stop="\n\n", stop_token_ids=(np.int64(5),), seed=np.int64(3), max_tokens=1)
    assert q.greedy and q.stop == ["\n\n"] and q.stop_token_ids == [5] and type(q.seed) is int
    assert isinstance(q.temperature, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_p = 2.0


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": 0}, "max_tokens=0: must be >= 1"),
    ({"max_tokens": 1.5}, "max_tokens=1.5: must be an integer, got float"),
    ({"max_tokens": True}, "max_tokens=True: must be an integer, got bool"),
    ({"temperature": -0.1}, "temperature=-0.1: must be >= 0"),
    ({"temperature": math.nan}, "temperature=nan: must be finite"),
    ({"temperature": "1"}, "temperature='1': must be a number, got str"),
    ({"top_p": 1.5}, "top_p=1.5: must be in (0, 1]"),
    ({"top_p": 0}, "top_p=0.0: must be in (0, 1]"),
    ({"top_p": None}, "top_p=None: must be a number"),
    ({"top_k": -1}, "top_k=-1: must be 0 (off) or >= 1"),
    ({"top_k": 2.0}, "top_k=2.0: must be an integer"),
    ({"seed": 2 ** 64}, f"seed={2 ** 64}: must fit in a signed 64-bit integer"),
    ({"seed": "42"}, "seed='42': must be an integer"),
    ({"stop": [""]}, "stop[0]='': must be non-empty"),
    ({"stop": ["ok", 1]}, "stop[1]=1: must be a string"),
    ({"stop": 5}, "stop=5: must be a string or a list of strings"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]=-1: must be >= 0"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]='a': must be an integer"),
    ({"stop_token_ids": 3}, "stop_token_ids=3: must be a list of integers"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes': must be true or false"),
])
def test_sampling_params_validation_names_field_and_value(kwargs, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_sampling_params_from_dict():
    assert SamplingParams.from_dict({"temperature": 0.5, "stop": ["x"]}) == SamplingParams(temperature=0.5, stop=["x"])
    with pytest.raises(InvalidRequest, match=r"unknown sampling parameter\(s\) \['best_of'\]"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(InvalidRequest, match="top_k=-2"):
        SamplingParams.from_dict({"top_k": -2})
