"""Speculative decoding changes speed, never a result (docs/contract.md §13).

A run with drafts is compared with the plain run of the same requests: every token, logprob and finish reason,
and (through `verify.run_case`, which records only the positions whose computation stands) every hash id,
staged Engram row and logit, bit for bit. The drafters are adversarial: always right (the plain run's own
tokens), always wrong, right with random errors at every draft position, uniformly random, the DSpark noise
token, coupled through the sampler's noise, prompt lookup. The sweep covers k, microbatch cuts (inside draft
blocks too), prefill chunks, batch mates, preemption, prefix reuse and sampling parameters, on the built-in
model and on random V4.1 configs.

Negative controls through the real forward, each a protection switched off: a rejected token kept in the open
ratio-2 pair, kept in the Engram history, counted in the penalty counts. Each goes red.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve.engine.driver import EngineDriver
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.engine.scheduler import Scheduler, SchedulerConfig
from engram_serve.engine.sequence import Sequence
from engram_serve.errors import ConfigError
from engram_serve.inputs.token_store import TokenStore
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model.loader import load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from engram_serve.sampling_params import SamplingParams
from engram_serve.spec.acceptance import accepted_drafts, accepted_drafts_loop
from engram_serve.spec.config import SpeculativeConfig
from engram_serve.spec.drafters import (CoupledDrafter, NgramDrafter, NoiseDrafter, OracleDrafter, RandomDrafter)
from engram_serve.spec.dspark_drafter import DSparkDrafter
from engram_serve.spec.planner import SpecPlanner
from engram_serve.verify import Workload, compare, run_case
from test_exact import write_v41_checkpoint
from v41_fixtures import v41_configs

DRAFTERS = ("right", "wrong", "mixed", "random", "noise", "coupled", "ngram", "dspark")
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "top-k/top-p, logprobs": dict(temperature=0.9, top_k=40, top_p=0.9, logprobs=3),
    "penalties, bias, min_tokens": dict(temperature=0.7, repetition_penalty=1.4, frequency_penalty=0.8,
                                        presence_penalty=0.5, logit_bias={7: 2.0, 11: -3.0}, min_tokens=4,
                                        logprobs=0),
    "stop token ids": dict(temperature=0.0),
}


@pytest.fixture(scope="module", params=["built-in", "random"])
def loaded(request, tmp_path_factory):
    if request.param == "built-in":
        return load_model()
    return load_model(make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=5))


def vocab_of(loaded) -> int:
    return min(int(loaded.token_map.shape[0]), loaded.config.vocab_size)


def drafter_for(kind: str, loaded, outputs: dict, seed: int):
    vocab = vocab_of(loaded)
    return {"right": lambda: OracleDrafter(outputs, vocab), "wrong": lambda: OracleDrafter(outputs, vocab, wrong=True),
            "mixed": lambda: OracleDrafter(outputs, vocab, error_rate=0.3, seed=seed),
            "random": lambda: RandomDrafter(vocab, seed), "noise": lambda: NoiseDrafter(vocab - 1),
            "coupled": lambda: CoupledDrafter(vocab), "ngram": lambda: NgramDrafter(1, 3)}[kind]()


def events_of(rec) -> list:
    return rec.events


def config(n: int, longest: int, microbatches: int = 1, chunk: int | None = None, small_pool: bool = False,
           block: int = 16, cpu_graphs: bool = True) -> RunnerConfig:
    budget = max(chunk or 256, n)
    blocks = longest // block + 2 if small_pool else n * (longest // block + 2) + 8
    return RunnerConfig(max_num_seqs=n, max_model_len=longest, max_num_batched_tokens=budget, block_size=block,
                        num_blocks=blocks, microbatch=MicrobatchConfig(microbatches, "tokens", 0, 0, when="always"),
                        cpu_graphs=cpu_graphs)


def assert_same(base, rec, work) -> None:
    res = compare(base, rec, work)
    bad = {k: v for k, v in res.items() if k != "compared_tokens" and v}
    assert not bad, bad
    assert rec.tokens == base.tokens
    assert rec.outputs == base.outputs  # every token's logprob, top logprobs and finish reason


# ---- the accept rule ---------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**16)), min_size=1, max_size=8))
def test_the_vectorised_accept_rule_is_the_plain_loop(groups):
    rng = np.random.default_rng(sum(s for _, s in groups))
    ks = [k for k, _ in groups]
    drafts = rng.integers(0, 3, sum(ks))  # few ids: matches are common
    tokens = rng.integers(0, 3, sum(ks) + len(ks))
    finite = rng.random(len(tokens)) > 0.1
    assert accepted_drafts(tokens, finite, drafts, np.array(ks)).tolist() == \
        accepted_drafts_loop(tokens.tolist(), finite.tolist(), drafts.tolist(), ks)


# ---- the engine: every result equals the plain run's -------------------------------------------------------

def plain_and_speculative(loaded, prompts, params, kind, k, seed, **cfg):
    work = Workload(prompts, params.max_tokens)
    longest = max(map(len, prompts)) + params.max_tokens
    base = run_case(loaded, work, config(len(prompts), longest), params=params)
    outputs = {f"r{i}": t for i, t in enumerate(base.tokens)}
    spec, drafter = SpeculativeConfig("random", k, when="always"), None
    if kind == "dspark":  # the checkpoint's drafter, built by the engine over its cache
        block = loaded.config.dspark.dspark_block_size
        spec = SpeculativeConfig("dspark", min(k, block), when="always", block_size=block)
    else:
        drafter = drafter_for(kind, loaded, outputs, seed)
    rec = run_case(loaded, work, config(len(prompts), longest, **{x: v for x, v in cfg.items() if x != "reuse"}),
                   params=params, speculative=spec, drafter=drafter,
                   reuse_prefix=cfg.get("reuse", False))
    return base, rec, work


@settings(max_examples=24, deadline=None)
@given(seed=st.integers(0, 2**16), mates=st.integers(0, 3), k=st.integers(1, 5), kind=st.sampled_from(DRAFTERS),
       sampling=st.sampled_from(sorted(SAMPLING)), microbatches=st.integers(1, 3),
       chunk=st.sampled_from([None, 3, 17]), small_pool=st.booleans(), reuse=st.booleans(),
       block=st.sampled_from([5, 16]))
def test_speculation_never_changes_a_token_logprob_or_logit(loaded, seed, mates, k, kind, sampling, microbatches,
                                                            chunk, small_pool, reuse, block):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(6, vocab_of(loaded), int(n)).tolist() for n in rng.integers(1, 40, mates + 1)]
    if mates:  # a mate sharing the first one's prefix (a prefix-cache hit)
        prompts[1] = prompts[0][:12] + prompts[1]
    extra = dict(SAMPLING[sampling])
    if sampling == "stop token ids":  # stop ids the plain run samples: the stop falls inside accepted runs
        free = run_case(loaded, Workload(prompts, 12), config(len(prompts), max(map(len, prompts)) + 12),
                        params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        late = ({x for i, x in enumerate(t) if i >= len(t) // 2 and x not in t[:i]} for t in free.tokens)
        extra["stop_token_ids"] = sorted({min(ids) for ids in late if ids})  # first sampled in the second half
    params = SamplingParams(max_tokens=12, seed=seed, ignore_eos=sampling != "stop token ids", **extra)
    base, rec, work = plain_and_speculative(loaded, prompts, params, kind, k, seed, microbatches=microbatches,
                                            chunk=chunk, small_pool=small_pool and mates > 0, reuse=reuse,
                                            block=block)
    assert_same(base, rec, work)
    if kind == "right" and chunk is None and not small_pool and max(map(len, base.tokens)) >= 3:
        assert rec.spec["accepted_tokens"] > 0 and rec.steps < base.steps  # the point of it: fewer steps
    if kind == "wrong":
        assert rec.spec["accepted_tokens"] == 0


@settings(max_examples=8, deadline=None)
@given(config_=v41_configs(tiny_tokenizer=True).filter(lambda c: c["engram_layer_ids"]), seed=st.integers(0, 2**16),
       k=st.integers(1, 4),
       kind=st.sampled_from(["mixed", "wrong", "noise"]), microbatches=st.integers(1, 2))
def test_speculation_never_changes_a_result_on_random_v41_configs(tmp_path_factory, config_, seed, k, kind,
                                                                   microbatches):
    """(Configs with Engram layers, as tests/test_exact.py draws them: `run_case` records the staged rows, and a
    microbatch whose forward never waits for its gather may have it cancelled before it ran.)"""
    path, _ = write_v41_checkpoint(tmp_path_factory.mktemp("v41"), config_, seed)
    lm = load_model(path)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(6, vocab_of(lm), int(n)).tolist() for n in rng.integers(1, 25, 2)]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=seed, ignore_eos=True, logprobs=1)
    base, rec, work = plain_and_speculative(lm, prompts, params, kind, k, seed, microbatches=microbatches)
    assert_same(base, rec, work)


def test_cuts_inside_draft_blocks_keep_every_bit(loaded):
    """One request, every step cut in two by tokens: a verify row of 1 + k tokens is cut inside its drafts."""
    prompts = [list(range(20, 45))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base, rec, work = plain_and_speculative(loaded, prompts, params, "mixed", 4, 1, microbatches=2)
    assert_same(base, rec, work)
    assert rec.coverage.draft_bounds > 0 and 0 < rec.spec["accepted_tokens"] < rec.spec["draft_tokens"]


@pytest.mark.parametrize("sampling, microbatches, chunk, small_pool, reuse", [
    ("greedy", 2, None, False, False), ("top-k/top-p, logprobs", 3, 3, False, True),
    ("penalties, bias, min_tokens", 1, 17, True, False), ("stop token ids", 2, 17, True, True)])
def test_dspark_drafts_never_change_a_result(loaded, sampling, microbatches, chunk, small_pool, reuse):
    """The checkpoint's drafter (the built-in model's trained one, the random checkpoint's random one) under cuts
    inside draft blocks, prefill chunks, preemption (a pool for one request) and prefix reuse."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(6, vocab_of(loaded), int(n)).tolist() for n in (30, 9, 21)]
    prompts[1] = prompts[0][:16] + prompts[1]
    extra = dict(SAMPLING[sampling])
    if sampling == "stop token ids":
        extra["stop_token_ids"] = [int(t) for t in rng.integers(6, vocab_of(loaded), 40)]
    params = SamplingParams(max_tokens=14, seed=3, ignore_eos=sampling != "stop token ids", **extra)
    base, rec, work = plain_and_speculative(loaded, prompts, params, "dspark", 5, 0, microbatches=microbatches,
                                            chunk=chunk, small_pool=small_pool, reuse=reuse)
    assert_same(base, rec, work)
    assert rec.spec["drafts"] > 0
    if small_pool:
        assert rec.preemptions > 0


