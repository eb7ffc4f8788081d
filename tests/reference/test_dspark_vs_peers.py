"""engram-serve's DSpark drafter (model/dspark.py) against NeMo Automodel 0.7.0's
(`components/models/deepseek_v41/dspark.py` `DeepseekV41DSparkBackbone`, loaded through its own
`DeepseekV41DSparkStateDictAdapter.from_hf`, mask and positions from its `build_attention_mask` /
`build_position_ids`), on one random config whose target layers include Engram layers, float32, NeMo's cache
quantization switched off as in tests/reference/peers_v41.py. Both read the same features (ours); NeMo takes our
chosen tokens as its Markov prev. Acceptance: max |d logit| and |d confidence| <= 1e-4. Skips with the install
line without NeMo."""
from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

from engram_serve.config import ModelConfig
from engram_serve.model.deepseek_v41 import DeepseekV41
from engram_serve.model.dspark import DSpark, DSparkState
from engram_serve.model.loader import model_state_from_official
from peers_v41 import NEMO_VERSION, _identity_quant, _require
from v41_fixtures import engram_hash_ids, random_v41_weights, small_v41_config, with_drafter

TOL = 1e-4


def test_drafter_agrees_with_nemo():
    _require("nemo-automodel", NEMO_VERSION, "nemo_automodel.components.models.deepseek_v41.dspark")
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention, dspark as nemo_dspark
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41DSparkStateDictAdapter

    config = with_drafter(small_v41_config(), layers=3, block=5, targets=(1, 3, 4))  # layers 1, 3: Engram
    weights = random_v41_weights(config, 5)
    cfg = ModelConfig.from_dict(config)
    model, drafter = DeepseekV41(cfg), DSpark(cfg)
    for m in (model, drafter):
        m.load_state_dict(model_state_from_official(m, weights))
        m.requires_grad_(False)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    hashes = engram_hash_ids(config, ids)
    rows = [weights[f"layers.{l}.engram.embed.weight"][hashes[l]][None] for l in config["engram_layer_ids"]]
    features = model.forward_dense(torch.tensor([ids]), rows, features=True)[1][0]  # [S, nL D]
    n, k, last = len(ids), cfg.dspark.dspark_block_size, 7
    state = DSparkState(cfg, 4, 4, max_rows=1)
    drafter.write_context(state, features, torch.arange(n), torch.arange(n))
    ours = drafter.draft(model, state, torch.tensor([last]), torch.tensor([n]), torch.arange(4)[None], 4)

    text = DeepseekV41TextConfig(**config, dtype="float32")
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    with torch.random.fork_rng():  # (its random init, all overwritten, leaves the caller's RNG alone)
        peer = nemo_dspark.DeepseekV41DSparkBackbone(text, backend).eval()
    adapter = DeepseekV41DSparkStateDictAdapter(text, peer.moe_config, backend, dtype=torch.float32)
    native = adapter.from_hf({k_: v.clone() for k_, v in weights.items()
                              if k_.startswith("mtp.") or k_ in ("embed.weight", "head.weight")})
    result = peer.load_state_dict(native, strict=False)
    assert all(m.endswith("ffn.gate.bias_vl") for m in result.missing_keys), result.missing_keys  # image routing
    assert set(result.unexpected_keys) <= {"embed_tokens.weight", "lm_head.weight"}, result.unexpected_keys
    anchors, keep = torch.tensor([[n]]), torch.tensor([[True]])
    noise = weights["embed.weight"][torch.tensor([[last] + [cfg.dspark.dspark_noise_token_id] * (k - 1)])]
    prev = torch.tensor([[last] + ours.tokens[0, :-1].tolist()])
    with (mock.patch.object(nemo_dspark, "quantize_cache", _identity_quant),
          mock.patch.object(nemo_attention, "quantize_cache", _identity_quant), torch.no_grad()):
        out = peer(noise, features[None], position_ids=peer.build_position_ids(anchors, n),
                   attention_mask=peer.build_attention_mask(anchors, keep, n, torch.float32), previous_token_ids=prev)
    logits = F.linear(out.normalized_hidden_states.float(), weights["head.weight"]) + out.transition_logits.float()
    assert (logits[0] - ours.logits[0]).abs().max().item() <= TOL
    assert (out.confidence_pred[0] - ours.confidence[0]).abs().max().item() <= TOL
    assert torch.equal(logits[0].argmax(-1), ours.tokens[0])
