"""The paged serving path of DeepSeek-V4.1 against its dense path (`forward_dense`, the same code over a
fresh cache, which tests/reference/test_model_vs_reference.py holds against the float64 reference), bit for bit: prefill
chunks, decode, padding tokens and rows, interleaved microbatches with straddling requests. Engram gating,
the stages every layer yields, buffer ownership (the debug check names the shared buffer), the paged
state's trash and zero slots, the attention with a sink, causality and gradients of the dense path."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engram_serve.config import ModelConfig, read_json
from engram_serve.engram.hashing import hash_step
from engram_serve.engram.layer import EngramGate
from engram_serve.model import ops, ops_torch
from engram_serve.engram.layout import build_layout
from engram_serve.engram.tables import EngramTables
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.errors import OwnershipError, StaticBufferError
from engram_serve.inputs.batch import StepBatch
from engram_serve.inputs.token_store import TokenStore
from engram_serve.microbatch.buffers import MicrobatchBuffers
from engram_serve.model import deepseek_v41 as v41
from engram_serve.model.context import ForwardContext
from engram_serve.model.deepseek_v41 import DeepseekV41, run_stages
from engram_serve.model.loader import TINY_DIR, model_state_from_official
from engram_serve.model.paged_state import PagedState
from engram_serve.runner.ownership import OwnershipTracker
from v41_fixtures import random_v41_weights, with_engram_rows

BLOCK = 4
TOL = 1e-5  # only for "visibly different" (negative controls): every comparison with the dense path is exact

TINY_TEXT = read_json(TINY_DIR / "config.json")["text_config"]
CONFIGS = {
    # the built-in model's layer roles (ratio-2 and ratio-1 kv sources, a candidate source, Engram on two
    # layers, hc_mult 4) with a window of 8 and index_topk 6, so that both bite on these short sequences
    "tiny": dict(sliding_window=8, index_topk=6, candidate_topk_blocks=2),
    # windows only: no compressed layer, one stream (the eighth ratio: the drafter's layer)
    "windows": dict(hc_mult=1, compress_ratios=[0] * 8, kv_source_layer_ids=[], index_source_layer_ids=[],
                    candidate_source_layer_id=-1),
}


def text_config(**over) -> dict:
    return with_engram_rows({**TINY_TEXT, **CONFIGS["tiny"], **over})


class World:
    """A model with random weights (tests/support/v41_fixtures.py, under the official names), its Engram tables and
    the hashing inputs, plus a hand-built step batch factory."""

    def __init__(self, text: dict, seed: int = 0):
        self.cfg = ModelConfig.from_dict(text)
        weights = random_v41_weights(text, seed)
        self.model = DeepseekV41(self.cfg)
        self.model.load_state_dict(model_state_from_official(self.model, weights))
        self.model.requires_grad_(False).eval()
        e = self.cfg.engram
        self.tables = EngramTables(e.engram_layer_ids, [weights[f"layers.{lid}.engram.embed.weight"]
                                                        for lid in e.engram_layer_ids], pin=False)
        self.layout = build_layout(e)
        self.token_map = TOKEN_MAP
        self.pad_id = int(self.token_map[e.engram_pad_token_id])

    def hash(self, ids, qsl, history, dead):
        return hash_step(ids, qsl, history, self.layout, self.token_map, self.pad_id, dead)

    def dense_logits(self, tokens: list[int], dead: list[bool], ablate: bool = False) -> torch.Tensor:
        """[S, V] logits of one whole sequence through forward_dense."""
        ids, dd = torch.tensor(tokens), torch.tensor(dead)
        s = len(tokens)
        hid = self.hash(ids, torch.tensor([0, s]), torch.full((1, self.cfg.engram.history_len), -1), dd)
        rows = torch.zeros(self.cfg.engram.num_layers, s, self.cfg.engram.num_columns, self.cfg.engram.engram_head_dim)
        self.tables.gather(hid, rows)
        with torch.no_grad():
            return self.model.forward_dense(ids[None], None if ablate else [r[None] for r in rows], dd[None])[0]


_tok = load_tokenizer(TINY_DIR / "tokenizer.json")
TOKEN_MAP = build_token_map(_tok)


def forward(model: DeepseekV41, ctx: ForwardContext) -> torch.Tensor:
    with torch.no_grad():
        return run_stages(model.stages(ctx))


class Requests:
    """Requests with fixed token sequences, their blocks (shuffled pool) and a token store."""

    def __init__(self, world: World, lengths: list[int], dead_at: dict[int, list[int]] | None = None, seed: int = 0):
        rng = random.Random(seed)
        self.world = world
        self.tokens = [[rng.randrange(6, world.cfg.vocab_size) for _ in range(n)] for n in lengths]
        self.dead = [[False] * n for n in lengths]
        for r, ps in (dead_at or {}).items():
            for p in ps:
                self.dead[r][p] = True
        self.max_blocks = -(-max(lengths) // BLOCK)
        pool = list(range(len(lengths) * self.max_blocks + 4))
        rng.shuffle(pool)
        self.blocks = [pool[i * self.max_blocks:(i + 1) * self.max_blocks] for i in range(len(lengths))]
        self.store = TokenStore(len(lengths), max(lengths))
        self.slots = [self.store.add(t, d) for t, d in zip(self.tokens, self.dead)]
        self.done = [0] * len(lengths)  # tokens computed so far
        self.kv = PagedState(world.cfg, num_blocks=len(pool), block_size=BLOCK)
    def batch(self, chunks: list[tuple[int, int]], pad_tokens: int = 0, pad_rows: int = 0, advance=True) -> StepBatch:
        """One step (or microbatch) with `n` tokens of request `r` for each (r, n); then padding."""
        ids, pos, dead, rows = [], [], [], []
        for r, n in chunks:
            c = self.done[r]
            ids += self.tokens[r][c:c + n]
            dead += self.dead[r][c:c + n]
            pos += list(range(c, c + n))
            rows.append((r, c, n))
            if advance:
                self.done[r] += n
        real = len(ids)
        ids += [0] * pad_tokens
        pos += [0] * pad_tokens
        dead += [True] * pad_tokens
        t_ids, t_pos = torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)
        counts = [n for _, _, n in rows]
        qsl = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(rows))] + [real] * pad_rows, dtype=torch.int64)
        bt = torch.full((len(rows) + pad_rows, self.max_blocks), -1, dtype=torch.int64)
        for i, (r, _, _) in enumerate(rows):
            bt[i] = torch.tensor(self.blocks[r])
        row_of = torch.tensor([i for i, (_, _, n) in enumerate(rows) for _ in range(n)], dtype=torch.int64)
        slot = bt[row_of, t_pos[:real] // BLOCK] * BLOCK + t_pos[:real] % BLOCK
        slot = torch.cat([slot, torch.full((pad_tokens,), -1, dtype=torch.int64)])
        num_computed = torch.tensor([c for _, c, _ in rows] + [0] * pad_rows)
        seq_lens = torch.tensor([c + n for _, c, n in rows] + [0] * pad_rows)
        d = self.world.cfg.engram.history_len
        req_slots = torch.tensor([self.slots[r] for r, _, _ in rows], dtype=torch.int64)
        history = torch.cat([self.store.history(req_slots, num_computed[:len(rows)], d),
                             torch.full((pad_rows, d), -1, dtype=torch.int64)])
        t_dead = torch.tensor(dead, dtype=torch.bool)
        fields = dict(input_ids=t_ids, positions=t_pos, dead=t_dead, slot_mapping=slot,
                      req_slots=torch.cat([req_slots, torch.full((pad_rows,), -1, dtype=torch.int64)]),
                      num_computed=num_computed, seq_lens=seq_lens, block_tables=bt,
                      sample=torch.ones(len(rows) + pad_rows, dtype=torch.bool), qsl=qsl, history=history,
                      qsl_host=qsl.numpy().copy(), block_size=BLOCK,
                      hash_ids=self.world.hash(t_ids, qsl, history, t_dead))
        names = {f.name for f in dataclasses.fields(StepBatch)}
        batch = StepBatch(**{k: v for k, v in fields.items() if k in names})
        batch.rows = rows  # test bookkeeping: (request, first position, tokens)
        return batch

    def context(self, batch: StepBatch, bufs: MicrobatchBuffers, tracker=None) -> ForwardContext:
        t = batch.num_tokens
        self.world.tables.gather(batch.hash_ids, bufs.staging[:, :t])
        return ForwardContext(batch, self.kv, bufs, lambda i: bufs.staging[i, :t], tracker)

    def collect(self, batch: StepBatch, hidden: torch.Tensor, out: dict) -> None:
        logits = self.world.model.compute_logits(hidden)
        t = 0
        for r, c, n in batch.rows:
            for j in range(n):
                out[(r, c + j)] = logits[t + j]
            t += n

    def run(self, chunks, out: dict, bufs: MicrobatchBuffers, **pad) -> None:
        batch = self.batch(chunks, **pad)
        with torch.no_grad():
            hidden = run_stages(self.world.model.stages(self.context(batch, bufs)))
        assert hidden.shape == (batch.num_tokens, self.world.cfg.hidden_size)
        self.collect(batch, hidden, out)


def check_against_dense(reqs: Requests, out: dict) -> list[tuple[int, int]]:
    """The (request, position) whose serving logits are not bit-identical to the dense path's."""
    bad = []
    for r, toks in enumerate(reqs.tokens):
        ref = reqs.world.dense_logits(toks, reqs.dead[r])
        bad += [(r, p) for p in range(len(toks)) if not torch.equal(out[(r, p)], ref[p])]
    return bad


