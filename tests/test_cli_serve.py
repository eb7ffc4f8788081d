"""Command-line rough edges: one-line errors (exit 2) for a broken pipe, a busy port
(checked before the model loads), a wrongly typed config.json, bad serve flags; verify shows
progress; chat templates run in a Hugging Face-compatible Jinja environment; a client that
disconnects while uploading its body is logged in one line."""
from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import time

import pytest

from engram_serve.cli import main
from engram_serve.model.loader import TINY_DIR

CLI = [sys.executable, "-m", "engram_serve.cli"]


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("loading")]
    assert len(lines) == 1 and lines[0].startswith("engram-serve: error: "), stderr[-2000:]
    assert "Traceback" not in stderr
    return lines[0]


def test_broken_pipe_is_one_line_not_a_traceback():
    ids = ",".join(str(i % 4000) for i in range(1500))  # ~200 KB of JSON: more than a pipe buffer holds
    r = subprocess.run(" ".join(CLI) + f" hash --token-ids {ids} | head -c 10", shell=True, capture_output=True,
                       text=True, timeout=120, executable="/bin/bash")
    assert len(r.stdout) == 10
    assert "broken pipe" in one_line_error(r.stderr)


def test_busy_port_fails_before_loading_the_model(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        # a model path that does not exist: the port is checked first, so the error is about the port
        r = subprocess.run(CLI + ["serve", "--port", str(port), "--model", str(tmp_path / "missing")],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"--port {port}" in one_line_error(r.stderr) and "in use" in r.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("value, needle", [("128", "hidden_size='128'"), (128.0, "hidden_size=128.0"),
                                           (None, "hidden_size=None")])
def test_wrongly_typed_config_is_one_line(tmp_path, capsys, value, needle):
    for f in TINY_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "x", "--model", str(tmp_path), "--no-check"]) == 2
    assert needle in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--dtype", "float16"], "--dtype"), (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--port", "70000"], "--port"), (["serve", "--threads", "-1"], "--threads"),
    (["serve", "--seed", "x"], "--seed"), (["serve", "--max-waiting", "0"], "--max-waiting"),
    (["serve", "--chat-template", "/nonexistent.jinja", "--port", "0"],
                                           "--chat-template"),
])
def test_bad_serve_flags_are_one_line(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_line_error(capsys.readouterr().err)


def test_old_microbatch_flags_are_aliases_of_the_new_ones():
    from engram_serve.cli import build_parser
    parse = build_parser().parse_args
    old = parse(["generate", "x", "--ubatches", "3", "--split-threshold", "5"])
    new = parse(["generate", "x", "--microbatches", "3", "--microbatch-threshold", "5"])
    assert (old.microbatches, old.microbatch_threshold) == (new.microbatches, new.microbatch_threshold) == (3, 5)
    for argv in (["--ubatches", "4"], ["--microbatches", "4"]):
        assert parse(["serve", *argv]).microbatches == 4
    for flag in ("--no-dual-batch-overlap", "--no-microbatching"):
        assert parse(["serve", flag]).no_microbatching is True
    assert parse(["serve"]).no_microbatching is False and parse(["serve"]).microbatches == 2


def test_serve_help_lists_the_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks",
                 "--enforce-eager", "--served-model-name", "--chat-template", "--api-key", "--seed",
                 "--no-enable-prefix-caching", "--no-dual-batch-overlap", "--threads", "--max-body-bytes"):
        assert flag in out, flag


def test_verify_shows_progress():
    r = subprocess.run(CLI + ["verify", "--num-requests", "1", "--gen-tokens", "1", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert "verify" in r.stderr and "case" in r.stderr  # the tqdm bar: verify: k/N cases
    assert r.stdout.strip().endswith(("PASS", "FAIL"))


# ---- chat templates ----

class Tok:
    """The two tokenizer methods ChatTemplate uses."""

    def token_to_id(self, t):
        return 1


def test_chat_template_has_the_hugging_face_environment(tmp_path):
    from engram_serve.server.chat_template import ChatTemplate, TemplateError
    from engram_serve.server.protocol import ChatMessage
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "[{{ m.role }}]{{ m.content | tojson }}{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
                "{% if messages[-1].role == 'developer' %}{{ raise_exception('no developers') }}{% endif %}"
                "{{ strftime_now('%Y') | length }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    t = ChatTemplate(Tok(), tmp_path)
    msgs = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="é"),
            ChatMessage(role="assistant", content="b"), ChatMessage(role="user", content="c")]
    assert t.render(msgs) == '<s>[user]"é"[assistant]"b"4'  # continue, break, non-ASCII kept, strftime_now
    with pytest.raises(TemplateError, match="no developers"):
        t.render([ChatMessage(role="developer", content="x")])
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ChatTemplate(Tok(), tmp_path, override).render(msgs[:2]) == "sé"


def test_chat_prompt_holds_the_bos_once(tmp_path):
    """A template that writes the BOS itself: the prompt is tokenized without special tokens added."""
    import httpx

    from engram_serve.engine.async_engine import AsyncLLMEngine
    from engram_serve.llm import build_engine
    from engram_serve.model.loader import load_model
    from engram_serve.server.api import build_app
    from engram_serve.server.run import BackgroundServer
    loaded = load_model()
    bos = loaded.tokenizer.id_to_token(0)
    (tmp_path / "t.jinja").write_text(f"{bos}" + "{% for m in messages %}{{ m.content }}{% endfor %}")
    engine = AsyncLLMEngine(build_engine(loaded, max_model_len=64, num_blocks=32, max_num_seqs=2))
    with BackgroundServer(build_app(engine, "m", chat_template=tmp_path / "t.jinja")) as s:
        r = httpx.post(s.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    engine.shutdown()
    assert r["tokens"].count(0) == 1 and r["tokens"][0] == 0


def test_disconnect_during_upload_logs_one_line(caplog):
    from engram_serve.engine.async_engine import AsyncLLMEngine
    from engram_serve.llm import build_engine
    from engram_serve.model.loader import load_model
    from engram_serve.server.api import build_app
    from engram_serve.server.run import BackgroundServer
    engine = AsyncLLMEngine(build_engine(load_model(), max_model_len=64, num_blocks=32, max_num_seqs=2))
    caplog.set_level(logging.INFO)
    with BackgroundServer(build_app(engine, "m")) as s:
        sock = socket.create_connection((s.host, s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{\"prompt\": \"aaaa")
        time.sleep(0.3)
        sock.close()  # gone mid-body
        time.sleep(0.5)
    engine.shutdown()
    mine = [r for r in caplog.records if "disconnected while sending" in r.getMessage()]
    assert len(mine) == 1 and mine[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_bench_sampler_rows(capsys):
    assert main(["bench", "sampler", "--rows", "3", "--vocab", "2000", "--shapes", "flat", "--budget-s", "0.01",
                 "--threads", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["rows"] == 3 and row["vocab"] == 2000 and row["top_p_fallback_rows"] == 3  # flat: all fall back
    for kind in ("greedy", "top_p", "top_p_full_sort", "top_k", "sample"):
        assert row[f"{kind}_ms"] > 0 and row[f"{kind}_x_argmax"] > 0