# ---- the DSpark drafter in the engine drafts what DSpark.draft drafts on the committed context ------------------

class RecordingDSpark(DSparkDrafter):
    """Keeps every proposal: (the request's committed tokens, the draft's logits [k, V], its tokens [k]).
    `shift` (a negative control): observes each token with the features of the token `shift` before it."""

    shift = 0

    def __init__(self, *a):
        super().__init__(*a)
        self.log, self.asked, self.observed = [], 0, []

    def observe(self, positions, slots, features, keep=True):
        self.observed.append((keep, features is not None))
        if self.shift and features is not None:
            features = torch.roll(features, self.shift, 0)
        super().observe(positions, slots, features, keep)

    def propose(self, requests, pick):
        self.asked += len(requests)
        out = super().propose(requests, pick)
        self.log += [(list(r.token_ids), self.last.logits[i].clone(), self.last.tokens[i].tolist())
                     for i, r in enumerate(self.drafted)]
        return out


class ReadsStaleSlots(RecordingDSpark):
    check_ready = False  # drafts for a request whose window holds slots never written, or dropped


class LeavesEndedRowsUnreported(LLMEngine):
    report_ended_rows = False  # a request that ends in a step: its last rows' keys never written


class DropsContext(SpecPlanner):
    """Drafts in every decode step but those of `off` (decode steps counted from 0), in which it lets the drafter
    drop its context."""

    off = range(2, 10)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.decode_step = -1

    def speculate(self, num_decodes: int) -> bool:
        self.decode_step += num_decodes > 0
        return not num_decodes or self.decode_step not in self.off

    def needs_context(self, num_decodes: int, lead: int) -> bool:
        return not num_decodes or self.decode_step not in self.off


