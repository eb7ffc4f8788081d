import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.config import EngramConfig
from engram_serve.engram.hashing import DEAD, hash_step, reference_hash
from engram_serve.engram.layout import build_layout, is_prime

GOLDEN = EngramConfig(engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682],
                      engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=32,
                      engram_vocab_size=16000000, engram_compressed_vocab_size=129280, engram_pad_token_id=2)


def test_golden_deepseek_v41_layout():
    layout = build_layout(GOLDEN)
    assert layout.table_rows == [384006168, 384016682]
    assert layout.moduli[0, :3].tolist() == [16000057, 16000079, 16000081]
    assert len(set(layout.moduli.flatten().tolist())) == layout.moduli.numel()
    assert all(is_prime(m) for m in layout.moduli.flatten().tolist())


def test_layout_row_mismatch_names_field_layer_and_values():
    import dataclasses

    import pytest

    from engram_serve.errors import CheckpointMismatch
    bad = dataclasses.replace(GOLDEN, engram_num_embeddings=(384006168, 5))
    with pytest.raises(CheckpointMismatch, match=r"engram_num_embeddings.*layer 14.*5.*384016682"):
        build_layout(bad)


def history_of(seq: list[int], dead: list[bool], start: int, d: int) -> list[int]:
    """Column j = position start-1-j; -1 before position 0; DEAD for dead tokens."""
    out = []
    for j in range(d):
        q = start - 1 - j
        out.append(-1 if q < 0 else (DEAD if dead[q] else seq[q]))
    return out


@st.composite
def layouts(draw):
    n = draw(st.integers(2, 5))
    heads = draw(st.integers(1, 8))
    layer_ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True))
    vocab = draw(st.integers(2, 5000))
    cvocab = draw(st.integers(3, 60))
    cfg = EngramConfig(layer_ids, [0] * len(layer_ids), n, heads, 4, vocab, cvocab,
                       draw(st.integers(0, cvocab - 1)))
    layout = build_layout(cfg, check_rows=False)
    raw_vocab = draw(st.integers(cvocab, 2 * cvocab))
    tmap = draw(st.lists(st.integers(0, cvocab - 1), min_size=raw_vocab, max_size=raw_vocab))
    return layout, torch.tensor(tmap)


@st.composite
def requests(draw, raw_vocab):
    length = draw(st.integers(1, 40))
    seq = draw(st.lists(st.integers(0, raw_vocab - 1), min_size=length, max_size=length))
    dead = draw(st.lists(st.booleans().filter(lambda _: True) | st.just(False), min_size=length, max_size=length))
    start = draw(st.integers(0, length - 1))
    end = draw(st.integers(start + 1, length))
    return seq, dead, start, end


@given(data=st.data())
def test_production_hash_equals_reference(data):
    layout, tmap = data.draw(layouts())
    reqs = data.draw(st.lists(requests(len(tmap)), min_size=1, max_size=5))
    cfg = layout.config
    ids, dead, qsl, hist, want = [], [], [0], [], []
    for seq, dmask, start, end in reqs:
        ids += seq[start:end]
        dead += dmask[start:end]
        qsl.append(qsl[-1] + end - start)
        hist.append(history_of(seq, dmask, start, cfg.history_len))
        want += reference_hash(seq, dmask, layout, tmap.tolist(), cfg.engram_pad_token_id)[start:end]
    got = hash_step(torch.tensor(ids), torch.tensor(qsl), torch.tensor(hist).view(len(reqs), -1), layout,
                    tmap, cfg.engram_pad_token_id, dead=torch.tensor(dead))
    assert got.shape == (len(ids), cfg.num_layers, cfg.num_columns)
    assert got.tolist() == want


def test_dead_token_blocks_every_ngram_reaching_it():
    layout, tmap = build_layout(GOLDEN, check_rows=False), torch.arange(100)
    seq, dead = [5, 6, 7, 8, 9], [False, False, True, False, False]
    ref = reference_hash(seq, dead, layout, tmap.tolist(), 2)
    clean = reference_hash(seq, [False] * 5, layout, tmap.tolist(), 2)
    assert ref[3] != clean[3] and ref[1] == clean[1]
    got = hash_step(torch.tensor(seq), torch.tensor([0, 5]), torch.full((1, 3), -1), layout, tmap, 2,
                    dead=torch.tensor(dead))
    assert got.tolist() == ref


@pytest.mark.parametrize("kernels_spec", ["all", "-hash"])
def test_hash_step_writes_into_a_persistent_buffer(kernels_spec):
    with kernels.override(kernels_spec):
        hash_step_writes_into_a_persistent_buffer()


def hash_step_writes_into_a_persistent_buffer():
    layout, tmap = build_layout(GOLDEN, check_rows=False), torch.arange(100)
    ids, qsl, hist = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 4]), torch.full((1, 3), -1)
    want = hash_step(ids, qsl, hist, layout, tmap, 2)
    buf = torch.full((6, 2, 24), 7, dtype=torch.int64)
    got = hash_step(ids, qsl, hist, layout, tmap, 2, out=buf[:4])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:4], want) and (buf[4:] == 7).all()
    with pytest.raises(ValueError, match="out is"):
        hash_step(ids, qsl, hist, layout, tmap, 2, out=buf)