def max_dense_diff(reqs: Requests, out: dict) -> float:
    return max(float((torch.stack([out[(r, p)] for p in range(len(t))]) - reqs.world.dense_logits(t, reqs.dead[r]))
                     .abs().max()) for r, t in enumerate(reqs.tokens))


@pytest.fixture(scope="module", params=list(CONFIGS))
def world(request) -> World:
    return World(text_config(**CONFIGS[request.param]))


@pytest.fixture(scope="module")
def tiny() -> World:
    return World(text_config())


LENGTHS = [23, 9, 17]
DEAD_AT = {1: [3, 4]}


def test_paged_prefill_chunks_and_decode_equal_dense(world):
    reqs = Requests(world, LENGTHS, DEAD_AT)
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 64)
    out: dict = {}
    reqs.run([(0, 11), (1, 5), (2, 3)], out, bufs)  # prefill, whole and chunked, mixed; chunks end inside pairs
    reqs.run([(2, 6), (0, 4)], out, bufs, pad_tokens=3, pad_rows=2)  # chunks + static-style padding
    reqs.run([(1, 2), (0, 1), (2, 1)], out, bufs)
    while any(d < len(t) for d, t in zip(reqs.done, reqs.tokens)):  # decode token by token
        reqs.run([(r, 1) for r in range(len(LENGTHS)) if reqs.done[r] < len(reqs.tokens[r])], out, bufs)
    assert len(out) == sum(LENGTHS)
    assert check_against_dense(reqs, out) == []


