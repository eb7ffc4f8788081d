"""The accept rule of a verify step, vectorised over every row of the step (numpy, no loop per token).

A verify row of request g holds its last committed token and k_g drafts, at positions p .. p + k_g; the step
samples a token at each of them exactly as plain decoding samples there (the sampler's own draw, with the
request's outputs up to that position). Draft j + 1 is accepted while every token before it was, and it
equals the token sampled at row position j with finite logits. So request g keeps a_g drafts and emits the
tokens sampled at positions p .. p + a_g: the token at the first difference, or a bonus token after a full
accept. The emitted tokens are the ones plain decoding gives, because every one of them was computed from
committed tokens only.
"""
from __future__ import annotations

import numpy as np


def accepted_drafts(tokens: np.ndarray, finite: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """a [G] int64: the accepted drafts of each group. `tokens`, `finite` [sum(k + 1)]: the sampled token and
    the finite flag of each virtual row, groups contiguous (group g: its k_g + 1 row positions in order);
    `drafts` [sum(k)] the groups' drafts in the same order; `num_drafts` [G] k_g >= 0."""
    k = np.asarray(num_drafts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(k + 1)[:-1]])  # [G] first virtual row of each group
    rows = len(tokens)
    within = np.arange(rows) - np.repeat(starts, k + 1)  # [V] row position inside its group
    nxt = np.full(rows, -1, dtype=np.int64)
    nxt[within < np.repeat(k, k + 1)] = drafts  # the draft that follows each row (none after the last)
    match = np.asarray(finite, bool) & (np.asarray(tokens, np.int64) == nxt)
    first_miss = np.minimum.reduceat(np.where(match, rows, np.arange(rows)), starts)  # the last row never matches
    return first_miss - starts


def accepted_drafts_loop(tokens, finite, drafts, num_drafts) -> list[int]:
    """The same rule as a plain loop (the reference of the property test)."""
    out, t, d = [], 0, 0
    for k in num_drafts:
        a = 0
        while a < k and finite[t + a] and tokens[t + a] == drafts[d + a]:
            a += 1
        out.append(a)
        t, d = t + k + 1, d + k
    return out
