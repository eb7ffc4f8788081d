"""Two public DeepSeek-V4.1 implementations as test oracles: NeMo Automodel 0.7.0 and mlx-lm 0.32.2.

Install them (two steps; the second keeps NeMo's training stack, megatron-fsdp, torchao,
mistral-common and the like, out of the environment, and neither step touches torch):

    pip install -e '.[test]'
    pip install --no-deps nemo-automodel==0.7.0

On top of `.[test]` that is transformers 5.18.0, mlx-lm, mlx's CPU wheel and NeMo Automodel: about
25 s and 210 MB on the 2-core Linux x86_64 / Python 3.11 machine. NeMo's DeepSeek-V4.1 text path
imports only torch, transformers, huggingface_hub, numpy, packaging, pillow and typing_extensions.

`nemo_logits` runs NeMo's `components/models/deepseek_v41` (with Engram) on CPU in float32 with the
eager attention, torch linears and the per-expert MoE loop: a full-sequence forward. `mlx_logits`
runs mlx-lm's `models/deepseek_v41.py` (the backbone: it refuses Engram layers) with MLX's CPU
backend in float32: one prefill call. Each takes `weights` under the official checkpoint names of
docs/deepseek_v41.md, unquantized, and loads them through the peer's own loading path (NeMo: its
state-dict adapter's `from_hf`, then `load_state_dict`; mlx: `Model.sanitize`, then
`load_weights`), so the peer's renaming and expert stacking are exercised too.

Cache quantization is switched off. Both peers emulate DeepSeek's quantized caches by default (FP8
window KV, NVFP4 compressed entries, MXFP4 index keys and queries); engram-serve computes them in
float32. For the duration of each call this module replaces NeMo's `quantize_cache`, as
`deepseek_v41/attention.py` imported it, and mlx-lm's `_fake_quant_fp8` and `_fake_quant_fp4` in
`deepseek_v41.py` by the identity (`unittest.mock.patch.object`, restored on return). Nothing else
of either peer is changed.

A missing or different peer version skips the calling test with the install command above.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

INSTALL = "pip install -e '.[test]' && pip install --no-deps nemo-automodel==0.7.0"
NEMO_VERSION = "0.7.0"
MLX_LM_VERSION = "0.32.2"

# The published text_config fields that shape the text forward. The peers' defaults for the
# absent ones differ (NeMo: Engram on layers 1 and 14, candidate source 20; mlx: none of either),
# so a config that leaves one out would build two different models: it is refused instead.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor",
    "swiglu_limit", "rms_norm_eps", "sliding_window", "compress_ratios", "kv_source_layer_ids",
    "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
    "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "rope_theta",
    "compress_rope_theta", "rope_scaling", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "engram_layer_ids",
)
ENGRAM_FIELDS = (
    "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_vocab_size", "engram_pad_token_id", "engram_compressed_vocab_size",
)


def _require(distribution: str, version: str, module: str) -> None:
    """Skip the calling test unless `distribution==version` is installed and `module` imports."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution}=={version} is not installed; install the peers with: {INSTALL}")
    if found != version:
        pytest.skip(f"the peer harness is written for {distribution}=={version}, found {found}; "
                    f"install the peers with: {INSTALL}")
    pytest.importorskip(module, reason=f"{module} does not import; install the peers with: {INSTALL}")


def _check_config(text_config: dict) -> None:
    missing = [name for name in REQUIRED_FIELDS if name not in text_config]
    if text_config.get("engram_layer_ids"):
        missing += [name for name in ENGRAM_FIELDS if name not in text_config]
    if missing:
        raise ValueError(f"text_config lacks the published fields {missing}: the peers' defaults "
                         "for them differ, so both must be given explicitly")


def _identity_quant(values, *args, **kwargs):
    return values


# ---------------------------------------------------------------------------------------------
# NeMo Automodel