def test_one_step_prefill_equals_dense(world):
    reqs = Requests(world, LENGTHS, DEAD_AT, seed=1)
    out: dict = {}
    reqs.run([(r, n) for r, n in enumerate(LENGTHS)], out, MicrobatchBuffers.allocate(world.cfg, 0, 64))
    assert check_against_dense(reqs, out) == []


def test_dense_comparison_can_fail(world):
    """Negative control: Engram rows shifted by one token, or ablated, are visibly different."""
    reqs = Requests(world, [20], seed=2)
    toks, dead = reqs.tokens[0], reqs.dead[0]
    ref = world.dense_logits(toks, dead)
    assert (world.dense_logits(toks, dead, ablate=True) - ref).abs().max() > 1e3 * TOL
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 64)
    batch = reqs.batch([(0, 20)])
    batch.hash_ids = torch.roll(batch.hash_ids, 1, dims=0)
    logits = world.model.compute_logits(forward(world.model, reqs.context(batch, bufs)))
    assert (logits - ref).abs().max() > 1e3 * TOL


def round_robin(gens) -> tuple[list, list[str]]:
    results, order, active = [None] * len(gens), [], list(range(len(gens)))
    while active:
        for i in list(active):
            try:
                order.append(f"{i}:{next(gens[i])}")
            except StopIteration as stop:
                results[i] = stop.value
                active.remove(i)
    return results, order


