"""The paged serving path against the dense reference path, Engram gating, stages and buffer ownership."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engram_serve.config import ModelConfig, read_json
from engram_serve.engram.hashing import hash_step
from engram_serve.engram.layer import EngramGate
from engram_serve.engram.layout import build_layout
from engram_serve.engram.tables import EngramTables
from engram_serve.engram.token_map import build_token_map, load_tokenizer
from engram_serve.errors import OwnershipError
from engram_serve.inputs.batch import StepBatch
from engram_serve.inputs.token_store import TokenStore
from engram_serve.microbatch.buffers import MOE_COMBINE, MOE_DISPATCH, MicrobatchBuffers
from engram_serve.model.context import ForwardContext
from engram_serve.model.kv_cache import KVCache
from engram_serve.model.loader import TINY_DIR
from engram_serve.model.model import EngramModel, init_weights
from engram_serve.runner.ownership import OwnershipTracker

BLOCK = 4
TOL = 1e-5


def tiny_config(**over) -> ModelConfig:
    cfg = ModelConfig.from_dict(read_json(TINY_DIR / "config.json"))
    eng = {k: over.pop(k) for k in list(over) if k == "hc_mult"}
    if eng:
        over["engram"] = dataclasses.replace(cfg.engram, **eng)
    return dataclasses.replace(cfg, **over)


CONFIGS = {
    # everything on: hc_mult=2, MoE on layer 3, Engram on 1-2, index sharing 1 -> 2 with a top-k that bites
    "full": dict(index_topk=6),
    "plain": dict(hc_mult=1, moe_layer_ids=(), n_routed_experts=0, index_layer_ids=(), index_topk=0),
}


class World:
    """A random model, its tables and the Engram hashing inputs, plus a hand-built step batch factory."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg = cfg
        self.model = init_weights(EngramModel(cfg), seed).eval()
        self.tables = EngramTables.random(cfg.engram, seed + 1)
        self.layout = build_layout(cfg.engram)
        self.token_map = TOKEN_MAP
        self.pad_id = int(self.token_map[cfg.engram.engram_pad_token_id])

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


class Requests:
    """Requests with fixed token sequences, their blocks (shuffled pool) and a token store."""

    def __init__(self, world: World, lengths: list[int], dead_at: dict[int, list[int]] | None = None, seed: int = 0):
        rng = random.Random(seed)
        self.world = world
        self.tokens = [[rng.randrange(world.cfg.vocab_size) for _ in range(n)] for n in lengths]
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
        self.kv = KVCache.for_config(world.cfg, num_blocks=len(pool), block_size=BLOCK)

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
            hidden = self.world.model.forward_step(self.context(batch, bufs))
        assert hidden.shape == (batch.num_tokens, self.world.cfg.hidden_size)
        self.collect(batch, hidden, out)


def check_against_dense(reqs: Requests, out: dict) -> float:
    worst = 0.0
    for r, toks in enumerate(reqs.tokens):
        ref = reqs.world.dense_logits(toks, reqs.dead[r])
        got = torch.stack([out[(r, p)] for p in range(len(toks))])
        worst = max(worst, (got - ref).abs().max().item())
    return worst


@pytest.fixture(scope="module", params=list(CONFIGS))
def world(request) -> World:
    return World(tiny_config(**CONFIGS[request.param]))


LENGTHS = [23, 9, 17]
DEAD_AT = {1: [3, 4]}


def test_paged_prefill_chunks_and_decode_match_dense(world):
    reqs = Requests(world, LENGTHS, DEAD_AT)
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 64)
    out: dict = {}
    reqs.run([(0, 12), (1, 5), (2, 3)], out, bufs)  # prefill, whole and chunked, mixed
    reqs.run([(2, 6), (0, 4)], out, bufs, pad_tokens=3, pad_rows=2)  # chunks + static-style padding
    reqs.run([(1, 2), (0, 1), (2, 1)], out, bufs)
    while any(d < len(t) for d, t in zip(reqs.done, reqs.tokens)):  # decode token by token
        reqs.run([(r, 1) for r in range(len(LENGTHS)) if reqs.done[r] < len(reqs.tokens[r])], out, bufs)
    assert len(out) == sum(LENGTHS)
    assert check_against_dense(reqs, out) < TOL