def nemo_logits(text_config: dict, weights: dict[str, torch.Tensor], token_ids: list[int],
                tokenizer_json: str | Path) -> np.ndarray:
    """NeMo Automodel's DeepSeek-V4.1 logits `[S, V]` float32 for one sequence, Engram included.

    `tokenizer_json` is the tokenizer whose compressed vocabulary seeds the Engram hash (it must
    have `engram_compressed_vocab_size` keys); NeMo reads it as a `PreTrainedTokenizerFast`.
    """
    _require("nemo-automodel", NEMO_VERSION, "nemo_automodel.components.models.deepseek_v41.model")
    _check_config(text_config)
    from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention

    model = _nemo_model(text_config, tokenizer_json)
    _nemo_load(model, weights)
    ids = torch.tensor([token_ids], dtype=torch.long)                     # [1, S]
    with mock.patch.object(nemo_attention, "quantize_cache", _identity_quant), torch.no_grad():
        logits = model(ids).logits                                        # [1, S, V] float32
    return logits[0].float().numpy()


def _nemo_model(text_config: dict, tokenizer_json: str | Path):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from transformers import PreTrainedTokenizerFast

    config = DeepseekV41Config(text_config={**text_config, "dtype": "float32"},
                               vision_config={"num_hidden_layers": 0}, dtype="float32")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                            dispatcher="torch")
    with torch.random.fork_rng():  # the random initialisation (all overwritten) leaves the caller's RNG alone
        model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer).eval()
    wrong = {name: p.dtype for name, p in model.state_dict().items()
             if p.is_floating_point() and p.dtype != torch.float32}
    if wrong:
        raise TypeError(f"NeMo built non-float32 tensors despite dtype='float32': {wrong}")
    return model


# Native NeMo tensors that the official checkpoint of a text model does not feed: the image
# routing bias (zero: text tokens route with `ffn.gate.bias` alone).
_NEMO_UNFED = ("ffn.gate.bias_vl",)


def _nemo_load(model, weights: dict[str, torch.Tensor]) -> None:
    native = model.state_dict_adapter.from_hf({k: v.detach().float().clone() for k, v in weights.items()})
    result = model.load_state_dict(native, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(_NEMO_UNFED)]
    if missing or result.unexpected_keys:
        raise KeyError(f"NeMo load: parameters without a checkpoint tensor {missing}, "
                       f"checkpoint tensors without a parameter {result.unexpected_keys}")


# ---------------------------------------------------------------------------------------------
# mlx-lm


def mlx_logits(text_config: dict, weights: dict[str, torch.Tensor], token_ids: list[int]) -> np.ndarray:
    """mlx-lm's DeepSeek-V4.1 logits `[S, V]` float32 for one sequence (a model without Engram)."""
    _require("mlx-lm", MLX_LM_VERSION, "mlx_lm.models.deepseek_v41")
    _check_config(text_config)
    if text_config["engram_layer_ids"]:
        raise ValueError(f"mlx-lm has no Engram: engram_layer_ids must be empty, "
                         f"got {text_config['engram_layer_ids']}")
    import mlx.core as mx
    from mlx_lm.models import deepseek_v41 as mlx_v41

    args = mlx_v41.ModelArgs.from_dict({**text_config, "model_type": "deepseek_v41"})
    model = mlx_v41.Model(args)
    arrays = {k: mx.array(v.detach().float().numpy()) for k, v in weights.items()}
    model.load_weights(list(model.sanitize(arrays).items()), strict=True)
    with (mock.patch.object(mlx_v41, "_fake_quant_fp8", _identity_quant),
          mock.patch.object(mlx_v41, "_fake_quant_fp4", _identity_quant),
          mx.stream(mx.cpu)):
        logits = model(mx.array([token_ids], dtype=mx.int32))             # [1, S, V]
        mx.eval(logits)
    if logits.dtype != mx.float32:
        raise TypeError(f"mlx-lm returned {logits.dtype} logits from float32 weights")
    return np.array(logits[0], dtype=np.float32)
