"""Incremental detokenization with `tokenizers`' DecodeStream: the deltas of any token sequence
join to exactly `tokenizer.decode(ids)`, never end in half a character, and stop strings are cut
with their prefixes held back (property tests over random ids, including partial UTF-8 tokens)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_serve.engine.detokenizer import IncrementalDetokenizer
from engram_serve.model.loader import load_model


@pytest.fixture(scope="module")
def tok():
    return load_model().tokenizer


def test_decode_stream_is_used(tok):
    d = IncrementalDetokenizer(tok)
    assert type(d.stream).__name__ == "DecodeStream"


@given(ids=st.lists(st.integers(0, 4095), min_size=1, max_size=40))
def test_deltas_join_to_the_full_decode(tok, ids):
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert not any(x.endswith("\ufffd") for x in deltas[:-1] if x)  # a partial character waits


@given(ids=st.lists(st.integers(0, 4095), min_size=4, max_size=40), start=st.integers(0, 30),
       length=st.integers(1, 6))
def test_stop_strings_cut_the_text_and_prefixes_are_held_back(tok, ids, start, length):
    full = tok.decode(ids)
    stop = full[start:start + length]
    if not stop or "\ufffd" in stop:
        return
    d = IncrementalDetokenizer(tok, stop=[stop])
    seen = ""
    for t in ids:
        seen += d.add(t)
        if d.stopped:
            break
    seen += d.flush()
    # deltas are only ever appended, so nothing past the cut was emitted: the start of a possible
    # stop string was held back until it was known not to be one
    assert d.stopped and seen == full[:full.index(stop)]


def test_min_tokens_ignores_stop_strings_before_it(tok):
    ids = tok.encode("alpha beta gamma delta epsilon").ids
    early = IncrementalDetokenizer(tok, stop=["beta"])
    text = "".join(early.add(t) for t in ids if not early.stopped) + early.flush()
    assert early.stopped and text == "alpha "
    late = IncrementalDetokenizer(tok, stop=["beta", "delta"], min_tokens=6)  # "beta" ends at token 5
    text = "".join(late.add(t) for t in ids if not late.stopped) + late.flush()
    assert late.stopped and text == "alpha beta gamma "
