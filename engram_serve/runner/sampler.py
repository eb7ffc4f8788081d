"""Batch sampling with per-request, batch-independent randomness, proportional to what is asked.

A row's token depends only on its own logits, its own sampling parameters, seed and counter (the
request's output position): never on which other rows share the batch, their order, or how the
step was cut into microbatches. That holds because the Gumbel noise of row r at vocabulary index
v is a pure hash of (seeds[r], counters[r], v) computed with integer tensor ops, not a draw from a
shared generator whose stream would be consumed by the other rows.

What a row costs depends on what it asks for (the row groups are known on the host, from the
requests' parameters, so choosing a path never reads tensor data):

- greedy rows (temperature 0): one argmax; no noise is drawn for them;
- sampling rows without top-k / top-p / min-p: Gumbel noise over the vocabulary, one argmax;
- sampling rows with top-k / top-p / min-p: a bounded candidate set (`topk` of C <= 4096 tokens,
  C = max(64, the largest top-k + 1)); noise only at the candidates. When the candidates cannot
  prove the kept set (rare: a flat distribution where top-p keeps more than C tokens), that row
  falls back to the exact full-vocabulary sort. Deciding the fallback reads one bool per filtered
  row on the host: no cost on CPU, one sync on CUDA in steps that have top-p rows.
- logprobs, penalties, logit_bias, min_tokens: work only for the rows that use them.

The distribution, for a sampling row (identical to the full-sort reference `reference_keep`):
    scaled = logits / temperature                       (after the row's logit processors)
    min-p:  keep v iff scaled[v] >= max(scaled) + log(min_p)
    order the tokens by (scaled descending, index ascending)
    top-k:  keep the first k of that order (k = 0: off)
    top-p:  probs = softmax of scaled over the tokens kept so far; keep a token while the mass
            of the kept tokens before it is < top_p (the first is always kept; top_p = 1: off)
    token = argmax over kept v of (scaled[v] + gumbel(seed, counter, v)), lowest index on a tie
which draws from the softmax of `scaled` restricted to the kept tokens.

Logit processors (per row, in this order, before temperature): repetition penalty (a token seen in
the prompt or output: logit / r if positive, logit * r if not), frequency and presence penalties
(logit -= f * count_in_output + p * [count > 0]), logit_bias (added), and the min_tokens ban (EOS
and stop_token_ids at -inf until min_tokens outputs exist). Greedy rows take the argmax of the
processed logits.

Logprobs are the log-softmax of the logits handed to `sample` (the model's logits, before the
row's processors, temperature and filters: vLLM's "raw" logprobs), from the same tensor, in the
same call, with no extra device sync.

Everything is vectorised over rows, with no `.item()` and no loop over rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.ops import choose

_M32 = 0xFFFFFFFF
# Temperatures below this are greedy: dividing the logits by them could overflow float32.
GREEDY_BELOW = 1e-5
MIN_CANDIDATES = 64  # candidate tokens per filtered row, at least
MAX_CANDIDATES = 4096  # a top-k above this uses the full sort


def _i32(c: int) -> int:
    """A 32-bit constant as the signed int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int32 tensors holding uint32 bits (multiplication and
    addition wrap mod 2^32; `>>` is arithmetic, so each shift is masked to be logical)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _i32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _i32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def _fmix32_64(h: torch.Tensor) -> torch.Tensor:
    """The same finaliser on int64 tensors in [0, 2^32) (used for the per-row keys)."""
    def mul(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32
    h = h ^ (h >> 16)
    h = mul(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from the 64-bit seed and counter (64 key bits: no birthday
    collisions between requests at realistic batch sizes). [R] int32 each (uint32 bits)."""
    # (>> is arithmetic on int64; & keeps the two's-complement bits, so negative seeds are fine)
    words = [seeds & _M32, (seeds >> 32) & _M32, counters & _M32, (counters >> 32) & _M32]
    k1 = torch.full_like(seeds, 0x9E3779B9)
    k2 = torch.full_like(seeds, 0x7F4A7C15)
    for w in words:
        k1 = _fmix32_64(k1 ^ w)
        k2 = _fmix32_64((k2 + w * 0x2545) & _M32)  # a different absorption, so the two keys are independent
    to32 = lambda k: torch.where(k >= 1 << 31, k - (1 << 32), k).to(torch.int32)  # noqa: E731
    return to32(k1), to32(k2)


def hash_uniform_at(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, N] float32 uniform in (0, 1) at vocabulary indices `index` [R, N] (or [N] shared by the
    rows): a pure function of (seed, counter, vocabulary index)."""
    k1, k2 = _row_keys(seeds.long(), counters.long())  # [R] int32
    idx = index.to(torch.int32) * _i32(0x9E3779B1)  # spread the indices
    if idx.ndim == 1:
        idx = idx[None, :]
    h = _fmix32(idx ^ k1[:, None])  # [R, N]
    h = _fmix32(h + k2[:, None])
    # 23 random bits -> (m + 0.5) / 2^23: exact in float32 and strictly inside (0, 1)
    return (((h >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 uniform in (0, 1), a pure function of (seed, counter, vocabulary index)."""
    return hash_uniform_at(seeds, counters, torch.arange(vocab, device=seeds.device))


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def hash_gumbel(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 standard Gumbel noise, batch-independent (see module docstring)."""
    return gumbel(hash_uniform(seeds, counters, vocab))


# ---- the step's sampling inputs -------------------------------------------------------------------

@dataclass
class Penalties:
    """Rows with a repetition, frequency or presence penalty. `tokens[i, :total[i]]` are row i's
    tokens (prompt first, `prompt_len[i]` of them, then its outputs); later columns are ignored."""

    rows: torch.Tensor  # [P] int64 rows of the batch
    repetition: torch.Tensor  # [P] float32 (1 = off)
    frequency: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    tokens: torch.Tensor  # [P, L] integer token ids
    prompt_len: torch.Tensor  # [P] int64
    total: torch.Tensor  # [P] int64


@dataclass
class SamplingBatch:
    """Per-row parameters (device tensors [R]) and the row groups (index tensors, built from host
    data: no path choice reads the device). Invariants: `greedy` and `random` partition the rows;
    `filtered` is the subset of `random` with top-k, top-p or min-p (as positions inside `random`);
    `top_k` is 0 or in [1, vocab]."""

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    counters: torch.Tensor  # [R] int64
    greedy: torch.Tensor  # [G] int64 rows
    random: torch.Tensor  # [S] int64 rows
    filtered: torch.Tensor  # [F] int64 positions inside `random`
    plain: torch.Tensor  # [S - F] int64 positions inside `random`
    max_top_k: int = 0  # the largest top_k among filtered rows that use one (host)
    any_min_p: bool = False
    any_full_norm: bool = False  # some filtered row has top-p without a top-k inside the candidates
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows [B], tokens [B], values [B]
    ban: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [M], tokens [M]: -inf (min_tokens)
    penalties: Penalties | None = None
    processed: torch.Tensor | None = None  # [P'] rows touched by bias / ban / penalties
    logprob_rows: torch.Tensor | None = None  # [Q] rows that want logprobs
    num_logprobs: int = 0  # top logprobs per logprob row (the largest asked)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(cls, vocab: int, temperature, top_k, top_p, seeds, counters, min_p=None, *, device="cpu",
              bias=None, ban=None, penalties: Penalties | None = None, logprobs=None) -> "SamplingBatch":
        """From host values (sequences or numpy arrays [R]); `logprobs[r]` is None (off) or the
        number of top logprobs row r wants. `bias` (rows, tokens, values) and `ban` (rows, tokens)
        are host arrays. Every tensor is created with one copy to `device`."""
        t = np.asarray(temperature, dtype=np.float32)
        rows = len(t)
        k = np.minimum(np.asarray(top_k, dtype=np.int64), vocab)
        p = np.asarray(top_p, dtype=np.float32)
        mp = np.zeros(rows, np.float32) if min_p is None else np.asarray(min_p, dtype=np.float32)
        greedy = t < GREEDY_BELOW
        random = np.flatnonzero(~greedy)
        filt = (k[random] > 0) & (k[random] < vocab) | (p[random] < 1) | (mp[random] > 0)
        dev = torch.device(device)

        def ix(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=dev)

        processed = set()
        b = m = None
        if bias is not None and len(bias[0]):
            b = (ix(bias[0]), ix(bias[1]), torch.as_tensor(np.asarray(bias[2], np.float32), device=dev))
            processed.update(np.asarray(bias[0]).tolist())
        if ban is not None and len(ban[0]):
            m = (ix(ban[0]), ix(ban[1]))
            processed.update(np.asarray(ban[0]).tolist())
        if penalties is not None:
            processed.update(penalties.rows.tolist())
        lp_rows = [r for r, n in enumerate(logprobs or ()) if n is not None]
        kf = k[random][filt]
        kf = kf[(kf > 0) & (kf < vocab)]
        cands = candidates(vocab, int(kf.max()) if len(kf) else 0)
        kr, pr = k[random][filt], p[random][filt]
        any_full = bool((((kr == 0) | (kr >= cands)) & (pr < 1)).any())
        return cls(
            temperature=torch.as_tensor(np.where(greedy, 1.0, t).astype(np.float32), device=dev),
            top_k=torch.as_tensor(k, device=dev), top_p=torch.as_tensor(p, device=dev),
            min_p=torch.as_tensor(mp, device=dev),
            seeds=torch.as_tensor(np.asarray(seeds, dtype=np.int64), device=dev),
            counters=torch.as_tensor(np.asarray(counters, dtype=np.int64), device=dev),
            greedy=ix(np.flatnonzero(greedy)), random=ix(random), filtered=ix(np.flatnonzero(filt)),
            plain=ix(np.flatnonzero(~filt)), max_top_k=int(kf.max()) if len(kf) else 0,
            any_min_p=bool((mp[random] > 0).any()), any_full_norm=any_full, bias=b, ban=m, penalties=penalties,
            processed=ix(sorted(processed)) if processed else None,
            logprob_rows=ix(lp_rows) if lp_rows else None,
            num_logprobs=max((logprobs[r] for r in lp_rows), default=0))


@dataclass
class SamplerOutput:
    """tokens [R] int64; finite [R] bool (False: the row's logits hold a NaN or an infinity, its
    token is meaningless); for the logprob rows [Q]: the sampled token's logprob [Q] and the top
    `num_logprobs` (ids [Q, n] int64, logprobs [Q, n] float32, most probable first)."""

    tokens: torch.Tensor
    finite: torch.Tensor
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def candidates(vocab: int, max_top_k: int) -> int:
    """How many candidate tokens filtered rows take: max(64, the largest top-k + 1), at most V."""
    return min(vocab, max(MIN_CANDIDATES, max_top_k + 1))


def _rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows], without a copy when `rows` holds every row. Row index tensors are sorted and
    unique (SamplingBatch.build), so "as many indices as rows" means every row, in order: a fact
    known from the shapes alone, with no device read."""
    return x if rows.shape[0] == x.shape[0] else x.index_select(0, rows)


class Sampler:
    """`sample` turns a step's logits into one token per row (see the module docstring)."""

    def noise_at(self, seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Gumbel noise at `index` ([R, N] or [N]); a subclass may replace it (negative controls)."""
        return gumbel(hash_uniform_at(seeds, counters, index))

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """`sample` for rows that are all greedy with nothing to process and no logprobs: one argmax per row
        (the same tokens and finite flags as `sample` gives them), without a SamplingBatch."""
        return SamplerOutput(*choose(logits).argmax_finite(logits))

    def sample(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        """logits [R, V] float32 -> SamplerOutput. Row r uses only row r of every input."""
        rows, vocab = logits.shape
        if b.num_rows != rows:
            raise ValueError(f"Sampler.sample: {b.num_rows} rows of parameters for {rows} rows of logits")
        ops = choose(logits)  # the C argmax on the CPU (model/ops.py)
        finite = ops.argmax_finite(logits)[1]  # [R] bool: every logit of the row finite (one C pass on the CPU)
        out = SamplerOutput(torch.empty(rows, dtype=torch.int64, device=logits.device), finite)
        work = logits
        if b.processed is not None:
            work = logits.index_copy(0, b.processed, self._process(logits, b))  # [R, V]
        if b.greedy.shape[0]:
            g = b.greedy
            if g.shape[0] == rows:
                out.tokens = ops.argmax_rows(work)
            else:
                out.tokens.index_copy_(0, g, ops.argmax_rows(work.index_select(0, g)))
        if b.random.shape[0]:
            out.tokens.index_copy_(0, b.random, self._draw(work, b))
        if b.logprob_rows is not None:
            self._logprobs(logits, b, out)
        return out

    # ---- logit processors -------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """[P', V]: the processed rows' logits after penalties, bias and the min_tokens ban."""
        rows = b.processed
        y = logits.index_select(0, rows)  # [P', V] a copy
        where = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
        where[rows] = torch.arange(rows.shape[0], device=logits.device)  # batch row -> row of y
        if b.penalties is not None:
            pen = b.penalties
            at = where[pen.rows]  # [P]
            prompt_seen, counts = _token_counts(pen, logits.shape[1])  # [P, V] bool, [P, V] float32
            z = y.index_select(0, at)
            r = pen.repetition[:, None]
            seen = prompt_seen | (counts > 0)
            z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
            z = z - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0).float()
            y.index_copy_(0, at, z)
        if b.bias is not None:
            r, t, v = b.bias
            y.index_put_((where[r], t), v, accumulate=True)
        if b.ban is not None:
            r, t = b.ban
            y.index_put_((where[r], t), torch.tensor(float("-inf"), device=y.device))
        return y

    # ---- sampling rows ----------------------------------------------------------------------
    def _draw(self, work: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Tokens [S] of the sampling rows."""
        s_rows = b.random
        z = _rows(work, s_rows)  # [S, V]
        temp, seeds, counters = (x.index_select(0, s_rows) for x in (b.temperature, b.seeds, b.counters))
        tokens = torch.empty(s_rows.shape[0], dtype=torch.int64, device=work.device)
        vocab = work.shape[1]
        if b.plain.shape[0]:
            pl = b.plain
            zp = _rows(z, pl)
            scaled = zp / temp.index_select(0, pl)[:, None]  # [Sp, V]
            noise = self.noise_at(seeds.index_select(0, pl), counters.index_select(0, pl),
                                  torch.arange(vocab, device=work.device))
            perturbed = scaled + noise  # [Sp, V]
            tokens.index_copy_(0, pl, choose(perturbed).argmax_rows(perturbed))
        if b.filtered.shape[0]:
            f = b.filtered
            fr = s_rows.index_select(0, f)  # batch rows
            tokens.index_copy_(0, f, self._draw_filtered(
                _rows(z, f), temp.index_select(0, f), b.top_k.index_select(0, fr), b.top_p.index_select(0, fr),
                b.min_p.index_select(0, fr), seeds.index_select(0, f), counters.index_select(0, f),
                b.max_top_k, b.any_min_p, b.any_full_norm))
        return tokens

    def _draw_filtered(self, z, temp, k, p, min_p, seeds, counters, max_top_k: int, any_min_p: bool,
                       any_full_norm: bool) -> torch.Tensor:
        """Tokens [F] of rows with top-k / top-p / min-p, from a bounded candidate set; rows the
        candidates cannot decide exactly take the full sort (`_draw_full`)."""
        n, vocab = z.shape
        dev = z.device
        c = candidates(vocab, max_top_k)
        if c > MAX_CANDIDATES:
            return self._draw_full(z, temp, k, p, min_p, seeds, counters)
        vals, idx = z.topk(c, dim=1)  # [F, C] raw, descending (ties in any order)
        scaled = vals / temp[:, None]  # [F, C], bit-identical to (z / temp) at these tokens
        # candidates in (scaled descending, index ascending) order, as the reference orders them
        o = idx.argsort(dim=1)
        idx, scaled = idx.gather(1, o), scaled.gather(1, o)
        o = scaled.argsort(dim=1, descending=True, stable=True)
        idx, scaled = idx.gather(1, o), scaled.gather(1, o)
        # a candidate is "safe" if it beats every non-candidate strictly: then its rank is exact
        bound = vals[:, -1] / temp  # [F] no non-candidate scales above this
        rank = torch.arange(c, device=dev)
        safe_n = (scaled > bound[:, None]).sum(dim=1)  # [F] the first non-safe position (< C)
        kk = torch.where(k > 0, k, vocab)
        keep = rank[None, :] < kk[:, None]  # [F, C]
        thr = None
        if any_min_p:
            thr = scaled[:, 0] + torch.log(min_p)  # [F]; min_p = 0 -> -inf: off
            keep &= scaled >= thr[:, None]
        # the softmax over the kept-so-far set: from the candidates when top-k bounds it inside
        # them, else over the full row (min-p masked)
        e = torch.exp(scaled - scaled[:, :1]) * keep  # [F, C]
        norm = e.sum(dim=1)
        full = (kk >= c) & (p < 1)  # [F] the kept set may extend past the candidates
        if any_full_norm:  # known on the host
            # sum over the row of exp(scaled - max), min-p masked: one buffer, updated in place
            y = z - vals[:, :1]  # [F, V] <= 0
            y.div_(temp[:, None])
            if thr is not None:
                y.masked_fill_(y < (thr - scaled[:, 0])[:, None], float("-inf"))
            norm = torch.where(full, y.exp_().sum(dim=1), norm)
        probs = e / norm[:, None]
        before = probs.cumsum(dim=1) - probs
        keep &= (before < p[:, None]) | (p[:, None] >= 1)
        # exact iff the first non-safe candidate is not kept (the kept set is a prefix)
        decided = ~keep.gather(1, safe_n[:, None]).squeeze(1)  # [F]
        score = torch.where(keep, scaled + self.noise_at(seeds, counters, idx), float("-inf"))  # [F, C]
        best = score.max(dim=1, keepdim=True).values
        token = torch.where(score == best, idx, vocab).min(dim=1).values  # lowest index on a tie
        undecided = (~decided).nonzero().flatten()  # the one host read: fallback rows (usually none)
        if undecided.shape[0]:
            u = undecided
            token.index_copy_(0, u, self._draw_full(z.index_select(0, u), temp[u], k[u], p[u], min_p[u], seeds[u],
                                                    counters[u]))
        return token

    def _draw_full(self, z, temp, k, p, min_p, seeds, counters) -> torch.Tensor:
        """The exact full-vocabulary path: one stable sort per row."""
        vocab = z.shape[1]
        scaled = z / temp[:, None]  # [F, V]
        keep = full_sort_keep(scaled, k, p, min_p)
        noise = self.noise_at(seeds, counters, torch.arange(vocab, device=z.device))
        perturbed = scaled.masked_fill(~keep, float("-inf")) + noise  # [F, V]
        return choose(perturbed).argmax_rows(perturbed)

    # ---- logprobs -----------------------------------------------------------------------------
    @staticmethod
    def _logprobs(logits: torch.Tensor, b: SamplingBatch, out: SamplerOutput) -> None:
        q = b.logprob_rows
        x = logits.index_select(0, q)  # [Q, V]
        lse = torch.logsumexp(x, dim=1)  # [Q]
        out.logprob = x.gather(1, out.tokens.index_select(0, q)[:, None]).squeeze(1) - lse
        if b.num_logprobs:
            vals, ids = x.topk(b.num_logprobs, dim=1)  # [Q, n]
            out.top_ids, out.top_logprobs = ids, vals - lse[:, None]


def full_sort_keep(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the kept tokens of the module docstring's definition, by one stable sort."""
    vocab = scaled.shape[1]
    ordered, order = scaled.sort(dim=1, descending=True, stable=True)  # [R, V]
    rank = torch.arange(vocab, device=scaled.device)
    kk = torch.where(k > 0, k, vocab).clamp(max=vocab)
    keep = rank[None, :] < kk[:, None]
    keep &= ordered >= (ordered[:, :1] + torch.log(min_p)[:, None])
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=1)
    before = probs.cumsum(dim=1) - probs
    pp = p.to(probs.dtype)[:, None]
    keep &= (before < pp) | (pp >= 1)  # p = 1 is off even where rounding takes the mass past 1
    return torch.empty_like(keep).scatter_(1, order, keep)  # back to vocabulary order


def _token_counts(pen: Penalties, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_seen [P, V] bool, output counts [P, V] float32) from each row's own tokens."""
    tok = pen.tokens.long().clamp(0, vocab - 1)  # [P, L] (columns past `total` are masked below)
    pos = torch.arange(tok.shape[1], device=tok.device)[None, :]
    in_prompt = pos < pen.prompt_len[:, None]
    in_output = (pos >= pen.prompt_len[:, None]) & (pos < pen.total[:, None])
    zeros = torch.zeros(tok.shape[0], vocab, device=tok.device)
    seen = zeros.scatter_add(1, tok, in_prompt.float()) > 0
    counts = zeros.scatter_add(1, tok, in_output.float())
    return seen, counts


__all__ = ["Sampler", "SamplingBatch", "SamplerOutput", "Penalties", "hash_uniform", "hash_uniform_at",
           "hash_gumbel", "full_sort_keep", "GREEDY_BELOW"]
