"""The demo model served natively from its Q4_1 GGUF: equal to its fp32 conversion, speculative == plain."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgespec.weights.base import PackedLinear


def test_packed_demo_equals_its_fp32_conversion(demo_gguf: Path, demo_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Prefill logits of a bench prompt and 8 decode steps, as served on CPU (merged projections)."""
    from edgespec.kernels.quant.linear import configure_cpu
    from edgespec.loading.checkpoint import load_target
    from edgespec.loading.gguf_model import load_gguf_target
    from edgespec.loading.tokenizer import ChatTokenizer

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    packed, folder = load_gguf_target(demo_gguf, max_positions=512)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 30 * 4   # qkv, o, gate_up, down
    assert packed.lm_head is None and packed.lm_head_weight.format == "gguf_q8_0"
    dense = load_target(demo_model_dir, max_positions=512)
    configure_cpu()
    tok = ChatTokenizer.from_folder(folder)
    assert tok.encode("robot arm") == ChatTokenizer.from_folder(demo_model_dir).encode("robot arm")
    messages = [{"role": "user", "content": "Plan robot navigation from the dock to shelf B."}]
    ids = torch.tensor(tok.encode_chat(messages))
    c1, c2 = packed.new_cache(256), dense.new_cache(256)
    a, b = packed.forward(ids, c1).logits, dense.forward(ids, c2).logits
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() < 1e-4 * scale
    token = b[-1].argmax()
    for _ in range(8):
        x, y = packed.decode(token.view(1), c1), dense.decode(token.view(1), c2)
        assert (x - y).abs().max().item() < 1e-4 * scale
        token = y.argmax()


def test_packed_demo_speculative_equals_plain(demo_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    from edgespec.bench.prompts import load_prompts
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan
    from edgespec.speculative.acceptance import StrictGreedy

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    engine = Engine.load(build_plan(Settings(model="demo", drafter="ngram", max_seq_len=512)))
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, PackedLinear)
    prompts = {p.id: p for p in load_prompts(None)}
    for pid in ("robot_navigation_plan", "repeated_text_stress"):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompts[pid].user}])
        plain = engine.session.generate(ids, max_tokens=48, policy=StrictGreedy(),
                                        stop_ids=engine.tokenizer.stop_token_ids, k=0)
        spec = engine.session.generate(ids, max_tokens=48, policy=StrictGreedy(),
                                       stop_ids=engine.tokenizer.stop_token_ids, k=None)
        assert spec.token_ids == plain.token_ids, pid
        assert spec.telemetry.acceptance_length > 1.0, pid
