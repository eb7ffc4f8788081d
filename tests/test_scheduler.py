"""Scheduler: continuous batching, chunked prefill, prefix caching, preemption by recompute.

The property test drives random interleavings of add / step / abort against a small block pool
and a simulated KV cache (`KVModel`): every position a row claims as computed must hold exactly
that sequence's (token, dead) in the block the sequence maps it to. Negative controls switch one
protection off each and show that the checks go red.
"""
import dataclasses
from collections import Counter

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from engram_serve.engine.block_manager import BlockManager
from engram_serve.engine.scheduler import ScheduledRow, Scheduler, SchedulerConfig, SchedulerOutput
from engram_serve.engine.sequence import Sequence, SequenceStatus
from engram_serve.errors import InvalidRequest, QueueFull

STEMS = (list(range(1, 13)), [7] * 12)


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=16, block_size=4, max_model_len=32)
    return SchedulerConfig(**{**base, **kw})


def fake_model(tokens: list[int]) -> int:
    """A deterministic 'next token': the same history always samples the same token."""
    return (sum(tokens) * 31 + len(tokens)) % 5


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """The scheduler guarantees for one schedule() result (AssertionError naming the broken one)."""
    c, bs = sched.config, sched.config.block_size
    if len({id(r.seq) for r in out.rows}) != len(out.rows):
        raise AssertionError("a sequence is scheduled twice in one step")
    if len(out.rows) > c.max_num_seqs:
        raise AssertionError(f"{len(out.rows)} rows > max_num_seqs={c.max_num_seqs}")
    if out.num_tokens > c.max_num_batched_tokens:
        raise AssertionError(f"{out.num_tokens} tokens > budget max_num_batched_tokens={c.max_num_batched_tokens}")
    for r in out.rows:
        s = r.seq
        if r.num_new < 1 or r.num_computed != s.num_computed_tokens or r.num_computed + r.num_new > s.num_tokens:
            raise AssertionError(f"bad row {r}")
        if len(s.block_ids) * bs < r.num_computed + r.num_new:
            raise AssertionError(f"row {s.request_id!r}: blocks {s.block_ids} do not cover {r.num_computed + r.num_new}")
        if r.num_computed + r.num_new > c.max_model_len or s.status is not SequenceStatus.RUNNING:
            raise AssertionError(f"bad row {r}")
        if not c.enable_chunked_prefill and not r.sample:
            raise AssertionError(f"chunked prefill is off but {s.request_id!r} got a partial prefill")
    ids = {id(r.seq) for r in out.rows}
    for s in out.preempted:
        if id(s) in ids or s.status is not SequenceStatus.WAITING or s.block_ids or s.num_computed_tokens:
            raise AssertionError(f"preempted {s!r} is scheduled or still holds state")


class KVModel:
    """What the KV cache would hold: block -> {offset: (token, dead)}. Fresh blocks hold garbage."""

    def __init__(self, sched: Scheduler):
        self.kv: dict[int, dict[int, tuple]] = {}
        bm, orig = sched.block_manager, sched.block_manager.allocate

        def allocate(seq, n, prefix=()):  # observe which blocks come out of the free pool fresh
            keep = len(prefix) if prefix else len(seq.block_ids)
            orig(seq, n, prefix)
            for b in seq.block_ids[keep:]:
                self.kv.pop(b, None)
        bm.allocate = allocate
        self.bm, self.bs = bm, sched.config.block_size

    def run(self, out: SchedulerOutput) -> None:
        for r in out.rows:
            s, bs = r.seq, self.bs
            for p in range(r.num_computed + r.num_new):
                want = (s.token_ids[p], bool(s.dead[p]) if s.dead else False)
                b = s.block_ids[p // bs]
                if p < r.num_computed:
                    got = self.kv.get(b, {}).get(p % bs)
                    if got != want:
                        raise AssertionError(f"KV content of {s.request_id!r} at position {p} (block {b}): {got} != {want}")
                else:
                    if self.bm.ref_count[b] != 1:
                        raise AssertionError(f"{s.request_id!r} writes position {p} into shared block {b}")
                    self.kv.setdefault(b, {})[p % bs] = want


@st.composite
def configs(draw) -> SchedulerConfig:
    bs = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(2, 24))
    min_blocks = -(-max_model_len // bs)
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 4))
    lo = max(max_num_seqs, 1 if chunked else max_model_len)
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=draw(st.integers(lo, lo + 10)),
                           num_blocks=draw(st.integers(min_blocks, min_blocks + 3)), block_size=bs,
                           max_model_len=max_model_len, enable_chunked_prefill=chunked,
                           enable_prefix_caching=draw(st.booleans()))