def test_interleaved_microbatches_with_straddling_requests_equal_dense(tiny):
    reqs = Requests(tiny, [14, 11, 8], seed=3)
    tracker = OwnershipTracker()
    bufs = [MicrobatchBuffers.allocate(tiny.cfg, k, 32) for k in range(2)]
    out: dict = {}
    # one step [(0, 10), (1, 7), (2, 8)] cut at token 7 and token 15: request 0 straddles inside a pair (6, 7)
    b0 = reqs.batch([(0, 7)])
    b1 = reqs.batch([(0, 3), (1, 7), (2, 8)])
    with torch.no_grad():
        (h0, h1), order = round_robin([tiny.model.stages(reqs.context(b, q, tracker)) for b, q in zip((b0, b1), bufs)])
    reqs.collect(b0, h0, out)
    reqs.collect(b1, h1, out)
    reqs.run([(0, 4), (1, 4)], out, bufs[0])
    assert order[:2] == ["0:attn", "1:attn"]  # layer 0 of microbatch 0 before layer 0 of microbatch 1
    assert check_against_dense(reqs, out) == []


def test_out_of_order_microbatches_break_the_straddling_request(tiny):
    """Negative control for the ordering guarantee: run microbatch 1 before microbatch 0 and the straddling
    request reads window keys and an open group that are not written yet."""
    reqs = Requests(tiny, [10], seed=3)
    b0, b1 = reqs.batch([(0, 5)]), reqs.batch([(0, 5)])
    bufs = [MicrobatchBuffers.allocate(tiny.cfg, k, 16) for k in range(2)]
    out: dict = {}
    with torch.no_grad():
        (h1, h0), _ = round_robin([tiny.model.stages(reqs.context(b, q)) for b, q in ((b1, bufs[1]), (b0, bufs[0]))])
    reqs.collect(b0, h0, out)
    reqs.collect(b1, h1, out)
    assert max_dense_diff(reqs, out) > 1e3 * TOL


@pytest.mark.parametrize("shared", ["none", "staging", "topk", "candidates"])
def test_ownership_check_fires_on_a_shared_buffer(tiny, shared):
    reqs = Requests(tiny, [12, 12], seed=4)
    b0, b1 = reqs.batch([(0, 12)]), reqs.batch([(1, 12)])
    own = [MicrobatchBuffers.allocate(tiny.cfg, k, 16) for k in range(2)]
    if shared == "staging":
        own[1].staging = own[0].staging
    elif shared == "topk":
        own[1].topk_idx = own[0].topk_idx
    elif shared == "candidates":
        own[1].candidates = own[0].candidates
    tracker = OwnershipTracker()
    with torch.no_grad():
        gens = [tiny.model.stages(reqs.context(b, q, tracker)) for b, q in zip((b0, b1), own)]
        if shared == "none":
            round_robin(gens)
        else:
            with pytest.raises(OwnershipError, match=f"'{shared}' is owned by microbatch 0 .* by microbatch 1"):
                round_robin(gens)


def test_stage_names_every_layer_yields(tiny):
    reqs = Requests(tiny, [5], seed=5)
    bufs = MicrobatchBuffers.allocate(tiny.cfg, 0, 8)
    with torch.no_grad():
        _, order = round_robin([tiny.model.stages(reqs.context(reqs.batch([(0, 5)]), bufs))])
    names = [o.split(":")[1] for o in order]
    want = []
    for layer in range(tiny.cfg.num_hidden_layers):  # Engram on layers 1 and 4 of the built-in roles
        want += ["engram_gather"] * (layer in tiny.cfg.engram.engram_layer_ids)
        want += ["attn", "moe"]
    assert tiny.cfg.engram.engram_layer_ids == (1, 4) and names == want


