"""Checkpoint tensor names: this project's (native) names and the official DeepSeek-V4.1 scheme, in ONE table.

A checkpoint uses one scheme throughout. `OFFICIAL` maps each native name pattern to its official
one (`{i}`: the model layer id; `{e}`: an expert index, the official checkpoint stores one tensor
per expert where the model stacks them as [E, ...]). The Engram names are those of the published
V4.1 checkpoints (layers.{L}.engram.embed.weight / .scale, wkv.weight / .scale, q_weight, k_weight);
the backbone follows the same DeepSeek naming (embed, head, attn_norm, ffn_norm, ffn.w1/w2/w3,
ffn.gate, attn.wq/wk/wv/wo). An FP8 tensor `X.weight` has its E8M0 scales in `X.scale`.
"""
from __future__ import annotations

import re

NATIVE, OFFICIAL_SCHEME = "native", "official"

# native pattern -> official pattern
OFFICIAL: dict[str, str] = {
    "embed_tokens.weight": "embed.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "layers.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "layers.{i}.attn.q_proj.weight": "layers.{i}.attn.wq.weight",
    "layers.{i}.attn.k_proj.weight": "layers.{i}.attn.wk.weight",
    "layers.{i}.attn.v_proj.weight": "layers.{i}.attn.wv.weight",
    "layers.{i}.attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "layers.{i}.mlp_norm.weight": "layers.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.ffn.w1.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.ffn.w2.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.ffn.w3.weight",
    "layers.{i}.mlp.router.weight": "layers.{i}.ffn.gate.weight",
    "layers.{i}.mlp.w_gate": "layers.{i}.ffn.experts.{e}.w1.weight",
    "layers.{i}.mlp.w_down": "layers.{i}.ffn.experts.{e}.w2.weight",
    "layers.{i}.mlp.w_up": "layers.{i}.ffn.experts.{e}.w3.weight",
    "layers.{i}.engram.wkv.weight": "layers.{i}.engram.wkv.weight",
    "layers.{i}.engram.q_weight": "layers.{i}.engram.q_weight",
    "layers.{i}.engram.k_weight": "layers.{i}.engram.k_weight",
    "engram.{i}.table": "layers.{i}.engram.embed.weight",  # the Engram table of model layer i
}
SCALE_SUFFIX = ".scale"  # official: X.weight (F8_E4M3) -> X.scale (F8_E8M0); native: X -> X.scale


def _compile(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


_NATIVE_RE = [(_compile(k), v) for k, v in OFFICIAL.items()]


def official_name(native: str) -> str:
    """The official name of a native tensor name (with `{e}` left in for stacked experts)."""
    for rx, official in _NATIVE_RE:
        m = rx.match(native)
        if m:
            return official.replace("{i}", m.group("i")) if "i" in m.groupdict() else official
    raise KeyError(f"tensor {native!r} has no entry in the official name table (engram_serve/model/names.py)")


def scale_name(name: str) -> str:
    """Where the E8M0 scales of an FP8 tensor live: `a.b.weight` -> `a.b.scale`, other names -> name + `.scale`."""
    return name[: -len(".weight")] + SCALE_SUFFIX if name.endswith(".weight") else name + SCALE_SUFFIX


def detect_scheme(names) -> str:
    """OFFICIAL_SCHEME if the names are official (an `embed.weight` or a `layers.*.engram.embed.weight`),
    else NATIVE."""
    for n in names:
        if n == "embed.weight" or (n.startswith("layers.") and n.endswith(".engram.embed.weight")):
            return OFFICIAL_SCHEME
    return NATIVE


def name_in(scheme: str, native: str) -> str:
    return native if scheme == NATIVE else official_name(native)
