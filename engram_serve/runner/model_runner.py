"""The model runner: prepares a step, runs it whole or as interleaved microbatches, gathers logits once.

Per step: build the StepBatch from the schedule (vectorised, from the token store), plan the cut and
slice it (microbatch/), and for each microbatch compute its hash ids from its own inputs (tokens, positions,
history) and start gathering its Engram rows from the host tables into its OWN staging buffer on a
worker thread, so the lookup overlaps the other microbatch's compute (in a whole step whose gather
takes long enough, the layers before the first Engram layer). The executor interleaves the
microbatches' stage generators; logits are computed once over the merged step's sampled rows.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import kernels
from ..engram.hashing import hash_step, hash_step_host
from ..inputs.batch import StepBatch
from ..inputs.decode import DecodeInputs
from ..inputs.static import StaticInputPool, pad_tokens
from ..inputs.step import build_step
from ..inputs.step_state import StepState
from ..microbatch.buffers import MicrobatchBuffers
from ..microbatch.executor import run_interleaved
from ..microbatch.plan import MicrobatchConfig, MicrobatchPlanner, check_bounds
from ..microbatch.slicing import slice_microbatches
from ..model.context import ForwardContext
from ..model.paged_state import PagedState
from ..model.exactness import MIN_ROWS, batch_invariant
from ..model.products import pad_rows
from ..model.layers import matmul_weights
from ..model.loader import LoadedModel
from .cpu_graphs import CpuGraphs, bound
from .ownership import OwnershipTracker
from .process import freeze_startup_objects, keep_freed_memory


@dataclass(frozen=True)
class RunnerConfig:
    """Sizes and switches of one runner. `exact` (default) runs the forward under the batch-invariance
    rules (model/exactness.py, model/deepseek_v41.py), so a row's logits are bit-identical whatever
    the batch, cut or chunk; on CPU it also runs the forward on one intra-op thread (torch splits
    matmuls and elementwise loops across threads at size-dependent places)."""

    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_blocks: int = 1024
    microbatch: MicrobatchConfig = field(default_factory=MicrobatchConfig)
    graph_sizes: tuple[int, ...] = ()  # padded step sizes for graph mode; () = eager, unpadded
    debug_ownership: bool = False
    device: str = "cpu"
    exact: bool = True
    cpu_graphs: bool = True  # CPU: decode microbatches replayed as their recorded kernel calls (runner/cpu_graphs.py)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.graph_sizes and max(self.graph_sizes) < self.max_num_batched_tokens:
            raise ValueError(f"graph_sizes={self.graph_sizes}: the largest must hold "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass
class StepOutput:
    """logits [S, V] of the sampled rows (in row order; a replayed decode step's are its graph's own buffer, valid
    until the next step); the token boundaries of the microbatches; with `record`, copies of the real tokens'
    hash_ids [T, L, C] and staged rows [L, T, C, hd]."""

    logits: torch.Tensor
    bounds: list[int]
    straddling_rows: int
    scored: torch.Tensor | None = None  # [sum of the scored rows' tokens, V] float32: every token of `score_rows`
    hash_ids: torch.Tensor | None = None
    staged: torch.Tensor | None = None
    # [T, nL D]: the DSpark drafter's features of every real token of the step, in token order (the stream means
    # entering `dspark_target_layer_ids`, concatenated; model/deepseek_v41.py), with `capture_features`; else None.
    # Valid until the next step (a replayed graph's own buffer)
    features: torch.Tensor | None = None


def read_tokens(qsl: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """[sum(reads)] int64: the indices of each row's last reads[r] tokens, in order (no loop per row)."""
    reads = np.asarray(reads, dtype=np.int64)
    first = np.repeat(qsl[1:] - reads, reads)  # each read token's row's first read token
    return first + np.arange(len(first)) - np.repeat(np.cumsum(reads) - reads, reads)


def mine(read: np.ndarray, t0: int, t1: int) -> torch.Tensor:
    """The read tokens inside microbatch [t0, t1), as indices into it."""
    return torch.from_numpy(read[(read >= t0) & (read < t1)] - t0)