class SchedulerMachine(RuleBasedStateMachine):
    stats = None  # a Counter to record what the run exercised (see the coverage test)

    @initialize(config=configs())
    def setup(self, config):
        self.sched = Scheduler(config)
        self.kv = KVModel(self.sched)
        self.max_out: dict[str, int] = {}
        self.shadow: dict[str, list[int]] = {}  # what each request's token_ids must be
        self.seqs: list[Sequence] = []

    @rule(stem=st.sampled_from(STEMS), keep=st.integers(0, 12), tail=st.lists(st.integers(0, 4), max_size=4),
          max_out=st.integers(1, 8), dead=st.booleans())
    def add(self, stem, keep, tail, max_out, dead):
        prompt = (stem[:keep] + tail)[:self.sched.config.max_model_len] or [0]
        s = Sequence(f"r{len(self.seqs)}", prompt, dead=[t == 3 for t in prompt] if dead else None)
        self.sched.add(s)
        self.seqs.append(s)
        self.max_out[s.request_id], self.shadow[s.request_id] = max_out, list(prompt)

    @rule(data=st.data(), n=st.integers(1, 3))
    def step(self, data, n):
        for _ in range(n):
            self.one_step(abort=data.draw(st.lists(st.integers(0, 10), max_size=1)))
            self.check_all()

    @precondition(lambda self: len(self.sched._live) >= 2)
    @rule(data=st.data())
    def abort(self, data):
        s = data.draw(st.sampled_from([s for s in self.seqs if not s.is_finished]))
        assert self.sched.abort(s.request_id) and s.is_finished and s.block_ids == []
        assert not self.sched.abort(s.request_id)

    def one_step(self, abort=()) -> None:
        fresh = {id(s) for s in self.seqs if not s.block_ids}
        out = self.sched.schedule()
        check_step(self.sched, out)
        self.kv.run(out)
        if self.stats is not None:
            self.stats.update(preempted=len(out.preempted), length=len(out.finished),
                              partial=sum(not r.sample for r in out.rows),
                              prefix_hit=sum(id(r.seq) in fresh and r.num_computed > 0 for r in out.rows))
        for i in abort:  # an abort that lands after the step ran, before update()
            if i < len(out.rows) and self.sched.abort(out.rows[i].seq.request_id) and self.stats is not None:
                self.stats["abort_mid_step"] += 1
        self.sched.update(out)
        for r in out.rows:
            s = r.seq
            if s.is_finished or not r.sample:
                continue
            if s.num_computed_tokens != s.num_tokens:
                raise AssertionError(f"sampled row of {s.request_id!r} left tokens uncomputed")
            s.append_token(fake_model(s.token_ids))
            self.shadow[s.request_id].append(s.token_ids[-1])
            if s.num_output_tokens >= self.max_out[s.request_id]:
                self.sched.finish(s, "stop")

    @invariant()
    def check_all(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_invariants()
        for s in self.seqs:  # the scheduler never rewrites a request's tokens (preemption included)
            if s.token_ids != self.shadow[s.request_id]:
                raise AssertionError(f"{s.request_id!r}: token_ids {s.token_ids} != {self.shadow[s.request_id]}")

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        limit = 10 + sum(4 * (s.num_tokens + self.max_out[s.request_id]) for s in self.seqs)
        for _ in range(limit):  # liveness: everything completes without outside help
            if not self.sched.has_unfinished():
                break
            self.one_step()
            self.check_all()
        else:
            raise AssertionError(f"no progress after {limit} steps: {self.sched.running} {list(self.sched.waiting)}")
        for s in self.seqs:
            n_out = {"stop": self.max_out[s.request_id], "length": self.sched.config.max_model_len + 1 - s.num_prompt_tokens}
            if s.finish_reason in n_out and s.num_output_tokens != n_out[s.finish_reason]:
                raise AssertionError(f"{s.request_id!r} finished ({s.finish_reason}) with {s.num_output_tokens} outputs")
        bm = self.sched.block_manager
        bm.check_invariants()
        if bm.num_free != bm.num_blocks:
            raise AssertionError(f"leak: {bm.num_used} blocks still used after every request ended")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(TestSchedulerMachine.settings, stateful_step_count=30,
                                         max_examples=max(150, settings.default.max_examples))


def run_machine_until_failure() -> None:
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=300, stateful_step_count=30, phases=[Phase.generate], database=None, derandomize=True,
        report_multiple_bugs=False, deadline=None))


