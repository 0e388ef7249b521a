"""YaRN rope (HF ``rope_type: "yarn"``): golden logits against transformers, tables against its rope init, and
the drafter side (a DFlash config with yarn scaling gets the same tables as a target with it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from edgespec.bench.shapes import tiny_config, write_random_checkpoint  # noqa: E402
from edgespec.drafters.dflash_net import parse_dflash_config  # noqa: E402
from edgespec.loading.checkpoint import load_target  # noqa: E402
from edgespec.loading.hf_config import parse_config  # noqa: E402
from edgespec.models.layers import RotaryEmbedding  # noqa: E402

YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
     "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3,
     "truncate": False},
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("scaling", YARN, ids=["plain", "betas", "mscale", "attn-factor"])
def test_yarn_logits_match_transformers(tmp_path, family, scaling) -> None:
    theta = 10000.0 if family == "llama" else 1e6
    cfg = tiny_config(family, rope_scaling=dict(scaling), rope_parameters={**scaling, "rope_theta": theta},
                      max_position_embeddings=512)
    folder = write_random_checkpoint(tmp_path / family, cfg, seed=11)
    ours = load_target(folder, merge=False, max_positions=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # positions beyond the original context, where YaRN changes the frequencies
    ids = torch.randint(0, cfg["vocab_size"], (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    cache = ours.new_cache(300)
    got = ours.forward(ids, cache).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # and the tables themselves, against transformers' own rope init
    hf_rope = hf.model.rotary_emb
    pos = torch.arange(300)[None]
    cos, sin = hf_rope(torch.zeros(1, 300, 8), pos)
    torch.testing.assert_close(ours.rope.cos[:300], cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.rope.sin[:300], sin[0], atol=1e-5, rtol=1e-5)


def test_yarn_differs_from_plain_rope() -> None:
    """Not vacuous: the scaled tables differ from the plain ones (both in frequency and in magnitude)."""
    plain = RotaryEmbedding(parse_config(tiny_config("llama")), 256)
    yarn = RotaryEmbedding(parse_config(tiny_config("llama", rope_scaling=dict(YARN[0]))), 256)
    assert yarn.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert not torch.allclose(plain.cos, yarn.cos / yarn.attention_factor, atol=1e-3)


def test_drafter_config_with_yarn_gets_the_same_tables() -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    raw = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "mask_token_id": 3, "target_layer_ids": [1],
           "rope_theta": 10000.0, "rope_scaling": scaling, "max_position_embeddings": 512}
    dcfg = parse_dflash_config(raw, 3)
    ours = RotaryEmbedding(dcfg.model_config(300), 300)
    tcfg = parse_config(tiny_config("llama", hidden_size=64, num_attention_heads=4, head_dim=16,
                                    rope_scaling=scaling, max_position_embeddings=512))
    torch.testing.assert_close(ours.cos, RotaryEmbedding(tcfg, 300).cos)
    assert ours.attention_factor > 1.0
