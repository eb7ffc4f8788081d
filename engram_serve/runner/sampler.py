"""Batch sampling with per-request, batch-independent randomness and no device sync.

A row's token depends only on its own logits, temperature, top-k, top-p, seed and counter (the
request's output position): never on which other rows share the batch, their order, or how the
step was cut into microbatches. That holds because the Gumbel noise of row r at vocabulary index
v is a pure hash of (seeds[r], counters[r], v) computed with integer tensor ops, not a draw from a
shared generator whose stream would be consumed by the other rows.

Everything is vectorised over rows, with no `.item()`, no Python branch on tensor data and no
loop over rows, so the whole call can be queued on a device (or captured) without a sync.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Temperatures below this are greedy: dividing the logits by them could overflow float32.
GREEDY_BELOW = 1e-5


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant c, without int64 overflow:
    the constant is split in 16-bit halves, so every intermediate stays below 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from the 64-bit seed and counter (64 key bits: no birthday
    collisions between requests at realistic batch sizes). [R] int64 each, in [0, 2^32)."""
    # (>> is arithmetic on int64; & keeps the two's-complement bits, so negative seeds are fine)
    words = [seeds & _M32, (seeds >> 32) & _M32, counters & _M32, (counters >> 32) & _M32]
    k1 = torch.full_like(seeds, 0x9E3779B9)
    k2 = torch.full_like(seeds, 0x7F4A7C15)
    for w in words:
        k1 = _fmix32(k1 ^ w)
        k2 = _fmix32((k2 + w * 0x2545) & _M32)  # a different absorption, so the two keys are independent
    return k1, k2


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 uniform in (0, 1), a pure function of (seed, counter, vocabulary index)."""
    k1, k2 = _row_keys(seeds.long(), counters.long())  # [R]
    idx = _mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B1)  # [V], spread the indices
    h = _fmix32(idx[None, :] ^ k1[:, None])  # [R, V]
    h = _fmix32((h + k2[:, None]) & _M32)
    # 23 random bits -> (m + 0.5) / 2^23: exact in float32 and strictly inside (0, 1)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def hash_gumbel(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32 standard Gumbel noise, batch-independent (see module docstring)."""
    return -torch.log(-torch.log(hash_uniform(seeds, counters, vocab)))


class Sampler:
    """`sample` turns a step's logits into one token per row.

    Greedy rows (temperature < GREEDY_BELOW, i.e. 0) take the argmax (first index among ties).
    Other rows: logits / temperature, then the top-k mask (k = 0: off), then the top-p mask
    (keep the most probable tokens, in order, while the probability mass before them is < p;
    the most probable token is always kept), then Gumbel-max: argmax(masked + noise), which draws
    from the softmax of the masked, scaled logits.
    """

    def noise(self, seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
        """[R, V] float32 Gumbel noise; a subclass may replace it (the tests do, as a negative control)."""
        return hash_gumbel(seeds, counters, vocab)

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, counters: torch.Tensor, *, filters: bool = True, random: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [R, V] float32; temperature [R] float; top_k [R] int64 (0 = off); top_p [R] float in
        (0, 1]; seeds [R] int64; counters [R] int64 (the request's output position).

        Returns (tokens [R] int64, finite [R] bool). `finite[r]` is False when row r's logits hold a
        NaN or an infinity: its token is then meaningless and must not be used. `filters=False`
        skips the top-k/top-p sort; pass it only when no row uses either (known on the host);
        `random=False` skips the noise; pass it only when every row is greedy."""
        rows, vocab = logits.shape
        for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
                        ("counters", counters)):
            if t.shape != (rows,):
                raise ValueError(f"Sampler.sample: {name} has shape {tuple(t.shape)}, expected ({rows},)")
        finite = torch.isfinite(logits).all(dim=1)  # [R] bool
        x = torch.where(finite[:, None], logits.float(), 0.0)  # [R, V]; bad rows neutralised
        greedy = temperature < GREEDY_BELOW  # [R] bool
        best = x.argmax(dim=1)  # [R] int64
        scaled = x / torch.where(greedy, 1.0, temperature.float())[:, None]  # [R, V]
        if not random:
            return best, finite
        if filters:
            scaled = self._top_k_top_p(scaled, top_k, top_p)
        drawn = (scaled + self.noise(seeds, counters, vocab)).argmax(dim=1)  # [R] int64
        return torch.where(greedy, best, drawn), finite

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Masked tokens get -inf. Works in descending order (stable: ties by lower index)."""
        vocab = scaled.shape[1]
        ordered, order = scaled.sort(dim=1, descending=True, stable=True)  # [R, V]
        rank = torch.arange(vocab, device=scaled.device)  # [V]
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [R]
        keep = rank[None, :] < k[:, None]  # [R, V] in sorted order
        probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=1)  # [R, V]
        mass_before = probs.cumsum(dim=1) - probs
        p = top_p.to(probs.dtype)[:, None]
        keep &= (mass_before < p) | (p >= 1)  # p = 1 is off even where rounding takes the mass past 1
        keep_vocab = torch.empty_like(keep).scatter_(1, order, keep)  # back to vocabulary order
        return scaled.masked_fill(~keep_vocab, float("-inf"))