def test_property_test_exercises_preemption_prefix_hits_chunks_and_aborts(monkeypatch):
    """Guard against a vacuous property test: a fixed-seed run must hit every interesting path."""
    stats = Counter()
    monkeypatch.setattr(SchedulerMachine, "stats", stats)
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=100, stateful_step_count=30, derandomize=True, database=None, deadline=None))
    assert all(stats[k] > 0 for k in ("preempted", "prefix_hit", "partial", "length", "abort_mid_step")), stats


# ---- negative controls: one per safety property ------------------------------------------------

def _forgetful_free(self, s):
    ids, s.block_ids = s.block_ids[:-1], []  # the last block is never released
    for b in ids:
        self.ref_count[b] -= 1
        if not self.ref_count[b]:
            self._free[b] = None
    self._holders.pop(id(s), None)


def _leaky_finish(self, seq, reason):
    (self.running if seq in self.running else self.waiting).remove(seq)  # sabotage: blocks never freed
    del self._live[seq.request_id]
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


def _lazy_preempt(self, seq, out):
    self.running.remove(seq)
    self.block_manager.free(seq)  # sabotage: keeps num_computed_tokens, so it would skip the recompute
    seq.status = SequenceStatus.WAITING
    self.waiting.appendleft(seq)
    out.preempted.append(seq)


_chunk = Scheduler._chunk

SABOTAGES = {
    "pool partition / ref counts": ((BlockManager, "free", _forgetful_free), "live holders|neither free nor"),
    "prefix cache content": (("engram_serve.engine.block_manager.block_hash",
                              lambda parent, toks, dead=None: bytes([len(toks)]) + (parent or b"")), "KV content"),
    "token budget": ((Scheduler, "_chunk", lambda self, remaining, budget, room: _chunk(self, remaining, 10**9, room)),
                     "budget"),
    "preemption recomputes": ((Scheduler, "_preempt", _lazy_preempt), "bad waiting sequence|still holds state|KV content"),
    "no leak after finish": ((Scheduler, "finish", _leaky_finish), "holders|leak"),
}


@pytest.mark.parametrize("prop", list(SABOTAGES))
def test_negative_control_property_test_goes_red(prop, monkeypatch):
    target, match = SABOTAGES[prop]
    monkeypatch.setattr(*target)
    with pytest.raises(AssertionError, match=match):
        run_machine_until_failure()


@pytest.mark.parametrize("doctor,match", [
    (lambda out: out.rows.append(out.rows[0]), "scheduled twice"),
    (lambda out: out.rows.extend(ScheduledRow(Sequence(f"x{i}", [1]), 0, 1) for i in range(9)), "max_num_seqs"),
    (lambda out: out.rows.__setitem__(0, dataclasses.replace(out.rows[0], num_new=out.rows[0].num_new + 8)),
     "bad row|do not cover|budget"),
    (lambda out: out.rows[0].seq.block_ids.pop(), "do not cover"),
    (lambda out: out.preempted.append(out.rows[0].seq), "preempted"),
])
def test_negative_control_step_checks_fire(doctor, match):
    s = Scheduler(cfg(num_blocks=8, max_model_len=32))
    s.add(Sequence("a", list(range(8))))
    out = s.schedule()
    check_step(s, out)
    doctor(out)
    with pytest.raises(AssertionError, match=match):
        check_step(s, out)