class ModelRunner:
    """Prepares and runs steps. The class attributes below are protections that a test subclass turns
    off (negative controls); they are not options."""

    rebuild_history = True  # per-microbatch history rebuilt for a straddling row's first token
    neutral_padding = True  # static-buffer padding rewritten every step
    capture_features = False  # set by the engine for a drafter that reads the target's features (StepOutput.features)

    def __init__(self, loaded: LoadedModel, cfg: RunnerConfig):
        self.cfg, self.loaded = cfg, loaded
        self.model = loaded.model
        mcfg = loaded.config
        self.device = torch.device(cfg.device)
        if cfg.exact and self.device.type == "cpu" and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # see RunnerConfig: exactness on CPU needs one intra-op thread
        if self.device.type == "cpu":
            keep_freed_memory()  # each step reuses the last one's freed activations instead of faulting them in
        self.model.ensure_positions(cfg.max_model_len, self.device)  # every position a request can reach
        self.layout = loaded.layout.to(self.device)
        self.token_map = loaded.token_map.to(self.device)
        self.pad_id = int(loaded.token_map[mcfg.engram.engram_pad_token_id])
        self.history_len = mcfg.engram.history_len
        self.kv = PagedState(mcfg, cfg.num_blocks, cfg.block_size, device=self.device)  # windows, entries, index keys
        from ..inputs.token_store import TokenStore
        self.store = TokenStore(cfg.max_num_seqs, cfg.max_model_len, self.device)
        self.state = StepState(cfg.max_num_seqs, cfg.max_blocks_per_seq, self.device,
                               pack_capacity=5 * cfg.max_num_seqs + 1 + cfg.max_num_batched_tokens)
        # exact: a microbatch of fewer tokens is padded once to this size (model/exactness.py, the row rule)
        self.pad_rows = pad_rows(matmul_weights(self.model)) if cfg.exact and self.device.type == "cpu" else MIN_ROWS
        cap = max(cfg.graph_sizes) if cfg.graph_sizes else max(cfg.max_num_batched_tokens, self.pad_rows)
        self.bufs = self.allocate_buffers(cap)
        self.static = StaticInputPool(list(cfg.graph_sizes)) if cfg.graph_sizes else None
        self.tracker = OwnershipTracker() if cfg.debug_ownership else None
        self.cpu_graphs = None
        if cfg.cpu_graphs and self.device.type == "cpu" and self.tracker is None:
            self.cpu_graphs = CpuGraphs(self.model, cfg.max_model_len) if CpuGraphs.available() else None
        # a decode step's inputs, in place (inputs/decode.py): for CPU graph replays, whose host work they cut
        self.decode_inputs, self._decode_prep = None, {}
        if self.cpu_graphs is not None and self.static is None and kernels.loaded("hash"):
            self.decode_inputs = DecodeInputs(cfg.max_num_seqs, self.pad_rows if cfg.exact else 1, cfg.block_size,
                                              self.history_len, cfg.max_blocks_per_seq)
        self._gather_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-gather")
        # CUDA: the Engram host-to-device copies run on their own stream, ordered by events
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # planning: what a cut could hide, and where each gather runs
        self.launches_collectives = False  # True where each layer launches a collective (tensor/expert parallelism)
        tabs = loaded.tables.tables
        self.planner = MicrobatchPlanner(cfg.microbatch, bool(tabs) and tabs[0].device != self.device)
        self.gather_wait_ms = 0.0  # the last step's time blocked waiting for staged rows (exposed gather)
        freeze_startup_objects()  # once per process: the collector's full passes skip what startup made

    def allocate_buffers(self, capacity: int) -> list[MicrobatchBuffers]:
        """One set of buffers per microbatch, each its own (docs/contract.md §5)."""
        return [MicrobatchBuffers.allocate(self.loaded.config, k, capacity, self.device)
                for k in range(self.cfg.microbatch.num_microbatches)]

    # ---- preparation ------------------------------------------------------------------------
    def build(self, slots: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray,
              block_tables: np.ndarray | None = None, sample: np.ndarray | None = None) -> StepBatch:
        """The step batch. `block_tables` None (the engine): the rows of the persistent `self.state`,
        which the caller keeps in sync; graph mode gathers them at the fixed width max_blocks_per_seq,
        eager mode at the width this step needs. An explicit array [R, <=max_blocks_per_seq] (tests, benchmarks)
        is padded to the fixed width."""
        if block_tables is None:
            width = self.cfg.max_blocks_per_seq if self.static is not None else None
            return build_step(self.store, slots, num_computed, num_new, self.state, self.cfg.block_size,
                              self.history_len, sample, table_width=width)
        width = self.cfg.max_blocks_per_seq
        tables = np.full((len(slots), width), -1, dtype=np.int64)
        tables[:, : block_tables.shape[1]] = block_tables
        return build_step(self.store, slots, num_computed, num_new, tables, self.cfg.block_size,
                          self.history_len, sample)

    def build_decode(self, slots: np.ndarray, positions: np.ndarray) -> StepBatch:
        """`build`'s batch for a step in which the rows of token-store `slots` each compute the token at
        `positions` and sample it; with decode inputs (CPU graphs), written in place into them (the same values,
        padded as `execute` pads): valid until the next call, and `execute` then runs it with less host work."""
        if self.decode_inputs is None:
            ones = np.ones(len(slots), dtype=np.int64)
            return self.build(slots, positions, ones, None, ones.astype(bool))
        top = bound(int(positions.max()), self.cfg.max_model_len)
        return self.decode_inputs.fill(self.store, self.state, slots, positions, top)

    def plan(self, batch: StepBatch, microbatch: MicrobatchConfig | None = None) -> list[int]:
        """The step's cut (microbatch/plan.py). Under `when="overlap"` only a step with something to hide is cut."""
        return self.planner.plan(batch.qsl_host, batch.decode_only, self.launches_collectives, microbatch)

    # ---- execution --------------------------------------------------------------------------
    def execute(self, batch: StepBatch, bounds: list[int] | None = None, record: bool = False,
                score_rows: list[int] | None = None, reads: np.ndarray | None = None) -> StepOutput:
        """Run one step cut at `bounds` (default: planned). Returns logits of the sampled rows and,
        with `record` (verification), copies of the hash ids and staged rows; `score_rows`: the logits
        of every token of these rows too (prompt logprobs), in row order. `reads` [R] (verify steps): the
        logits of each row's last reads[r] tokens instead (0: none), in token order."""
        t_start = time.perf_counter()
        if bounds is None:
            bounds = self.plan(batch)
        else:
            check_bounds(bounds, batch.num_tokens, len(self.bufs))
        read = None if reads is None else read_tokens(batch.qsl_host, reads)  # [S] host token indices
        if self.decode_inputs is not None and batch is self.decode_inputs.last and len(bounds) == 2 \
                and not score_rows and read is None:
            return self._decode(batch, bounds, record, t_start)
        mbs = slice_microbatches(batch, bounds, self.rebuild_history)
        real = [u.num_tokens for u in mbs]
        if self.static is not None:
            sizes = self.static.part_sizes(bounds)  # bounded set of (microbatch, padded size) keys
            mbs = [self.static.get(k, s, u).refresh(u, pad=self.neutral_padding)
                   for k, (s, u) in enumerate(zip(sizes, mbs))]
        elif self.cfg.exact:  # a small microbatch is padded once, so that no matmul pads its call
            mbs = [pad_tokens(u, self.pad_rows) for u in mbs]
        if self.tracker is not None:
            self.tracker.reset()
        ctxs, futures = [], []
        self.gather_wait_ms = 0.0
        measure = self.planner.start_step()
        for k, u in enumerate(mbs):
            bufs = self.bufs[k]
            u.hash_ids = hash_step(u.input_ids, u.qsl, u.history, self.layout, self.token_map, self.pad_id,
                                   dead=u.dead, out=bufs.hash_ids[: u.num_tokens])  # from its own inputs alone
            staging = bufs.staging[:, : u.num_tokens]  # [L, T_k, C, hd] this microbatch's own rows
            if self.tracker is not None:
                self.tracker.touch("staging", staging, k)
                self.tracker.touch("hash_ids", u.hash_ids, k)
            ready = None
            if self.copy_stream is not None:  # the copy stream waits for this microbatch's hash ids
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            # on the worker, the gather overlaps another microbatch's compute and this one's layers before
            # its first Engram layer (the C gather and torch's operators release the GIL)
            if self.planner.gather_on_worker(len(mbs), real[k], measure):
                futures.append(self._gather_pool.submit(self._stage_rows, u.hash_ids, staging, real[k], ready))
            else:  # a short gather (a thread handoff would cost more than it hides), or a measuring step
                futures.append(Future())
                futures[-1].set_result(self._stage_rows(u.hash_ids, staging, real[k], ready, measure))
            keep = u.logits_indices if read is None else mine(read, bounds[k], bounds[k + 1])
            keep = None if score_rows or len(keep) == u.num_tokens else keep  # (every token with score_rows)
            ctxs.append(ForwardContext(u, self.kv, bufs, self._rows_fn(futures[-1], staging), self.tracker,
                                       keep=keep, capture_features=self.capture_features))
        try:
            with batch_invariant(self.cfg.exact):
                hidden = self.forward(batch, ctxs, futures)  # the sampled tokens' alone, unless score_rows
                scored = None
                if not score_rows:
                    logits = self.model.compute_logits(hidden[0] if len(hidden) == 1 else torch.cat(hidden))
                else:
                    merged = torch.cat([h[:n] for h, n in zip(hidden, real)])
                    at = batch.logits_indices if read is None else torch.from_numpy(read).to(merged.device)
                    logits = self.model.compute_logits(merged[at])
                    q = batch.qsl_host
                    tok = np.concatenate([np.arange(q[r], q[r + 1]) for r in score_rows])
                    scored = self.model.compute_logits(merged[torch.from_numpy(tok).to(merged.device)])
        finally:
            for f in futures:
                f.cancel()
        # cuts inside a row
        straddling = int(np.isin(bounds[1:-1], batch.qsl_host, invert=True).sum()) if len(bounds) > 2 else 0
        out = StepOutput(logits, bounds, straddling, scored)
        if self.capture_features:  # every microbatch's real tokens, in token order
            out.features = torch.cat([c.features[:n] for c, n in zip(ctxs, real)])
        if record:
            out.staged = torch.cat([self._staged(f)[:, :n] for f, n in zip(futures, real)], dim=1)
            out.hash_ids = torch.cat([u.hash_ids[:n] for u, n in zip(mbs, real)])
        self.planner.record_step((time.perf_counter() - t_start) * 1e3, batch.num_tokens, len(bounds) > 2)
        return out

    def _decode(self, batch: StepBatch, bounds: list[int], record: bool, t_start: float) -> StepOutput:
        """`execute` of the decode inputs' batch, whole: the same hash ids, staged rows and graph replay, with the
        hash computed on the buffers' host arrays and nothing sliced or padded again."""
        d, r, bufs = self.decode_inputs, batch.num_rows, self.bufs[0]
        padded = d.padded  # as `pad_tokens(batch, self.pad_rows)`
        n = padded.num_tokens
        measure = self.planner.start_step()
        prep = self._decode_prep.get(r)
        if prep is None or prep[0] is not self.loaded.tables:  # the views of these buffers, made once per row count
            hash_ids, staging = bufs.hash_ids[:n], bufs.staging[:, :n]
            stager = self.loaded.tables.stager(hash_ids[:r], staging[:, :r]) if self.copy_stream is None else None
            prep = self._decode_prep[r] = (self.loaded.tables, hash_ids, staging, stager, (
                d.input_ids[:n], d.qsl[:r + 1], d.history[:r], d.dead[:n], self.layout, self.token_map, self.pad_id,
                hash_ids.numpy()))
        _, padded.hash_ids, staging, stager, hash_args = prep
        if self.loaded.tables.num_layers:  # (none: no hash ids, no rows to stage, as [T, 0, C] and [0, T, C, hd])
            hash_step_host(*hash_args)
            t0 = time.perf_counter()
            if stager is not None and stager():  # `_stage_rows`, without its per-step views
                if r < n:
                    staging[:, r:].zero_()
                if measure:
                    self.planner.record_gather((time.perf_counter() - t0) * 1e3, r)
            else:
                self._stage_rows(padded.hash_ids, staging, r, None, measure)
        self.gather_wait_ms = 0.0
        ctx = ForwardContext(padded, self.kv, bufs, staging.__getitem__, max_seq_len=d.bound,
                             capture_features=self.capture_features)
        with batch_invariant(self.cfg.exact):
            logits = self.cpu_graphs.forward(ctx, d.planned, logits=r)
        out = StepOutput(logits, bounds, 0, features=None if ctx.features is None else ctx.features[:r])
        if record:
            out.staged, out.hash_ids = staging[:, :r].clone(), padded.hash_ids[:r].clone()
        self.planner.record_step((time.perf_counter() - t_start) * 1e3, r, False)
        return out

    def forward(self, batch: StepBatch, ctxs: list[ForwardContext], futures: list[Future]) -> list[torch.Tensor]:
        """Hidden states of every microbatch, [T_k, hidden] or of its tokens `keep`: graph replays (of every
        token, then picked), or the interleaved stages."""
        graphs = None if self.launches_collectives else self.cpu_graphs  # CUDA: eager (no CUDA graphs of V4.1)
        if graphs is not None and graphs.takes(batch, len(ctxs)):
            for f in futures:
                self._staged(f)  # staged rows are in place before a replay reads them
            hidden = [graphs.forward(c) for c in ctxs]  # replays in microbatch order
            return [h if c.keep is None else h[c.keep] for h, c in zip(hidden, ctxs)]
        return run_interleaved([self.model.stages(c) for c in ctxs])

    def _stage_rows(self, hash_ids: torch.Tensor, staging: torch.Tensor, real: int, ready=None,
                    measure: bool = False) -> torch.Tensor:
        """Gather the real tokens' rows; zero the padding rows (fresh every step). On CUDA the copies run
        on `copy_stream` after the event `ready` (the hash ids, and every earlier use of the buffer, are
        done) and the result is [staging, event]: `_staged` makes the compute stream wait on that event.
        With `measure` (run inline, see MicrobatchPlanner.MEASURE_EVERY) the gather's time feeds the planner."""
        t0 = time.perf_counter()
        if self.copy_stream is None:
            self.loaded.tables.gather(hash_ids[:real], staging[:, :real])
            if real < staging.shape[1]:
                staging[:, real:].zero_()
            out = staging
        else:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                self.loaded.tables.gather(hash_ids[:real], staging[:, :real])
                staging[:, real:].zero_()
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            out = [staging, done]
        if measure:
            self.planner.record_gather((time.perf_counter() - t0) * 1e3, real)
        return out

    def _rows_fn(self, future: Future, staging: torch.Tensor):
        def rows(i: int) -> torch.Tensor:
            t0 = time.perf_counter()
            self._staged(future)  # wait for this microbatch's gather (may be running on the worker)
            self.gather_wait_ms += (time.perf_counter() - t0) * 1e3  # the exposed gather time
            return staging[i]  # [T_k, C, hd]
        return rows

    def _staged(self, future: Future) -> torch.Tensor:
        """The staging buffer once its gather is done; on CUDA the compute stream waits for the copy event."""
        out = future.result()
        if isinstance(out, list):  # CUDA: [staging, copy event]; wait once (never inside a graph capture)
            if out[1] is not None:
                torch.cuda.current_stream(self.device).wait_event(out[1])
                out[1] = None
            out = out[0]
        return out

    def close(self) -> None:
        self._gather_pool.shutdown(wait=True, cancel_futures=True)