def test_one_step_prefill_matches_dense(world):
    reqs = Requests(world, LENGTHS, DEAD_AT, seed=1)
    out: dict = {}
    reqs.run([(r, n) for r, n in enumerate(LENGTHS)], out, MicrobatchBuffers.allocate(world.cfg, 0, 64))
    assert check_against_dense(reqs, out) < TOL


def test_dense_comparison_can_fail(world):
    """Negative control: Engram rows shifted by one token, or ablated, are visibly different."""
    reqs = Requests(world, [20], seed=2)
    toks, dead = reqs.tokens[0], reqs.dead[0]
    ref = world.dense_logits(toks, dead)
    assert (world.dense_logits(toks, dead, ablate=True) - ref).abs().max() > 1e3 * TOL
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 64)
    batch = reqs.batch([(0, 20)])
    batch.hash_ids = torch.roll(batch.hash_ids, 1, dims=0)
    with torch.no_grad():
        logits = world.model.compute_logits(world.model.forward_step(reqs.context(batch, bufs)))
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


def test_interleaved_microbatches_with_straddling_request_match_dense():
    world = World(tiny_config(index_topk=6))
    reqs = Requests(world, [14, 11, 8], seed=3)
    tracker = OwnershipTracker()
    bufs = [MicrobatchBuffers.allocate(world.cfg, k, 32) for k in range(2)]
    out: dict = {}
    # one step [(0, 10), (1, 7), (2, 8)] cut at token 6 and token 15: request 0 and 1 straddle
    b0 = reqs.batch([(0, 6)])
    b1 = reqs.batch([(0, 4), (1, 7), (2, 8)])
    with torch.no_grad():
        (h0, h1), order = round_robin([world.model.stages(reqs.context(b, q, tracker)) for b, q in zip((b0, b1), bufs)])
    reqs.collect(b0, h0, out)
    reqs.collect(b1, h1, out)
    reqs.run([(0, 4), (1, 4)], out, bufs[0])
    assert order[:2] == ["0:attn", "1:attn"]  # layer 0 of microbatch 0 before layer 0 of microbatch 1
    assert check_against_dense(reqs, out) < TOL


def test_out_of_order_microbatches_break_the_straddling_request():
    """Negative control for the ordering guarantee: run microbatch 1 before microbatch 0 and the straddling
    request reads keys that are not written yet."""
    world = World(tiny_config(index_topk=6))
    reqs = Requests(world, [10], seed=3)
    b0, b1 = reqs.batch([(0, 6)]), reqs.batch([(0, 4)])
    bufs = [MicrobatchBuffers.allocate(world.cfg, k, 16) for k in range(2)]
    out: dict = {}
    with torch.no_grad():
        (h1, h0), _ = round_robin([world.model.stages(reqs.context(b, q)) for b, q in ((b1, bufs[1]), (b0, bufs[0]))])
    reqs.collect(b0, h0, out)
    reqs.collect(b1, h1, out)
    assert check_against_dense(reqs, out) > 1e3 * TOL