def test_dead_tokens_get_gate_zero(tiny):
    cfg = tiny.cfg
    gate = EngramGate(cfg.hidden_size, cfg.hc_mult, cfg.engram.num_columns, cfg.engram.engram_head_dim, 1e-6)
    torch.nn.init.normal_(gate.wkv.weight, std=0.05)
    h = torch.randn(6, cfg.hc_mult, cfg.hidden_size)
    rows = torch.randn(6, cfg.engram.num_columns, cfg.engram.engram_head_dim)
    dead = torch.tensor([False, True, False, False, True, False])
    g, _ = gate.gate(h, rows, dead)
    assert (g[dead] == 0).all() and (g[~dead] > 0).all()
    with torch.no_grad():
        out = gate(h, rows, dead, ops.choose(h))
    assert torch.equal(out[dead], h[dead]) and not torch.allclose(out[~dead], h[~dead])


@pytest.mark.parametrize("perturb_dead", [True, False])
def test_dead_token_rows_have_no_effect_anywhere(tiny, perturb_dead):
    """Noise in a dead token's staged rows changes nothing; in a live token's rows (control) it does."""
    target = 5 if perturb_dead else 6
    results = []
    for noise in (False, True):
        reqs = Requests(tiny, [14], {0: [5]}, seed=6)
        batch = reqs.batch([(0, 14)])
        bufs = MicrobatchBuffers.allocate(tiny.cfg, 0, 16)
        ctx = reqs.context(batch, bufs)
        if noise:
            bufs.staging[:, target] = torch.randn_like(bufs.staging[:, target]) * 10
        results.append(tiny.model.compute_logits(forward(tiny.model, ctx)))
    same = torch.equal(results[0], results[1])
    assert same == perturb_dead


def test_the_top_k_selects_on_these_sequences():
    """Control that selection is really active in the "tiny" variant: with an index_topk large enough to keep
    every entry (and candidate blocks covering them all) the logits change."""
    a = World(text_config())
    b = World(text_config(index_topk=64, candidate_topk_blocks=64))
    toks, dead = list(range(100, 130)), [False] * 30
    assert (a.dense_logits(toks, dead) - b.dense_logits(toks, dead)).abs().max() > 1e3 * TOL


def test_forward_dense_is_differentiable(tiny):
    """Every parameter gets a finite gradient but those that only choose: the indexers (their scores pick
    entries; the top-k has no gradient) and the router's bias (it picks experts, never weighs them)."""
    model = World(text_config()).model
    model.train().requires_grad_(True)
    ids = torch.randint(6, tiny.cfg.vocab_size, (2, 20))
    c, hd = tiny.cfg.engram.num_columns, tiny.cfg.engram.engram_head_dim
    rows = [torch.randn(2, 20, c, hd) for _ in range(tiny.cfg.engram.num_layers)]
    loss = model.forward_dense(ids, rows).logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    none = {n for n, g in grads.items() if g is None}
    choosers = {n for n in grads if ".indexer." in n or n.endswith("ffn.gate.bias")}
    assert none == choosers
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)


def test_paged_state_writes_padding_to_the_trash_slot_and_never_the_zero_slot(tiny):
    kv = PagedState(tiny.cfg, num_blocks=2, block_size=4)
    pool = kv.window[0]  # [slots + 2, head_dim]
    vals = torch.arange(3.0)[:, None].expand(3, pool.shape[1])
    kv.write(pool, torch.tensor([5, -1, 0]), vals)
    assert (pool[5] == 0).all() and (pool[0] == 2).all()
    assert (pool[kv.trash_slot] == 1).all()  # the -1 token's write landed in the trash slot
    assert (pool[:kv.num_slots].sum(1) != 0).sum() == 1 and (pool[kv.zero_slot] == 0).all()
    assert set(kv.entries) == set(kv.index_keys) == set(tiny.cfg.kv_source_layer_ids)
    assert set(kv.open) == {s for s in tiny.cfg.kv_source_layer_ids if tiny.cfg.ratios[s] == 2}


