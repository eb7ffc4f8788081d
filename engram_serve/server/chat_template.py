"""Chat messages -> prompt text, in a Jinja environment that matches Hugging Face's.

Where the template comes from, first match wins: `--chat-template FILE`; the `chat_template` of a
`tokenizer_config.json` beside the model; else the built-in default
`<|role|>\\n{content}<|endoftext|>\\n` per message, then `<|assistant|>\\n` (when the tokenizer has
those tokens).

The environment is transformers' `apply_chat_template` one: a sandbox with `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension (`{% break %}`, `{% continue %}`), the globals
`raise_exception` and `strftime_now`, and a `tojson` filter that keeps non-ASCII text. Templates
hold their own special tokens (BOS included), so the rendered prompt is tokenized with
`add_special_tokens=False`: the BOS never appears twice.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import ConfigError, InvalidRequest

DEFAULT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>")


class TemplateError(Exception):
    """Raised by a template's `raise_exception(...)`."""


def hf_environment():
    """A Jinja environment with what Hugging Face chat templates use."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class ChatTemplate:
    def __init__(self, tokenizer, model_dir: Path | None, template_file: Path | None = None):
        self.source, self._jinja, self.tokens, self.missing = "default", None, {}, []
        template, cfg = None, {}
        cfg_path = model_dir / "tokenizer_config.json" if model_dir is not None else None
        if cfg_path is not None and cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"{cfg_path}: not readable JSON: {e}") from None
            template = cfg.get("chat_template")
            if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}, ...]
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if template is not None:
                self.source = str(cfg_path)
        if template_file is not None:
            try:
                template = Path(template_file).read_text()
            except OSError as e:
                raise ConfigError(f"--chat-template {template_file}: cannot read it: {e.strerror}") from None
            self.source = str(template_file)
        if isinstance(template, str):
            import jinja2
            try:
                self._jinja = hf_environment().from_string(template)
            except jinja2.TemplateError as e:
                raise ConfigError(f"chat template {self.source}: {type(e).__name__}: {e}") from None
            self.tokens = {k: _token_text(cfg.get(k)) or "" for k in ("bos_token", "eos_token")}
        else:
            self.missing = [t for t in DEFAULT_ROLES if tokenizer.token_to_id(t) is None]
            if self.missing:
                self.source = None

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        if self.source is None:
            raise InvalidRequest(f"messages: this model has no chat template (no tokenizer_config.json chat_template "
                                 f"and the tokenizer lacks {self.missing}); use /v1/completions", "messages")
        if self._jinja is not None:
            msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
            return self._jinja.render(messages=msgs, add_generation_prompt=add_generation_prompt, tools=None,
                                      **self.tokens)
        parts = [f"<|{'system' if m.role == 'developer' else m.role}|>\n{m.text()}<|endoftext|>\n" for m in messages]
        return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")
