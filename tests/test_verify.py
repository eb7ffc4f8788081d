"""`verify` on a small DeepSeek-V4.1 checkpoint (the built-in model's shape: window 64, index_topk 16, ratio-2
and ratio-1 layers, candidate source 4, Engram, mHC): it passes, its workload really meets V4.1's hard
places (cuts and chunks inside ratio-2 pairs, a prompt past the window and past index_topk entries of every
ratio, candidate blocks that restrict, preemption, prefix hits inside a pair), and each negative control (a
protection switched off) makes it fail."""
import pytest

from engram_serve.errors import OwnershipError
from engram_serve.model.loader import load_model
from engram_serve.model.writer import SMALL_TEXT_CONFIG, make_random_checkpoint, random_v41_checkpoint
from engram_serve.verify import PAIR_BLOCK, verify

from runner_controls import NoHistoryRebuild, SharedStaging, SharedTopk, StalePadding

PREFIX_IN_PAIR = f"reused prefix, block size {PAIR_BLOCK} (hits inside a ratio-2 pair), 2 microbatches"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_random_checkpoint(path, seed=1)
    lm = load_model(path)
    cfg = lm.config
    assert cfg.engram.engram_layer_ids and cfg.hc_mult > 1 and {1, 2} <= set(cfg.ratios)
    assert cfg.candidate_source_layer_id >= 0 and any(i > cfg.candidate_source_layer_id
                                                      for i in cfg.index_source_layer_ids)
    return lm


def test_verify_passes_on_every_case_and_meets_every_hard_place(loaded):
    res = verify(loaded, seed=3, num_requests=4, gen_tokens=16)
    assert res["passed"], res
    assert res["max_abs_logit_diff"] == 0.0 and res["logit_mismatches"] == 0
    assert res["straddling_rows"] > 0
    by_name = {c["case"]: c for c in res["cases"]}
    assert by_name["preemption and recompute (small KV pool), 2 microbatches"]["preemptions"] > 0
    assert 0 < by_name["reused prefix (prefix cache), 2 microbatches"]["compared_tokens"] < \
        by_name["2 microbatches, tokens policy"]["compared_tokens"]  # the cached prefix was not recomputed
    names = " | ".join(c["case"] for c in res["cases"])
    for needed in ("2 microbatches, tokens", "2 microbatches, requests", "3 microbatches, tokens", "3 microbatches, requests",
                   "prefill chunk 1,", "prefill chunk 3,", "prefill chunk 17,", "unlimited", "graph mode",
                   "first step cut at token 1", "reused prefix", PREFIX_IN_PAIR, "preemption and recompute"):
        assert needed in names
    # the workload meets every hard place of the V4.1 state (verify's own counts of what the cases computed)
    cfg = loaded.config
    assert res["longest_prompt"] > max(cfg.sliding_window, cfg.index_topk * 2,
                                       cfg.candidate_topk_blocks * cfg.candidate_block_size)
    assert by_name["first step cut at token 7"]["pair_bounds"] == 1  # position 7 closes the pair {6, 7}
    assert by_name["first step cut at token 8"]["pair_bounds"] == 0
    assert by_name["prefill chunk 3, 2 microbatches"]["pair_chunks"] > 0
    assert by_name[PREFIX_IN_PAIR]["pair_prefix_hits"] > 0
    assert by_name["reused prefix (prefix cache), 2 microbatches"]["pair_prefix_hits"] == 0  # even blocks
    for c in res["cases"]:
        assert c["past_window"] > 0 and c["selecting"] > 0 and c["restricted"] > 0, c


def test_negative_control_history_rebuild_off(loaded):
    res = verify(loaded, seed=3, num_requests=4, only="first step cut", runner_cls=NoHistoryRebuild)
    assert not res["passed"] and res["hash_mismatches"] > 0 and res["logit_mismatches"] > 0


def test_negative_control_shared_staging_buffer_gives_wrong_logits(loaded):
    res = verify(loaded, seed=3, num_requests=4, only="2 microbatches, tokens", runner_cls=SharedStaging)
    assert not res["passed"] and res["logit_mismatches"] > 0 and res["max_abs_logit_diff"] > 1e-3


def test_negative_control_shared_topk_buffer_gives_wrong_logits_and_is_named(loaded):
    """One top-k buffer for every microbatch: a later microbatch's index source overwrites it before the
    earlier microbatch's consumer layers read it. (Where the later microbatch's entry ids lie past the
    earlier one's entries, the forward raises instead; these cuts keep them inside: wrong logits.)"""
    res = verify(loaded, seed=3, num_requests=4, only="3 microbatches, tokens", runner_cls=SharedTopk)
    assert not res["passed"] and res["logit_mismatches"] > 0
    with pytest.raises(OwnershipError, match="'topk' is owned by microbatch 0.*touched by microbatch 1"):
        verify(loaded, seed=3, num_requests=4, overrides={"debug_ownership": True}, only="2 microbatches, tokens",
               runner_cls=SharedTopk)


def test_negative_control_stale_padding(loaded):
    """Stale padding either corrupts results (caught by the comparison) or is refused outright (the C
    hash kernel rejects a stale, non-monotonic qsl); it never passes."""
    try:
        res = verify(loaded, seed=3, num_requests=4, only="graph mode", runner_cls=StalePadding)
    except ValueError as e:
        assert "qsl" in str(e)
    else:
        assert not res["passed"]


def test_verify_passes_on_the_shipped_trained_model():
    res = verify(load_model(), seed=0, num_requests=4, gen_tokens=8)
    assert res["passed"], {k: v for k, v in res.items() if k != "cases"}
    assert res["straddling_rows"] > 0 and res["max_abs_logit_diff"] == 0.0
    c = res["coverage"]
    assert min(c["pair_bounds"], c["pair_prefix_hits"], c["past_window"], c["selecting"], c["restricted"],
               c["preemptions"]) > 0, c


def test_verify_sizes_its_workload_from_the_models_config(tmp_path):
    """verify on a checkpoint directory of another shape (window 8, index_topk 4, ratio-2 and ratio-1 layers, a
    candidate source): the long prompt is sized from that config, and every hard place is met."""
    loaded = load_model(random_v41_checkpoint(tmp_path / "small", SMALL_TEXT_CONFIG, seed=2))
    res = verify(loaded, seed=0, num_requests=3, gen_tokens=8,
                 only=("2 microbatches, tokens", "prefill chunk 3,", PREFIX_IN_PAIR, "preemption", "at token 7"))
    assert res["passed"] and res["max_abs_logit_diff"] == 0.0
    assert res["longest_prompt"] > max(SMALL_TEXT_CONFIG["sliding_window"], 2 * SMALL_TEXT_CONFIG["index_topk"])
    c = res["coverage"]
    assert min(c["pair_bounds"], c["pair_chunks"], c["pair_prefix_hits"], c["past_window"], c["selecting"],
               c["restricted"], c["preemptions"]) > 0, c
