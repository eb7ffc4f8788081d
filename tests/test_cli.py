"""The `engram-serve` command line, run in-process: good `hash` calls equal the reference hash,
bad input ends with one line naming the option and value, `bench hash --json` gives rows."""
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from engram_serve.cli import DEFAULT_CONFIG, DEFAULT_TOKENIZER, main
from engram_serve.config import EngramConfig
from engram_serve.engram.hashing import reference_hash
from engram_serve.engram.layout import build_layout
from engram_serve.engram.token_map import build_token_map, load_tokenizer

# Case and accent variants collapse under the compressed map, so it is not the identity.
WORDS = ["<unk>", "<pad>", "the", "The", "THE", "cat", "Cat", "sat", "on", "mat", "café", "cafe", "a", "A"]


def write_model(folder, tokenizer_beside: bool = True, compressed_vocab: int | None = None, **overrides):
    """A config.json (and optionally a tokenizer.json beside it) whose tables match the hash layout."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tmap = build_token_map(tok)
    d = dict(engram_layer_ids=[1, 3], engram_num_embeddings=[0, 0], engram_max_ngram_size=3, engram_n_heads=2,
             engram_head_dim=4, engram_vocab_size=1000,
             engram_compressed_vocab_size=compressed_vocab or int(tmap.max()) + 1, engram_pad_token_id=1)
    d["engram_num_embeddings"] = build_layout(EngramConfig(**d), check_rows=False).table_rows
    d.update(overrides)
    (folder / "config.json").write_text(json.dumps(d))
    if tokenizer_beside:
        tok.save(str(folder / "tokenizer.json"))
    return folder / "config.json", tmap


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def expected(config_path, tmap, ids):
    cfg = EngramConfig.from_dict(json.loads(config_path.read_text()))
    layout = build_layout(cfg)
    return reference_hash(ids, [False] * len(ids), layout, tmap.tolist(), int(tmap[cfg.engram_pad_token_id]))


def test_hash_token_ids_equal_reference(tmp_path, capsys):
    config, tmap = write_model(tmp_path)
    assert not torch.equal(tmap, torch.arange(len(tmap)))  # the raw -> compressed map does something
    ids = [2, 3, 5, 6, 4, 10, 11, 13, 0]
    code, out, err = run(capsys, "hash", "--config", str(config), "--token-ids", ",".join(map(str, ids)))
    assert code == 0 and err == ""
    got = json.loads(out)["hash_ids"]
    assert got == expected(config, tmap, ids)
    assert (len(got), len(got[0]), len(got[0][0])) == (len(ids), 2, 2 * 2)


def test_hash_compressed_ids_use_identity_map(tmp_path, capsys):
    config, tmap = write_model(tmp_path)
    cids = [int(tmap[i]) for i in (2, 3, 5, 6, 4)]
    code, out, _ = run(capsys, "hash", "--config", str(config), "--compressed-ids", ",".join(map(str, cids)))
    assert code == 0
    # the same sequence given as raw ids hashes identically
    assert json.loads(out)["hash_ids"] == expected(config, tmap, [2, 3, 5, 6, 4])


def test_hash_with_bundled_tokenizer(tmp_path, capsys):
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    tmap = build_token_map(tok)
    config, _ = write_model(tmp_path, tokenizer_beside=False, compressed_vocab=int(tmap.max()) + 1)
    ids = [1, 2, 3, 4, 4095, 17]
    code, out, _ = run(capsys, "hash", "--config", str(config), "--token-ids", ",".join(map(str, ids)))
    assert code == 0
    assert json.loads(out)["hash_ids"] == expected(config, tmap, ids)


@pytest.mark.skipif(not DEFAULT_CONFIG.is_file(), reason="bundled tiny config not present yet")
def test_hash_default_model(capsys):
    code, out, _ = run(capsys, "hash", "--token-ids", "1,2,3,4")
    assert code == 0
    tmap = build_token_map(load_tokenizer(DEFAULT_TOKENIZER))
    assert json.loads(out)["hash_ids"] == expected(DEFAULT_CONFIG, tmap, [1, 2, 3, 4])


def assert_one_line_error(code, out, err, *needles):
    assert code != 0
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("engram-serve: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


BAD_IDS = [  # (argv after --config, words the message must name)
    (["--token-ids", str(len(WORDS))], ["--token-ids", str(len(WORDS)), "vocabulary"]),
    (["--token-ids", "1,2,999999"], ["--token-ids", "999999"]),
    (["--compressed-ids", "9999"], ["--compressed-ids", "9999"]),
    (["--token-ids=-1,2"], ["--token-ids", "-1", "negative"]),
    (["--compressed-ids", "-3"], ["--compressed-ids", "-3", "negative"]),
    (["--token-ids", "1,x,3"], ["--token-ids", "'x'", "not an integer"]),
    (["--token-ids", "2.5"], ["--token-ids", "2.5"]),
    (["--token-ids", ""], ["--token-ids", "empty"]),
    (["--token-ids", "1,,2"], ["--token-ids", "1,,2"]),
    (["--token-ids", "1", "--compressed-ids", "2"], ["--token-ids", "--compressed-ids", "both"]),
    ([], ["--token-ids", "--compressed-ids", "neither"]),
    (["--token-ids"], ["--token-ids", "expected one argument"]),
]


@pytest.mark.parametrize("argv,needles", BAD_IDS, ids=[" ".join(a) or "no-ids" for a, _ in BAD_IDS])
def test_bad_ids_one_line_error(tmp_path, capsys, argv, needles):
    config, _ = write_model(tmp_path)
    assert_one_line_error(*run(capsys, "hash", "--config", str(config), *argv), *needles)


def test_bad_compressed_id_compares_with_compressed_vocab(tmp_path, capsys):
    config, tmap = write_model(tmp_path)
    vc = int(tmap.max()) + 1
    code, out, _ = run(capsys, "hash", "--config", str(config), "--compressed-ids", str(vc - 1))
    assert code == 0
    assert_one_line_error(*run(capsys, "hash", "--config", str(config), "--compressed-ids", str(vc)),
                          "--compressed-ids", str(vc), f"[0, {vc})")


def test_bad_config_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert_one_line_error(*run(capsys, "hash", "--config", str(missing), "--token-ids", "1"), "--config", "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(*run(capsys, "hash", "--config", str(broken), "--token-ids", "1"), "--config", "broken.json")
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    assert_one_line_error(*run(capsys, "hash", "--config", str(listy), "--token-ids", "1"), "--config", "list.json")


@pytest.mark.parametrize("override,needles", [
    ({"engram_n_heads": 0}, ["engram_n_heads", "0"]),
    ({"engram_n_heads": "2"}, ["--config"]),  # wrong type
    ({"engram_layer_ids": 7}, ["--config"]),  # not a list
    ({"engram_num_embeddings": [5, 6]}, ["engram_num_embeddings", "5"]),  # table size != layout
    ({"engram_bogus": 1}, ["engram_bogus"]),
    ({"engram_pad_token_id": 10**6}, ["engram_pad_token_id", "1000000"]),
])
def test_invalid_config_fields(tmp_path, capsys, override, needles):
    config, _ = write_model(tmp_path, **override)
    assert_one_line_error(*run(capsys, "hash", "--config", str(config), "--token-ids", "1"), "--config", *needles)


def test_tokenizer_mismatch_and_unreadable(tmp_path, capsys):
    config, tmap = write_model(tmp_path, compressed_vocab=5)  # the tokenizer yields 10 distinct keys
    assert_one_line_error(*run(capsys, "hash", "--config", str(config), "--token-ids", "1"),
                          "--tokenizer", "engram_compressed_vocab_size", "5", str(int(tmap.max()) + 1))
    assert_one_line_error(*run(capsys, "hash", "--config", str(config), "--tokenizer", str(tmp_path / "x.json"),
                               "--token-ids", "1"), "--tokenizer", "x.json")


def test_usage_errors_are_one_line(capsys):
    assert_one_line_error(*run(capsys), "COMMAND")
    assert_one_line_error(*run(capsys, "frobnicate"), "frobnicate")
    assert_one_line_error(*run(capsys, "bench"), "BENCH")
    assert_one_line_error(*run(capsys, "bench", "hash", "--sizes", "0"), "--sizes", "0")
    assert_one_line_error(*run(capsys, "bench", "hash", "--sizes", "8,a"), "--sizes", "'a'")
    # values the benchmarks check themselves
    assert_one_line_error(*run(capsys, "bench", "threads", "--workloads", "decode-0"), "--workloads", "'decode-0'")
    assert_one_line_error(*run(capsys, "bench", "peers", "--suite", "frob"), "--suite", "frob")
    assert_one_line_error(*run(capsys, "bench", "tables", "--size-gib", "1e9"), "--size-gib", "1000000000.0")
    assert_one_line_error(*run(capsys, "bench", "peers", "--shapes", "huge"), "--shapes", "huge")
    assert_one_line_error(*run(capsys, "bench", "spec", "--temperatures", "0,x"), "--temperatures", "'x'")
    assert_one_line_error(*run(capsys, "bench", "sampler", "--shapes", "steep"), "--shapes", "steep")


def test_bench_hash_json_rows(capsys):
    code, out, err = run(capsys, "bench", "hash", "--json", "--sizes", "1,64", "--ref-cap", "16", "--budget-s", "0.01")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["tokens"] for r in rows] == [1, 64]
    keys = {"tokens", "layers", "n", "heads", "threads", "prod_median_ms", "prod_p90_ms", "prod_tok_s",
            "prod_peak_mib", "ref_tokens", "ref_median_ms", "ref_p90_ms", "ref_tok_s", "ref_peak_mib",
            "speedup", "mem_method", "note"}
    for r in rows:
        assert keys <= r.keys()
        assert (r["layers"], r["n"], r["heads"]) == (2, 4, 8)
        assert 0 < r["prod_median_ms"] <= r["prod_p90_ms"] and r["prod_tok_s"] > 0
        assert r["prod_peak_mib"] >= 0 and r["ref_peak_mib"] >= 0
        assert r["speedup"] == pytest.approx(r["prod_tok_s"] / r["ref_tok_s"])
    assert (rows[0]["ref_tokens"], rows[0]["note"]) == (1, "")
    assert rows[1]["ref_tokens"] == 16 and "first 16 tokens" in rows[1]["note"]  # capped reference says so


def test_bench_tables_json_rows(capsys, tmp_path):
    """`bench tables` end to end on a small sparse file: every setting warm and cold, the decode-step
    share (the engine's step, gather overlapped and inline), both memcpy rates, and the file deleted afterwards."""
    code, out, err = run(capsys, "bench", "tables", "--json", "--size-gib", "0.25", "--stream-tokens", "1024",
                         "--requests", "64", "--rounds", "1", "--cold-steps", "1", "--share-steps", "2",
                         "--dir", str(tmp_path))
    assert code == 0, err
    rows = json.loads(out)
    settings = ["torch plain", "torch dedup", "kernel plain", "kernel dedup", "kernel dedup+cache"]
    memcpy = [r for r in rows if r["what"] == "memcpy"]
    for state in ("warm", "cold"):
        got = [r for r in rows if r["what"] == "gather" and r["state"] == state]
        assert [r["setting"] for r in got] == settings
        for r in got:
            assert r["rows_per_step"] == 64 * 2 * 24 and 0 < r["distinct_per_step"] <= r["rows_per_step"]
            assert r["staged_gb_s"] == pytest.approx(r["rows_s"] * 256 * 4 / 1e9)
            assert (r["cache_hit_rate"] is None) == ("cache" not in r["setting"])
            # one round: the ratio is the row's rate over that round's memcpy, the only one measured
            assert ("x_memcpy" in r) == (state == "warm")
            if state == "warm":
                assert r["x_memcpy"] == r["x_memcpy_min"] == pytest.approx(r["staged_gb_s"] / memcpy[0]["gb_s"])
    share = [r for r in rows if r["what"] == "decode step share"]
    assert [r["setting"] for r in share] == settings[3:]
    for r in share:
        assert 0 <= r["share_overlapped"] < 1 and 0 < r["share_inline"] < 1 and r["step_overlapped_ms"] > 0
    assert [r["what"] for r in rows].count("memcpy") == 2 and all(r["gb_s"] > 0 for r in rows if r["what"] == "memcpy")
    assert not any(tmp_path.iterdir())  # the table file is deleted


def test_bench_table_and_capped_reference():
    from engram_serve.bench.common import format_table, time_callable
    table = format_table([{"tokens": 1, "x_ms": 0.5, "note": ""}, {"tokens": 65536, "x_ms": 1234.5, "note": "capped"}])
    lines = table.splitlines()
    assert lines[0].split() == ["tokens", "x_ms", "note"] and len(lines) == 4
    assert "1,234" in lines[3] or "1,235" in lines[3]
    t = time_callable(lambda: None, warmup=0, min_repeats=3, max_repeats=3)
    assert t.repeats == 3 and 0 <= t.median_ms <= t.p90_ms
