"""edgespec.bench.attn_in_place: the decode step it times without attention really has none, and only that."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from edgespec.bench import attn_in_place
from edgespec.kernels import attention_bytes
from edgespec.models import layers

CONTEXT = 64


def test_left_out_step_calls_no_attention_and_the_served_step_calls_each_layer(tiny_models):
    model = tiny_models["qwen3_5"]
    served_session, served = attn_in_place.decode_step(model, False, CONTEXT)
    _, bare = attn_in_place.decode_step(model, False, CONTEXT, leave_out_attention=True)
    n_attn = len(served_session.cache.kv_layers)
    assert n_attn >= 1
    with mock.patch(attn_in_place.ATTENTION_SITE, wraps=layers.cached_attention) as real:
        served_out = served()
        assert real.call_count == n_attn
        bare_out = bare()                       # the stand-in replaces the spy: the real function is not reached
        assert real.call_count == n_attn
    assert served_session.cache.length == CONTEXT          # the step leaves the cache where it found it
    # the attention really is gone: the output changes, and nothing else went missing (finite logits)
    assert torch.isfinite(bare_out.logits).all()
    assert not torch.allclose(served_out.logits, bare_out.logits)


def test_fill_kv_writes_random_rows_and_scales(tiny_models):
    session, _ = attn_in_place.decode_step(tiny_models["qwen3_5"], True, CONTEXT)
    for c in session.cache.kv_layers:
        assert c.fp8
        assert c.k[:CONTEXT].float().abs().sum() > 0 and c.v.float().abs().sum() > 0
        assert float(c.k_scale.min()) >= 0.005 and float(c.k_scale.max()) <= 0.02
    assert session.cache.length == CONTEXT
    with pytest.raises(ValueError, match="no room"):
        attn_in_place.fill_kv(session, session.cache.max_len)


def test_compare_in_place_reports_both_formats_per_call(tiny_models):
    model = tiny_models["qwen3_5"]
    r = attn_in_place.compare_in_place(model, CONTEXT, repeat=2, iters=2)
    cfg = model.config
    for name, fp8 in (("model", False), ("fp8", True)):
        x = r[name]
        assert x["layers"] == sum(t == "full_attention" for t in cfg.layer_types)
        assert len(x["attention_us_each"]) == 2 and x["context"] == CONTEXT
        assert x["bytes_per_call"] == attention_bytes(1, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                      cfg.head_dim, CONTEXT, fp8)
    assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
    lines = attn_in_place.format_in_place("tiny", r, 1e12)
    assert len(lines) == 3 and "per call" in lines[0]