@pytest.mark.parametrize("shared", ["none", "staging", "topk_idx", MOE_DISPATCH, MOE_COMBINE])
def test_ownership_check_fires_on_a_shared_buffer(shared):
    world = World(tiny_config(index_topk=6))
    reqs = Requests(world, [12, 12], seed=4)
    b0, b1 = reqs.batch([(0, 12)]), reqs.batch([(1, 12)])
    own = [MicrobatchBuffers.allocate(world.cfg, k, 16) for k in range(2)]
    if shared == "staging":
        own[1].staging = own[0].staging
    elif shared == "topk_idx":
        own[1].topk_idx = own[0].topk_idx
    elif shared != "none":
        own[1].scratch[shared] = own[0].scratch[shared]
    tracker = OwnershipTracker()
    with torch.no_grad():
        gens = [world.model.stages(reqs.context(b, q, tracker)) for b, q in zip((b0, b1), own)]
        if shared == "none":
            round_robin(gens)
        else:
            with pytest.raises(OwnershipError, match=shared):
                round_robin(gens)


def test_stage_names_every_layer_yields():
    world = World(tiny_config())
    reqs = Requests(world, [5], seed=5)
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 8)
    with torch.no_grad():
        _, order = round_robin([world.model.stages(reqs.context(reqs.batch([(0, 5)]), bufs))])
    names = [o.split(":")[1] for o in order]
    # layer 0 attn | layer 1 engram, attn | layer 2 engram, attn | layer 3 attn + MoE
    assert names == ["attn", "engram_gather", "engram", "attn", "engram_gather", "engram", "attn",
                     "attn", "moe_dispatch", "moe_combine"]
    assert names.count("attn") == world.cfg.num_hidden_layers


def test_dead_tokens_get_gate_zero():
    cfg = tiny_config()
    gate = EngramGate(cfg.hidden_size, cfg.hc_mult, cfg.engram.num_columns, cfg.engram.engram_head_dim, 1e-6)
    torch.nn.init.normal_(gate.wkv.weight, std=0.05)
    h = torch.randn(6, cfg.hc_mult, cfg.hidden_size)
    rows = torch.randn(6, cfg.engram.num_columns, cfg.engram.engram_head_dim)
    dead = torch.tensor([False, True, False, False, True, False])
    g, _ = gate.gate(h, rows, dead)
    assert (g[dead] == 0).all() and (g[~dead] > 0).all()
    out = gate(h, rows, dead)
    assert torch.equal(out[dead], h[dead]) and not torch.allclose(out[~dead], h[~dead])


@pytest.mark.parametrize("perturb_dead", [True, False])
def test_dead_token_rows_have_no_effect_anywhere(perturb_dead):
    """Noise in a dead token's staged rows changes nothing; in a live token's rows (control) it does."""
    world = World(tiny_config())
    target = 5 if perturb_dead else 6
    results = []
    for noise in (False, True):
        reqs = Requests(world, [14], {0: [5]}, seed=6)
        batch = reqs.batch([(0, 14)])
        bufs = MicrobatchBuffers.allocate(world.cfg, 0, 16)
        ctx = reqs.context(batch, bufs)
        if noise:
            bufs.staging[:, target] = torch.randn_like(bufs.staging[:, target]) * 10
        with torch.no_grad():
            results.append(world.model.compute_logits(world.model.forward_step(ctx)))
    same = torch.equal(results[0], results[1])
    assert same == perturb_dead


def test_index_sharing_changes_the_output():
    """Control that index sharing is really active in the 'full' config: a larger top-k changes logits."""
    a = World(tiny_config(index_topk=6))
    b = World(tiny_config(index_topk=64))
    toks, dead = list(range(100, 130)), [False] * 30
    assert (a.dense_logits(toks, dead) - b.dense_logits(toks, dead)).abs().max() > 1e3 * TOL


def test_forward_dense_is_differentiable():
    world = World(tiny_config(index_topk=6))
    world.model.train()
    ids = torch.randint(0, world.cfg.vocab_size, (2, 10))
    c, hd = world.cfg.engram.num_columns, world.cfg.engram.engram_head_dim
    rows = [torch.randn(2, 10, c, hd) for _ in range(world.cfg.engram.num_layers)]
    loss = world.model.forward_dense(ids, rows).logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad for n, p in world.model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]