def direct_draft(lm, ids: list[int]):
    """DSpark.draft run directly for committed tokens `ids` (the last one not computed): the target's features of
    0 .. n - 1 from `forward_dense`, written in a fresh state, the draft at n with the engine's greedy pick."""
    from engram_serve.bench.acceptance import target_pass
    from engram_serve.model.dspark import DSparkState
    from engram_serve.runner.sampler import Sampler
    n, d, vocab = len(ids) - 1, lm.drafter, vocab_of(lm)
    feats = target_pass(lm, ids[:-1])[1]
    state = DSparkState(lm.config, 1, n + d.block, max_rows=1)
    pos = torch.arange(n)
    with torch.no_grad():
        d.write_context(state, feats, pos, pos)
        return d.draft(lm.model, state, torch.tensor([ids[-1]]), torch.tensor([n]), torch.zeros(1, 1, dtype=torch.int64),
                       n + d.block, lambda j, z: Sampler().greedy(z[:, :vocab].float()).tokens)


def engine_drafts(lm, prompts, shift=0, engine_cls=LLMEngine, drafter_cls=RecordingDSpark, gen=24, planner=None):
    """A warm request of prompts[0][:48] that ends in its prefill step (whose last chunk, 34 .. 47, completes a
    block that stays cached), then every prompt at once, greedy, two microbatches cut by tokens, prefill chunks of 17: (the drafter, the engine's stats)."""
    cfg = RunnerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=17, block_size=16, num_blocks=64,
                       microbatch=MicrobatchConfig(2, "tokens", 0, 0, when="always"))
    drafter = drafter_cls(lm.drafter, lm.model, cfg.num_blocks, cfg.block_size, cfg.max_num_seqs)
    drafter.shift = shift
    block = lm.config.dspark.dspark_block_size
    engine = engine_cls(lm, cfg, speculative=SpeculativeConfig("dspark", block, when="always", block_size=block),
                        drafter=drafter)
    if planner is not None:
        engine.spec_planner = planner(engine.spec)
    try:
        engine.add_request("warm", prompts[0][:48], SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    return drafter, engine.stats


def mismatches(lm, drafter) -> int:
    bad = 0
    for ids, logits, tokens in drafter.log:
        want = direct_draft(lm, ids)
        bad += not (torch.equal(want.logits[0], logits) and want.tokens[0].tolist() == tokens)
    return bad


@pytest.fixture(scope="module")
def code_prompts(tiny_module):
    from engram_serve.bench.acceptance import heldout_prompts
    prompts = heldout_prompts(tiny_module.tokenizer, count=3, length=56)
    prompts[1] = prompts[0][:50] + prompts[1][:8]  # prefix-cache hits on the warm request's blocks (r0's too)
    return prompts


@pytest.fixture(scope="module")
def tiny_module():
    return load_model()


def test_the_engines_dspark_proposals_are_dspark_draft_on_the_committed_context(tiny_module, code_prompts):
    lm = tiny_module
    drafter, stats = engine_drafts(lm, code_prompts)
    assert len(drafter.log) > 20 and mismatches(lm, drafter) == 0
    vocab = vocab_of(lm)
    random_rate = 1 / vocab  # a uniform draft is the target's token with this probability
    assert stats.spec_accepted_per_position[0] / stats.spec_drafts > 50 * random_rate  # the trained drafter: ~0.5


def test_negative_control_features_of_the_position_before_change_the_drafts(tiny_module, code_prompts):
    drafter, _ = engine_drafts(tiny_module, code_prompts, shift=1, gen=8)
    assert mismatches(tiny_module, drafter) > len(drafter.log) // 2


def test_negative_control_a_request_ended_in_its_step_leaves_its_cached_blocks_without_keys(tiny_module,
                                                                                            code_prompts):
    """The warm request ends in its prefill step: unreported, its prompt's keys are never written, and the request
    that reuses its cached blocks drafts from empty keys."""
    drafter, _ = engine_drafts(tiny_module, code_prompts, engine_cls=LeavesEndedRowsUnreported, gen=8,
                               drafter_cls=ReadsStaleSlots)
    assert mismatches(tiny_module, drafter) > 0


def test_slots_never_written_are_not_read_their_request_drafts_later(tiny_module, code_prompts):
    """The same run with the drafter's own check: the request on the unwritten blocks gets no draft until its
    window leaves them, and every draft made is the one on the committed context."""
    drafter, _ = engine_drafts(tiny_module, code_prompts, engine_cls=LeavesEndedRowsUnreported, gen=8)
    assert drafter.asked > len(drafter.log) > 0 and mismatches(tiny_module, drafter) == 0


@pytest.mark.parametrize("drafter_cls", [RecordingDSpark, ReadsStaleSlots])
def test_context_dropped_while_not_drafting_is_never_read(tiny_module, code_prompts, drafter_cls):
    """Decode steps 2 .. 9 do not draft and drop the drafter's context of their tokens: each request drafts again
    only once its window (64 positions) holds none of them, and every draft is the one on the committed context.
    Negative control: drafting from the window at once (stale keys) gives other drafts. The steps that drop the
    context compute no features."""
    drafter, _ = engine_drafts(tiny_module, code_prompts, gen=100, planner=DropsContext, drafter_cls=drafter_cls)
    assert set(drafter.observed) == {(False, False), (True, True)}
    late = [ids for ids, _, _ in drafter.log if len(ids) > len(code_prompts[0]) + 64]
    if drafter_cls is ReadsStaleSlots:
        assert mismatches(tiny_module, drafter) > 0
    else:
        assert late and drafter.asked > len(drafter.log) and mismatches(tiny_module, drafter) == 0


def test_a_slot_observed_twice_before_a_write_holds_the_later_keys(tiny_module):
    """Positions observed again (a recompute, a freed block reused) before one deferred write: each slot ends with
    the keys of its later observation, as writing at once would leave it."""
    lm = tiny_module
    width = len(lm.config.dspark.dspark_target_layer_ids) * lm.config.hidden_size
    g = torch.Generator().manual_seed(0)
    first, later = torch.randn(6, width, generator=g), torch.randn(4, width, generator=g)
    pos, slots = torch.arange(6), torch.tensor([3, 9, 4, 5, 6, 7])

    def state_after(observations):
        d = DSparkDrafter(lm.drafter, lm.model, 1, 16, 1, graphs=False)
        for p, s, f in observations:
            d.observe(p, s, f)
        d.write()
        return d.state.window

    deferred = state_after([(pos, slots, first), (pos[2:], slots[[0, 1, 4, 5]], later)])
    at_once = state_after([(pos, slots, first)])
    d = DSparkDrafter(lm.drafter, lm.model, 1, 16, 1, graphs=False)
    d.state.window = at_once
    d.observe(pos[2:], slots[[0, 1, 4, 5]], later)
    d.write()
    assert all(torch.equal(a, b) for a, b in zip(deferred, d.state.window))
    assert not all(torch.equal(a, b) for a, b in zip(deferred, state_after([(pos, slots, first)])))


def test_dspark_steps_replay_as_cpu_graphs_with_the_eager_features(tiny_module):
    """One request: its prompt, decodes and verify rows replay (the stream means are graph outputs), and every
    proposal (logits included) equals the one of a run without graphs."""
    logs, replays = [], []
    for graphs in (False, True):
        cfg = RunnerConfig(max_num_seqs=1, max_model_len=128, num_blocks=16, cpu_graphs=graphs)
        drafter = RecordingDSpark(tiny_module.drafter, tiny_module.model, cfg.num_blocks, cfg.block_size, 1)
        engine = LLMEngine(tiny_module, cfg, drafter=drafter,
                           speculative=SpeculativeConfig("dspark", 3, when="always", block_size=5))
        engine.add_request("a", list(range(40, 70)), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        logs.append(drafter.log)
        replays.append(engine.runner.cpu_graphs.replays if graphs else 0)
        engine.close()
    assert replays[1] > len(logs[1]) // 2
    assert len(logs[0]) == len(logs[1]) and all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(*logs))


def test_dspark_is_refused_where_the_checkpoint_has_no_drafter(tmp_path):
    lm = load_model(make_random_checkpoint(tmp_path, seed=1), drafter=False)
    with pytest.raises(ConfigError, match="has no DSpark drafter"):
        LLMEngine(lm, RunnerConfig(max_num_seqs=2, max_model_len=64, num_blocks=16),
                  speculative={"method": "dspark", "num_speculative_tokens": 2})


def test_stop_strings_end_inside_an_accepted_run_where_plain_decoding_ends(loaded):
    """A stop string is found by the detokenizer in the tokens the step emitted: the request ends there, and the
    tokens after it in the same step are never delivered."""
    if loaded.path.name != "tiny":
        pytest.skip("stop strings need the trained model's text")
    prompt = loaded.tokenizer.encode("def fibonacci(n):").ids
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def generate(spec=None, drafter=None, p=params):
        engine = LLMEngine(loaded, RunnerConfig(max_num_seqs=2, max_model_len=128, num_blocks=32), speculative=spec,
                           drafter=drafter)
        driver, text, toks, reason = EngineDriver(engine), "", [], None
        driver.add("a", prompt, p)
        while driver.has_work():
            for d in driver.step():
                text, reason = text + d.text, d.finish_reason or reason
                toks += [] if d.token_id is None else [d.token_id]
        engine.close()
        return text, toks, reason, engine.stats
    plain_text, plain_toks, _, _ = generate()
    stop = plain_text[len(plain_text) // 2:len(plain_text) // 2 + 3]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    want = generate(p=p)
    assert want[2] == "stop" and len(want[1]) < len(plain_toks)
    got = generate(SpeculativeConfig("random", 5, when="always"), OracleDrafter({"a": plain_toks}, vocab_of(loaded)), p)
    assert got[:3] == want[:3] and got[3].spec_accepted_tokens > 0


def test_lone_verify_rows_replay_as_cpu_graphs_with_the_eager_bits(loaded):
    prompts = [list(range(30, 50))]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    eager = plain_and_speculative(loaded, prompts, params, "mixed", 3, 2, cpu_graphs=False)[1]
    graphs_seen = []

    class Counting(ModelRunner):
        def execute(self, batch, bounds=None, record=False, score_rows=None, reads=None):
            out = super().execute(batch, bounds, record, score_rows, reads)
            if reads is not None and self.cpu_graphs is not None:
                graphs_seen.append(self.cpu_graphs.replays)
            return out
    work = Workload(prompts, 14)
    outputs = {"r0": eager.tokens[0]}
    rec = run_case(loaded, work, config(1, 40), params=params, runner_cls=Counting,
                   speculative=SpeculativeConfig("random", 3, when="always"),
                   drafter=drafter_for("mixed", loaded, outputs, 2))
    assert_same(eager, rec, work)
    assert graphs_seen and graphs_seen[-1] > 0  # verify steps of one row replayed


# ---- the bookkeeping of rejected drafts ---------------------------------------------------------------------

def test_drafts_take_lookahead_blocks_and_count_as_computed_only_once_accepted():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=8, block_size=4,
                                      max_model_len=32))
    seq = Sequence("a", list(range(10, 17)))  # 7 tokens
    sched.add(seq)
    sched.update(sched.schedule())
    seq.append_token(99)  # 8 tokens: 7 computed, a decode
    seq.draft_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    (row,) = out.rows
    assert (row.num_computed, row.num_new, row.num_draft, row.sample) == (7, 6, 5, True)
    assert len(seq.block_ids) * 4 >= 7 + 6  # the drafts' slots are held
    sched.update(out)
    assert seq.num_computed_tokens == 8  # the committed token only
    for t in (1, 2, 50):  # drafts 1, 2 accepted, then the token at the first difference
        seq.append_token(t)
    sched.accept(seq, 2)
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11
    bm = sched.block_manager
    hashed = [b for b in seq.block_ids if bm.block_hash[b] is not None]
    assert len(hashed) == 10 // 4  # only blocks below the computed positions hold a hash (a prefix)
    with pytest.raises(ValueError, match="last token is not computed"):
        sched.accept(seq, 1)
    sched.check_invariants()