def test_tables_gather_into_staging_in_place(tiny):
    cfg = tiny.cfg
    tables = EngramTables.random(cfg.engram, 0)
    ids = torch.stack([torch.randint(0, n, (7, cfg.engram.num_columns)) for n in tables.rows_per_layer], dim=1)
    staging = torch.zeros(cfg.engram.num_layers, 10, cfg.engram.num_columns, cfg.engram.engram_head_dim)
    ptr = staging.data_ptr()
    tables.gather(ids, staging[:, :7])
    assert staging.data_ptr() == ptr and (staging[:, 7:] == 0).all()
    for layer, tab in enumerate(tables.tables):
        assert torch.equal(staging[layer, :7], tab[ids[:, layer]])  # plain-indexing reference


def test_padding_only_step_reads_only_the_zero_slot_and_writes_only_the_trash_slot(tiny):
    """Padding tokens (a null row at position 0) read nothing but the zero slot: with every other slot of
    every pool NaN, their hidden states are finite; and nothing but the trash slot changes."""
    reqs = Requests(tiny, [5], seed=7)
    kv = reqs.kv
    pools = [*kv.window, *kv.entries.values(), *kv.index_keys.values(), *kv.open.values()]
    for pool in pools:
        pool[:kv.num_slots] = float("nan")
    before = [p.clone() for p in pools]
    bufs = MicrobatchBuffers.allocate(tiny.cfg, 0, 8)
    hidden = forward(tiny.model, reqs.context(reqs.batch([], pad_tokens=3, pad_rows=1), bufs))
    assert hidden.shape == (3, tiny.cfg.hidden_size) and torch.isfinite(hidden).all()
    trash = kv.trash_slot
    assert all(torch.equal(a[:trash].isnan(), b[:trash].isnan()) and torch.equal(a[trash + 1:], b[trash + 1:])
               for a, b in zip(pools, before))


def test_microbatch_larger_than_its_buffers_is_refused(tiny):
    reqs = Requests(tiny, [9], seed=8)
    bufs = MicrobatchBuffers.allocate(tiny.cfg, 0, 16)
    small = dataclasses.replace(bufs, staging=bufs.staging[:, :4])
    batch = reqs.batch([(0, 9)])
    ctx = ForwardContext(batch, reqs.kv, small, lambda i: bufs.staging[i, :9])
    with pytest.raises(StaticBufferError, match="buffers of microbatch 0 hold 4 tokens; the microbatch has 9"):
        forward(tiny.model, ctx)


def test_attention_with_a_sink_is_softmax_attention_with_one_more_logit():
    """`attend` (key = value, a sink logit in the denominator only, masked keys) against the textbook form:
    with a sink of -inf, plain softmax attention; with a finite sink, its weights scaled by the softmax's
    share of the sink."""
    g = torch.Generator().manual_seed(0)
    n, heads, k, hd = 5, 3, 7, 8
    q, keys = torch.randn(n, heads, hd, generator=g), torch.randn(n, k, hd, generator=g)
    ok = torch.rand(n, k, generator=g) < 0.7
    ok[:, 0] = True
    sink = torch.randn(heads, generator=g)
    z = torch.einsum("nhd,nkd->nhk", q.double(), keys.double()) / hd ** 0.5
    z = z.masked_fill(~ok[:, None, :], float("-inf"))
    plain = torch.einsum("nhk,nkd->nhd", torch.softmax(z, -1), keys.double())
    got = ops_torch.attend(q, keys, ok, torch.full((heads,), float("-inf")), hd ** -0.5)
    assert torch.allclose(got.double(), plain, atol=1e-6)
    share = torch.exp(z).sum(-1) / (torch.exp(z).sum(-1) + torch.exp(sink.double())[None, :])  # [n, heads]
    got = ops_torch.attend(q, keys, ok, sink, hd ** -0.5)
    assert torch.allclose(got.double(), plain * share[..., None], atol=1e-6)


def test_dense_forward_is_causal(tiny):
    toks = list(range(200, 216))
    a = tiny.dense_logits(toks, [False] * 16)
    b = tiny.dense_logits(toks[:10] + [7] * 6, [False] * 16)
    assert torch.equal(a[:10], b[:10]) and (a[10:] - b[10:]).abs().max() > 1e-2