def test_kv_cache_skips_padding_slots():
    kv = KVCache(1, 2, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    kv.write(0, torch.tensor([5, -1, 0]), k, -k)
    assert kv.k[0, 1, 1, 0].tolist() == [0.0, 1.0] and kv.k[0, 0, 0, 0].tolist() == [4.0, 5.0]
    assert kv.k.abs().sum() == 10.0  # the -1 token went nowhere visible
    k_pool, _ = kv.layer(0)  # [kv_heads, slots, hd]
    assert k_pool[:, kv.trash_slot].tolist() == [[2.0, 3.0]]  # padding writes land in the trash slot
    assert (k_pool[:, kv.zero_slot] == 0).all()  # the zero slot is never written


def test_tables_gather_into_staging_in_place():
    cfg = tiny_config()
    tables = EngramTables.random(cfg.engram, 0)
    ids = torch.stack([torch.randint(0, n, (7, cfg.engram.num_columns)) for n in tables.rows_per_layer], dim=1)
    staging = torch.zeros(cfg.engram.num_layers, 10, cfg.engram.num_columns, cfg.engram.engram_head_dim)
    ptr = staging.data_ptr()
    tables.gather(ids, staging[:, :7])
    assert staging.data_ptr() == ptr and (staging[:, 7:] == 0).all()
    for layer, tab in enumerate(tables.tables):
        assert torch.equal(staging[layer, :7], tab[ids[:, layer]])  # plain-indexing reference


def test_padding_only_step_is_finite_and_writes_no_kv():
    world = World(tiny_config(index_topk=6))
    reqs = Requests(world, [5], seed=7)
    before = reqs.kv.k.clone()
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 8)
    with torch.no_grad():
        hidden = world.model.forward_step(reqs.context(reqs.batch([], pad_tokens=3, pad_rows=1), bufs))
    assert hidden.shape == (3, world.cfg.hidden_size) and torch.isfinite(hidden).all()
    assert torch.equal(reqs.kv.k, before)
    assert (bufs.topk_idx[:3] == -1).all()


def test_microbatch_larger_than_its_buffers_is_refused():
    from engram_serve.errors import StaticBufferError
    world = World(tiny_config())
    reqs = Requests(world, [9], seed=8)
    bufs = MicrobatchBuffers.allocate(world.cfg, 0, 16)
    small = MicrobatchBuffers(0, bufs.staging[:, :4], bufs.topk_idx, bufs.scratch)
    batch = reqs.batch([(0, 9)])
    ctx = ForwardContext(batch, reqs.kv, small, lambda i: bufs.staging[i, :9])
    with pytest.raises(StaticBufferError, match="staging"):
        world.model.forward_step(ctx)


def test_dense_attention_full_matches_plain_causal_sdpa():
    """The training attention against the textbook form (kv heads repeated, is_causal)."""
    from engram_serve.model.attention import FULL, DenseAttention
    g = torch.Generator().manual_seed(0)
    b, s, heads, kvh, hd = 2, 9, 4, 2, 8
    q, k, v = (torch.randn(b * s, n, hd, generator=g) for n in (heads, kvh, kvh))
    out = DenseAttention(b, s, torch.device("cpu")).attend(0, q, k, v, FULL, 0).view(b, s, heads * hd)
    view = lambda x: x.view(b, s, -1, hd).repeat_interleave(heads // x.shape[1], 2).transpose(1, 2)  # noqa: E731
    ref = torch.nn.functional.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=True)
    assert (out - ref.transpose(1, 2).reshape(b, s, heads * hd)).abs().max() < 1e-6


def test_dense_forward_is_causal():
    world = World(tiny_config(index_topk=6))
    toks = list(range(200, 216))
    a = world.dense_logits(toks, [False] * 16)
    b = world.dense_logits(toks[:10] + [7] * 6, [False] * 16)
    assert (a[:10] - b[:10]).abs().max() < 1e-6 and (a[10:] - b[10:]).abs().max() > 1e-2