# ---- deterministic tests -----------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("block_size", -1), ("max_model_len", 1.5),
                                         ("num_blocks", 1), ("max_num_batched_tokens", 2),
                                         ("enable_prefix_caching", "yes"), ("max_waiting", 0),
                                         ("max_waiting", True)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"field {field}="):
        cfg(**{field: value})


def test_config_without_chunking_needs_a_budget_for_a_whole_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens=16.*enable_chunked_prefill=False"):
        cfg(enable_chunked_prefill=False)


def test_add_rejects_empty_too_long_and_duplicate_requests():
    s = Scheduler(cfg(max_model_len=8, num_blocks=2))
    with pytest.raises(InvalidRequest, match="empty"):
        s.add(Sequence("a", []))
    with pytest.raises(InvalidRequest, match="num_prompt_tokens=9 > max_model_len=8"):
        s.add(Sequence("a", [1] * 9))
    s.add(Sequence("a", [1]))
    with pytest.raises(InvalidRequest, match="request_id='a'") as e:
        s.add(Sequence("a", [2]))
    assert e.value.param == "request_id"
    assert s.num_waiting == 1 and s.num_running == 0


def test_max_waiting_bounds_the_one_queue_and_preempted_requests_come_back_regardless():
    s = Scheduler(cfg(max_num_batched_tokens=32, num_blocks=8, max_waiting=1))  # 8 blocks: two 16-token prompts
    a, b = Sequence("a", list(range(16))), Sequence("b", list(range(100, 116)))
    s.add(a)
    with pytest.raises(QueueFull, match="1 requests are waiting, max_waiting=1") as e:
        s.add(b)
    assert e.value.param is None and s.num_waiting == 1 and not s.abort("b")
    out = s.schedule()
    s.update(out)
    assert [r.seq for r in out.rows] == [a]  # a runs: the queue has room again
    s.add(b)
    out = s.schedule()
    s.update(out)
    assert [r.seq for r in out.rows] == [b] and s.block_manager.num_free == 0
    for seq in (a, b):
        seq.append_token(1)  # each one's sampled token: a's decode needs a 5th block, b (the later) is preempted
    s.add(Sequence("w", [5]))
    out = s.schedule()
    assert out.preempted == [b] and [q.request_id for q in s.waiting] == ["b", "w"]  # over the bound
    with pytest.raises(QueueFull):
        s.add(Sequence("x", [6]))
    s.check_invariants()
    unbounded = Scheduler(cfg(max_waiting=None))
    for i in range(50):
        unbounded.add(Sequence(str(i), [i + 1]))
    assert unbounded.num_waiting == 50


def drive(sched: Scheduler, seqs: list[Sequence], max_out: int, arrive_at: dict | None = None) -> int:
    """Run to completion with the fake model; returns the number of steps."""
    arrive_at = arrive_at or {s.request_id: 0 for s in seqs}
    for step in range(1000):
        for s in seqs:
            if arrive_at[s.request_id] == step:
                sched.add(s)
        if not sched.has_unfinished() and step > max(arrive_at.values()):
            return step
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out)
        for r in out.rows:
            if r.sample:
                r.seq.append_token(fake_model(r.seq.token_ids))
                if r.seq.num_output_tokens == max_out:
                    sched.finish(r.seq, "stop")
        sched.check_invariants()
    raise AssertionError("did not finish")


def test_chunked_prefill_then_decode_first():
    s = Scheduler(cfg(max_num_batched_tokens=5))
    a = Sequence("a", list(range(12)))
    s.add(a)
    chunks = []
    while not a.output_token_ids:
        out = s.schedule()
        chunks.append([(r.num_computed, r.num_new, r.sample) for r in out.rows])
        s.update(out)
        for r in out.rows:
            if r.sample:
                r.seq.append_token(7)
    assert chunks == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    b = Sequence("b", list(range(50, 62)))
    s.add(b)
    out = s.schedule()
    assert [(r.seq.request_id, r.num_computed, r.num_new) for r in out.rows] == [("a", 12, 1), ("b", 0, 4)]
    assert out.num_tokens == 5
    assert out.block_table_array(5) == [a.block_ids + [-1], b.block_ids + [-1] * 4]
    with pytest.raises(ValueError, match="max_blocks=3"):
        out.block_table_array(3)


