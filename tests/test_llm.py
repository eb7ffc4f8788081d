"""LLM.generate end to end: greedy and seeded sampling, stop strings, incremental detokenization,
microbatching on/off, one request's non-finite logits, bad input, the `generate` CLI hook.

Runs on the built-in tiny model when its trained weights exist, else on a random checkpoint; every
expectation is derived from the model's own output, so it holds for either."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from engram_serve.engine.detokenizer import IncrementalDetokenizer
from engram_serve.engine.llm_engine import LLMEngine
from engram_serve.errors import InvalidRequest, QueueFull
from engram_serve.llm import LLM
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.sampling_params import SamplingParams

OPTS = dict(max_model_len=128, num_blocks=64, max_num_seqs=8)
FORCE_MICROBATCHES = MicrobatchConfig(num_microbatches=2, decode_threshold=2, prefill_threshold=2,
                                      when="always")  # cut every step it can
PROMPTS = ["Hello world", "The quick brown fox jumps", "Once upon a time there was", "1 2 3 4 5 6 7"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (TINY_DIR / "model.safetensors").is_file():
        return None  # the trained built-in model
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def assert_clean(llm: LLM) -> None:
    """Nothing left behind: no KV blocks held, every token-store slot free, no request tracked."""
    e = llm.engine
    assert e.scheduler.block_manager.num_used == 0
    assert e.runner.store.num_free == e.cfg.max_num_seqs
    assert not e.seqs and not e.has_unfinished() and not llm.driver.has_work() and len(llm.driver.outputs) == 0


def poison(monkeypatch, engine: LLMEngine, hit) -> None:
    """Make the runner return NaN logits for the rows of requests where hit(seq) is true."""
    runner, original = engine.runner, engine.runner.execute

    def execute(batch, bounds=None, record=False, score_rows=None):
        out = original(batch, bounds, record, score_rows)
        by_slot = {s.slot: s for s in engine.seqs.values()}
        for i, slot in enumerate(batch.req_slots[batch.sample].tolist()):  # rows of out.logits, in order
            if hit(by_slot[slot]):
                out.logits[i] = float("nan")
        return out

    monkeypatch.setattr(runner, "execute", execute)


def engine_alone(loaded, prompt_ids, params) -> list[int]:
    """The request's tokens from a bare LLMEngine loop (no LLM driver, no detokenizer)."""
    e = LLMEngine(loaded, RunnerConfig(**OPTS))
    e.add_request("r", prompt_ids, params)
    tokens = []
    while e.has_unfinished():
        tokens += [ev.token for ev in e.step().events if ev.token is not None]
    e.close()
    return tokens


def test_greedy_matches_the_bare_engine_alone_and_in_a_batch(loaded):
    llm = LLM(loaded, **OPTS)
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # in prompt order
    for prompt, o in zip(PROMPTS, outs):
        ids = loaded.tokenizer.encode(prompt).ids
        assert o.prompt == prompt and o.prompt_token_ids == ids
        assert o.finish_reason == "length" and o.error is None and len(o.token_ids) == 10
        assert o.token_ids == engine_alone(loaded, ids, p)  # batching changes nothing, the driver drops nothing
        assert o.text == loaded.tokenizer.decode(o.token_ids)
    assert llm.generate([PROMPTS[1]], p)[0].token_ids == outs[1].token_ids  # token-id prompts too:
    assert llm.generate([outs[1].prompt_token_ids], p)[0].token_ids == outs[1].token_ids
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(loaded):
    llm = LLM(loaded, **OPTS)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    other = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=1.0, seed=200 + i, ignore_eos=True)
                                   for i in range(4)])
    assert [o.token_ids for o in other] != [o.token_ids for o in batched]  # the seed matters
    assert_clean(llm)


def test_more_prompts_than_engine_slots_queue_and_all_finish(loaded):
    llm = LLM(loaded, **{**OPTS, "max_num_seqs": 3})
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [f"item number {i}" for i in range(10)]
    outs = llm.generate(prompts, p)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outs)
    assert [o.token_ids for o in outs] == [llm.generate(q, p)[0].token_ids for q in prompts]
    assert_clean(llm)


def test_a_long_queue_under_preemption_keeps_every_request_in_one_queue(loaded):
    """Few KV blocks: running requests preempt each other while the rest wait in the scheduler's
    queue; every one still finishes with the tokens it gets in a roomy engine."""
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [f"item number {i}" for i in range(6)]
    tight = LLM(loaded, **{**OPTS, "max_num_seqs": 3, "num_blocks": 8})  # 8 blocks of 16: < 3 requests of 45
    outs = tight.generate(prompts, p)
    assert tight.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(loaded, **OPTS).generate(prompts, p)]
    assert_clean(tight)


def test_max_waiting_refuses_what_the_queue_cannot_hold(loaded):
    assert LLM(loaded, **OPTS).engine.scheduler.config.max_waiting is None  # offline: every prompt queues
    llm = LLM(loaded, **OPTS, max_waiting=2)
    with pytest.raises(QueueFull, match="prompts\\[2\\]: .*max_waiting=2"):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2))
    assert_clean(llm)
    engine = LLMEngine(loaded, RunnerConfig(**OPTS), seed=11, max_waiting=1)
    engine.add_request("a", [5, 6])
    with pytest.raises(QueueFull) as e:
        engine.add_request("b", [5, 6])
    assert e.value.param is None and list(engine.seqs) == ["a"] and engine.scheduler.num_waiting == 1
    engine.abort("a")
    engine.add_request("c", [5, 6])
    draws = np.random.default_rng(11)
    draws.integers(0, 2**62)  # a's seed
    assert engine.seqs["c"].params.seed == int(draws.integers(0, 2**62))  # the refused request drew none
    engine.close()