def test_drafts_never_preempt_and_leave_every_decode_its_token():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=4, num_blocks=6, block_size=4,
                                      max_model_len=16))
    seqs = [Sequence(f"r{i}", [5, 6, 7]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):  # the prompts, in chunks of 4 tokens
        sched.update(sched.schedule())
    for s in seqs:
        s.append_token(1)
        s.draft_ids = [2, 3, 4]
    out = sched.schedule()
    assert [r.num_new - r.num_draft for r in out.rows] == [1, 1, 1] and out.num_tokens == 4 and not out.preempted


def test_speculative_config_is_validated_naming_the_field_and_value(tmp_path):
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    for bad, words in [('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
                       ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens=2.5"),
                       ('{"method": "eagle", "num_speculative_tokens": 2}', "method='eagle'"),
                       ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field(s) ['k']"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}',
                        "prompt_lookup_max=4"),
                       ('{"method": "dspark", "num_speculative_tokens": 2}', "no DSpark drafter"),
                       ('[1]', "expected a JSON object"), ('{', "not valid JSON")]:
        with pytest.raises(ConfigError, match=None) as e:
            SpeculativeConfig.parse(bad)
        assert words in str(e.value), (bad, str(e.value))
    (tmp_path / "config.json").write_text('{"text_config": {"dspark_block_size": 5, "num_nextn_predict_layers": 3}}')
    assert SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 5}, tmp_path).block_size == 5
    with pytest.raises(ConfigError, match=r"num_speculative_tokens=6: must be in \[1, 5\]"):
        SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 6}, tmp_path)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = NgramDrafter(1, 3)
    assert d.lookup(np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]), 3) == [7, 8, 1]  # the 3-gram's latest match
    assert d.lookup(np.array([5, 6, 5]), 2) == [6, 5]  # a 1-gram
    assert d.lookup(np.array([1, 2, 3]), 2) == []