def test_shared_three_block_prefix_is_reused():
    s = Scheduler(cfg())
    shared = list(range(100, 112))  # 3 blocks of 4
    a, b = Sequence("a", shared + [1, 2]), Sequence("b", shared + [3])
    s.add(a)
    s.update(s.schedule())
    s.add(b)
    out = s.schedule()
    (row,) = [r for r in out.rows if r.seq is b]
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert row.num_computed == 12 and row.num_new == 1
    s.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_block():
    s = Scheduler(cfg())
    prompt = list(range(8))
    a, b = Sequence("a", prompt), Sequence("b", prompt)
    s.add(a)
    s.update(s.schedule())
    s.add(b)
    out = s.schedule()
    (row,) = [r for r in out.rows if r.seq is b]
    assert (row.num_computed, row.num_new, row.sample) == (4, 4, True)  # block-aligned, >= 1 token left


def test_preempted_sequence_completes_with_identical_tokens():
    prompts = [[i % 5] * 6 + [i] for i in range(5)]
    roomy = Scheduler(cfg(num_blocks=64))
    tight = Scheduler(cfg(num_blocks=4, max_model_len=16))
    done = {}
    for sched in (roomy, tight):
        seqs = [Sequence(f"r{i}", p) for i, p in enumerate(prompts)]
        drive(sched, seqs, max_out=8)
        done[id(sched)] = [s.token_ids for s in seqs]
        assert all(s.num_output_tokens == 8 and s.block_ids == [] for s in seqs)
        assert sched.block_manager.num_free == sched.block_manager.num_blocks
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert done[id(roomy)] == done[id(tight)]


def test_preemption_victim_is_the_latest_arrival_and_goes_to_the_front():
    s = Scheduler(cfg(num_blocks=4, max_model_len=16, max_num_batched_tokens=16))
    a, b = Sequence("a", [1] * 8), Sequence("b", [2] * 7)
    s.add(a)
    s.add(b)
    out = s.schedule()  # a: 2 blocks, b: 2 blocks, pool full
    s.update(out)
    for r in out.rows:
        r.seq.append_token(0)
    c = Sequence("c", [3])
    s.add(c)
    out = s.schedule()  # a needs a 3rd block: b (latest running) is preempted
    assert out.preempted == [b] and s.num_preemptions == 1 and list(s.waiting) == [b, c]
    assert [r.seq for r in out.rows] == [a] and b.num_computed_tokens == 0 and b.token_ids == [2] * 7 + [0]


def test_without_chunked_prefill_prompts_run_whole():
    s = Scheduler(cfg(max_num_batched_tokens=32, enable_chunked_prefill=False))
    seqs = [Sequence(f"r{i}", [i] * 20) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [(r.seq.request_id, r.num_new) for r in out.rows] == [("r0", 20)]


def test_abort_frees_and_is_idempotent():
    s = Scheduler(cfg())
    a, b = Sequence("a", [1] * 5), Sequence("b", [2] * 5)
    s.add(a)
    s.add(b)
    s.update(s.schedule())
    assert s.abort("a") and a.is_finished and a.finish_reason == "abort" and a.block_ids == []
    assert not s.abort("a") and not s.abort("nope")
    assert s.abort("b") and not s.has_unfinished()
    assert s.block_manager.num_free == s.block_manager.num_blocks


def test_length_cap_finishes_instead_of_overrunning():
    s = Scheduler(cfg(max_model_len=4, num_blocks=1))
    a = Sequence("a", [1, 2, 3])
    steps = drive(s, [a], max_out=99)
    assert a.finish_reason == "length" and a.num_tokens == 5 and steps < 10