def test_stop_string_truncates_text_and_frees_the_request(loaded):
    llm = LLM(loaded, **OPTS)
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(PROMPTS[0], base)[0]
    assert len(full.text) >= 6, full.text
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                  stop=[stop, "\x00never\x00"]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert loaded.tokenizer.decode(out.token_ids).startswith(out.text + stop)  # the stop's tokens were sampled
    assert_clean(llm)  # aborted in the engine: blocks and slot freed at once


def test_stop_token_ids_and_eos(loaded):
    llm = LLM(loaded, **OPTS)
    full = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_tok = full.token_ids[5]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))[0]
    k = full.token_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:k + 1]
    assert_clean(llm)


def test_detokenizer_never_emits_a_partial_character_and_holds_back_stop_prefixes(loaded):
    tok = loaded.tokenizer
    text = "Hi héllo 日本語 😀 done. Stop here; never this."
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # multibyte characters span several tokens
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(deltas) == text and not any(x.endswith("\ufffd") for x in deltas)
    assert any(x == "" for x in deltas[:-1])  # some tokens held a partial character back
    d = IncrementalDetokenizer(tok, stop=["Stop here"])
    deltas, seen = [], ""
    for t in ids:
        deltas.append(d.add(t))
        seen += deltas[-1]
        assert not any(seen.endswith("Stop here"[:n]) for n in range(1, 10))  # no part of the stop string
        if d.stopped:
            break
    assert d.stopped and seen + d.flush() == text[:text.index("Stop here")]


def test_microbatching_on_and_off_give_the_same_text(loaded):
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    whole = LLM(loaded, **OPTS, microbatch=MicrobatchConfig(num_microbatches=1))
    micro = LLM(loaded, **OPTS, microbatch=FORCE_MICROBATCHES)
    a, b = whole.generate(PROMPTS, params), micro.generate(PROMPTS, params)
    assert whole.stats.microbatched_steps == 0
    assert micro.stats.microbatched_steps == micro.stats.steps > 0 and micro.stats.straddling_rows > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]


def test_nan_logits_end_only_that_request(loaded, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    clean = LLM(loaded, **OPTS).generate(PROMPTS, params)
    llm = LLM(loaded, **OPTS, microbatch=FORCE_MICROBATCHES)
    bad_prompt = loaded.tokenizer.encode(PROMPTS[1]).ids
    poison(monkeypatch, llm.engine, lambda s: s.token_ids[:len(bad_prompt)] == bad_prompt and s.num_output_tokens >= 3)
    outs = llm.generate(PROMPTS, params)
    bad = outs[1]
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert bad.token_ids == clean[1].token_ids[:3] and bad.text == loaded.tokenizer.decode(bad.token_ids)
    for i in (0, 2, 3):
        assert outs[i].finish_reason == "length" and outs[i].error is None
        assert outs[i].token_ids == clean[i].token_ids
    assert llm.engine.stats.errors == 1
    assert_clean(llm)


@pytest.mark.parametrize("prompt, kwargs, field", [
    ([5, 4096], {}, "prompt"),  # outside the vocabulary
    ([-1, 5], {}, "prompt"),
    ([], {}, "prompt"),
    (list(range(10, 130)), {"max_tokens": 16}, "max_tokens"),  # 120 + 16 > max_model_len=128: the prompt fits
])
def test_bad_request_raises_before_anything_runs(loaded, prompt, kwargs, field):
    llm = LLM(loaded, **OPTS)
    with pytest.raises(InvalidRequest, match=field) as e:
        llm.generate([[7, 8, 9], prompt], SamplingParams(**kwargs))  # the good one must not run either
    assert e.value.param == field and str(e.value).startswith("prompts[1]: ")
    assert_clean(llm)
    assert llm.stats.steps == 0
    assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")


def test_bad_sampling_params_name_the_field():
    for kwargs, field in (({"max_tokens": -1}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                          ({"stop": ["ok", ""]}, "stop"), ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {5: 101}}, "logit_bias")):
        with pytest.raises(InvalidRequest, match=field) as e:
            SamplingParams(**kwargs)
        assert e.value.param == field, (kwargs, e.value)
        again = pickle.loads(pickle.dumps(e.value))  # `param` survives a trip between processes
        assert (type(again), str(again), again.param) == (InvalidRequest, str(e.value), field)


def test_generate_cli_reports_microbatching_on_stderr_and_no_check_skips_it(model_dir, capsys):
    from engram_serve.cli import main
    argv = ["generate", "Hello world", "--max-tokens", "6", "--temperature", "0.8", "--seed", "3"]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason", "microbatch"}
    m = out["microbatch"]
    assert m["identical_to_whole"] is True and m["microbatched_steps"] >= 1 and m["straddling_rows"] >= 1
    assert m["num_microbatches"] == 2 and m["seed"] == 3
    assert 1 <= len(out["token_ids"]) <= 6
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == out["text"]  # stdout holds the completion only
    assert captured.err.rstrip("\n").split("\n")[-1].split("\r")[-1] == (
        f"microbatching: {m['microbatched_steps']}/{m['steps']} steps split, {m['straddling_rows']} rows "
        f"straddled a cut, tokens identical to the unsplit run: yes")
    assert main(argv + ["--no-check", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["token_ids"] == out["token_ids"] and again["microbatch"]["identical_to_whole"] is None


def test_generate_with_nonfinite_model_output_has_no_nan_in_text(loaded, monkeypatch):
    llm = LLM(loaded, **OPTS)
    poison(monkeypatch, llm.engine, lambda s: True)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error" and out.token_ids == [] and out.text == ""
    assert_clean(llm)