def test_the_planner_stops_drafting_where_it_does_not_pay(loaded):
    prompts = [[40 + i, 41, 42] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    work = Workload(prompts, 12)
    base = run_case(loaded, work, config(4, 20), params=params)
    outputs = {f"r{i}": t for i, t in enumerate(base.tokens)}
    wrong = OracleDrafter(outputs, vocab_of(loaded), wrong=True)
    big = run_case(loaded, work, config(4, 20), params=params, drafter=wrong,
                   speculative=SpeculativeConfig("random", 3, when="always", disable_by_batch_size=3))
    assert big.spec["drafts"] == 0 and big.tokens == base.tokens  # 4 decodes > 3: no step drafts
    always = run_case(loaded, work, config(4, 20), params=params, drafter=wrong,
                      speculative=SpeculativeConfig("random", 3, when="always"))
    low = run_case(loaded, work, config(4, 20), params=params, drafter=wrong,
                   speculative=SpeculativeConfig("random", 3, when="always", min_acceptance=0.5))
    assert 0 < low.spec["drafts"] < always.spec["drafts"] and low.tokens == always.tokens == base.tokens


# ---- negative controls: a rejected token's trace left readable ----------------------------------------------

class PenaltiesSeeEveryDraft(LLMEngine):
    penalties_see_earlier_drafts_only = False  # every position of a verify row counts all of the row's drafts


class KeepsDraftsInTheHistory(TokenStore):
    """The Engram history read from the first token ever written at each position: a rejected draft stays
    there after the emitted token replaced it as the input (what a history buffer updated with every
    verified token, and never rolled back, would hold)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.first = self.ids.clone()
        self.written = torch.zeros_like(self.dead)

    def add(self, prompt, dead=None):
        slot = super().add(prompt, dead)
        n = int(self.lengths[slot])
        self.written[slot] = False
        self.written[slot, :n] = True
        self.first[slot, :n] = self.ids[slot, :n]
        return slot

    def _keep(self, slots, positions):
        s, p = torch.as_tensor(slots).long(), torch.as_tensor(positions).long()
        new = ~self.written[s, p]
        self.first[s[new], p[new]] = self.ids[s[new], p[new]]
        self.written[s, p] = True

    def write(self, slots, positions, tokens):
        super().write(slots, positions, tokens)
        self._keep(slots, positions)

    def append(self, slots, tokens):
        pos = self.lengths[torch.as_tensor(np.asarray(slots)).long()].clone()
        super().append(slots, tokens)
        self._keep(np.asarray(slots), pos)

    def history_host(self, slots, first_pos, d):
        host = self._host
        self._host = (self.first.numpy(), *host[1:])
        try:
            return super().history_host(slots, first_pos, d)
        finally:
            self._host = host


class DraftHistoryRunner(ModelRunner):
    def __init__(self, loaded, cfg):
        super().__init__(loaded, cfg)
        self.store = KeepsDraftsInTheHistory(cfg.max_num_seqs, cfg.max_model_len, self.device)


@pytest.fixture
def tiny():
    return load_model()


def control_case(lm, params, engine_cls=LLMEngine, runner_cls=ModelRunner, kind="wrong", k=3):
    prompts = [list(range(30, 47)), list(range(60, 69))]
    work = Workload(prompts, params.max_tokens)
    cfg = config(2, 60, cpu_graphs=False)
    base = run_case(lm, work, cfg, params=params)
    outputs = {f"r{i}": t for i, t in enumerate(base.tokens)}
    rec = run_case(lm, work, cfg, params=params, speculative=SpeculativeConfig("random", k, when="always"),
                   drafter=drafter_for(kind, lm, outputs, 0), engine_cls=engine_cls, runner_cls=runner_cls)
    return base, rec, work


def differs(base, rec, work) -> bool:
    res = compare(base, rec, work)
    return bool(res["logit_mismatches"] or res["greedy_mismatches"] or res["hash_mismatches"])


def test_negative_control_a_rejected_draft_counted_in_the_penalties_changes_the_tokens(tiny):
    """Every position of a verify row counts all of the row's drafts: the draft that position is about to
    accept, and the rejected ones after it, lower their own logits. (A drafter whose drafts are always wrong
    would only lower tokens the target does not choose: the drafts here are the plain run's with errors.)"""
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                            repetition_penalty=2.0)
    assert_same(*control_case(tiny, params, kind="mixed"))  # the protection on: the same tokens
    base, rec, work = control_case(tiny, params, engine_cls=PenaltiesSeeEveryDraft, kind="mixed")
    assert rec.tokens != base.tokens


def test_negative_control_a_rejected_draft_kept_in_the_engram_history_changes_the_hash_and_logits(tiny):
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    assert_same(*control_case(tiny, params, runner_cls=DraftHistoryRunner, kind="right"))  # nothing rejected
    base, rec, work = control_case(tiny, params, runner_cls=DraftHistoryRunner)
    res = compare(base, rec, work)
    assert res["hash_mismatches"] > 0 and res["logit_mismatches"] > 0


def test_negative_control_a_rejected_draft_kept_in_the_open_ratio2_pair_changes_the_logits(tiny, monkeypatch):
    """The partner rows of the positions where a draft was rejected are not rewritten when the emitted token
    is computed there: the next position pools with the rejected token's [kv, gate] row."""
    assert 2 in tiny.config.ratios
    sticky: set[int] = set()
    partner = v41.Compressor.partner

    def keep_rejected(row, step, layer):
        slots = step.plan.slots
        keep = torch.tensor(sorted(sticky), dtype=slots.dtype)
        at = torch.isin(slots, keep)
        if at.any():  # those tokens write to the trash slot: the rejected row stays
            step.plan.slots = torch.where(at, -1, slots)
            try:
                return partner(row, step, layer)
            finally:
                step.plan.slots = slots
        return partner(row, step, layer)

    class Sticky(LLMEngine):
        def step(self, *a, **kw):
            res = super().step(*a, **kw)
            sticky.clear()
            for r, n in zip(res.scheduled.rows, res.standing or []):
                if r.num_draft and n < r.num_new and r.seq.block_ids:  # the first rejected position's slot
                    p = r.num_computed + n
                    sticky.add(r.seq.block_ids[p // self.cfg.block_size] * self.cfg.block_size
                               + p % self.cfg.block_size)
            return res

    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    assert_same(*control_case(tiny, params, engine_cls=Sticky))  # recorded, not yet kept: the same bits
    monkeypatch.setattr(v41.Compressor, "partner", staticmethod(keep_rejected))
    base, rec, work = control_case(tiny, params, engine_cls=Sticky)
    assert differs(base, rec, work)


def test_the_server_serves_speculatively_with_vllms_counters(tiny):
    """`speculative_config` through build_engine (prompt lookup on the built-in model): the same completion as
    without it, and /metrics exports vLLM's spec_decode counters, accepted tokens by draft position too."""
    import httpx

    from engram_serve.engine.async_engine import AsyncLLMEngine
    from engram_serve.llm import build_engine
    from engram_serve.server.api import build_app
    from engram_serve.server.run import BackgroundServer
    body = {"model": "m", "prompt": "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\n", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    texts, metrics = [], None
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        engine = AsyncLLMEngine(build_engine(tiny, max_model_len=128, num_blocks=32, max_num_seqs=4,
                                             speculative_config=spec))
        server = BackgroundServer(build_app(engine, "m")).start()
        try:
            texts.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json())
            metrics = httpx.get(server.base_url + "/metrics").text
        finally:
            server.stop()
            engine.shutdown()
    assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("engram_spec_decode")}
    assert values["engram_spec_decode_num_drafts_total"] > 0
    assert 0 < values["engram_spec_decode_num_accepted_tokens_total"] <= values[
        "engram_spec_decode_num_draft_tokens_total"]
    assert values['engram_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0


def test_the_planner_drafts_at_a_batch_size_only_where_it_measured_less_time_per_token():
    first, steps = SpecPlanner.FIRST_TRIAL, SpecPlanner.TRIAL_STEPS
    for drafted_ms, want in ((2.0, True), (9.0, False)):  # ms per token with drafts; plain steps: 5
        p = SpecPlanner(SpeculativeConfig("ngram", 3))
        choices = []
        for _ in range(64):
            on = p.speculate(8)
            choices.append(on)
            p.record_step(8, on, drafted_ms * 3 if on else 5.0, 3 if on else 1)
        assert not any(choices[:first - 1]) and choices[first - 1]  # plain, until a trial drafts
        late = choices[first - 1 + steps:]
        assert late.count(want) > 0.9 * len(late)  # then the faster form
        assert p.speculate(1) in (True, False) and p.size(3) == p.size(4) != p.size(5)  # sizes bucketed
    for drafted_ms, most in ((30.0, 2 * steps), (6.0, 6 * steps)):  # a drafted step costs 6x (1.2x) a plain one
        p = SpecPlanner(SpeculativeConfig("ngram", 3))
        trials = 0
        for i in range(4096):
            on = p.speculate(32)
            trials += on
            p.record_step(32, on, drafted_ms if on else 5.0, 1)
        assert steps <= trials <= most  # tried ever more rarely, the dearer the more so


def test_the_planner_lets_the_drafter_drop_its_context_only_far_from_a_drafting_step():
    lead, p, keep, drafted = 64, SpecPlanner(SpeculativeConfig("ngram", 3)), [], []
    for _ in range(4096):
        drafted.append(p.speculate(32))
        keep.append(p.needs_context(32, lead))
        p.record_step(32, drafted[-1], 30.0 if drafted[-1] else 5.0, 1)  # a drafted step costs 6 plain ones
    assert all(all(keep[max(i - lead, 0):i + 1]) for i, on in enumerate(drafted) if on)
    assert keep.count(False) > 0.8 * len(keep) and p.needs_context(0, lead)  # (a step of prompts keeps it)
    assert SpecPlanner(SpeculativeConfig("ngram", 3, when="always")).needs_context(32, lead)


def test_one_slow_step_does_not_turn_the_planner_to_the_slower_form():
    """A form's cost is its cheapest recent step per token: one stall (a capture, a collection) in a plain step
    right after a trial does not make drafting, three times dearer per token, look cheaper."""
    p = SpecPlanner(SpeculativeConfig("ngram", 3))
    choices = []
    for i in range(400):
        on = p.speculate(32)
        choices.append(on)
        stall = i == SpecPlanner.FIRST_TRIAL + SpecPlanner.TRIAL_STEPS + 1
        p.record_step(32, on, 45.0 if on else 500.0 if stall else 5.0, 3 if on else 1)
    assert sum(choices) == SpecPlanner.TRIAL_STEPS
