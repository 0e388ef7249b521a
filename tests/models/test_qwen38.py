"""Qwen3.8 targets: the published Qwen3.8-27B layout -- ``Qwen3_5ForConditionalGeneration``, ``model_type``
``qwen3_5`` with the text model under ``text_config`` (interleaved M-RoPE sections, one MTP layer), a
``vision_config`` and ``model.visual.*`` weights beside ``model.language_model.*`` and ``mtp.*`` in a sharded
checkpoint -- loads through the Qwen3.5 path. Pinned here: the mapping (config fields and weight names) and golden
logits against transformers' own class for that architecture on a tiny random checkpoint (text-only input, where
M-RoPE is plain RoPE); then the MTP and DFlash2 drafters against it, lossless. transformers 5.25 has no separate
Qwen3.8 model type (``qwen4_exp`` is another architecture: hyper-connections, n-gram embeddings, an indexer)."""

from __future__ import annotations

import json

import pytest
import torch
from _hf_cache import hf_step
from safetensors.torch import save_file
from test_dflash import plain_greedy, prompt_ids

from edgespec.arch.detect import select_hooks
from edgespec.bench.random_drafter import write_dflash2_drafter
from edgespec.bench.shapes import SHAPES, config_dict, qwen38_config, tiny_config, write_random_checkpoint
from edgespec.drafters.dflash2_loader import load_dflash2_checkpoint
from edgespec.drafters.mtp import MTPProposer
from edgespec.loading.checkpoint import load_target
from edgespec.loading.hf_config import parse_config
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen38_tiny(tmp_path_factory):
    """A tiny Qwen3.8-layout checkpoint in three shards: text (VLM key prefix) + MTP, and the vision tower's own
    weights, as transformers lays them out, under ``model.visual.*``."""
    folder = tmp_path_factory.mktemp("qwen38") / "ckpt"
    text = tiny_config("qwen3_5")
    write_random_checkpoint(folder, text, seed=21, prefix="model.language_model.", shards=2, with_mtp=True)
    cfg = qwen38_config(text)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForConditionalGeneration(transformers.AutoConfig.for_model(**cfg))
    gen = torch.Generator().manual_seed(3)
    visual = {f"model.visual.{n}": torch.randn(p.shape, generator=gen) * 0.02
              for n, p in hf.model.visual.named_parameters()}
    save_file(visual, str(folder / "model-visual.safetensors"), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-visual.safetensors" for k in visual})
    index_path.write_text(json.dumps(index))
    return folder


def test_published_config_maps_to_the_qwen35_hybrid():
    cfg = parse_config(qwen38_config(config_dict(**SHAPES["qwen3.8-27b"])))
    assert (cfg.family, cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("qwen3_5", "qwen3_5", 64, 5120)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.layer_types[3::4] == ["full_attention"] * 16
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (24, 4, 256, 64)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.intermediate_size) == (16, 48, 17408)
    assert cfg.mtp_num_hidden_layers == 1 and cfg.vocab_size == 248320 and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None        # interleaved M-RoPE: plain RoPE on text


def test_golden_logits_against_transformers(qwen38_tiny):
    """Every prompt row (80 tokens: the chunked GDN crosses a chunk) and 12 cached decode steps within 1e-4 of
    ``Qwen3_5ForConditionalGeneration`` on text-only input; the vision tower and the MTP head loaded."""
    from edgespec.kernels.quant.linear import configure_cpu, cpu_blas_active, use_native_cpu
    was = cpu_blas_active()
    configure_cpu(False)          # transformers' own matmul order, as tests/models/test_golden.py compares
    was_native = use_native_cpu(False)
    try:
        ours = load_target(qwen38_tiny, max_positions=256, merge=False)
        assert ours.mtp is not None and ours.visual is not None     # the checkpoint's model.visual.* (issue 48)
        hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(qwen38_tiny, dtype=torch.float32).eval()
        ids = torch.randint(0, ours.config.vocab_size, (80,), generator=torch.Generator().manual_seed(8))
        cache = ours.new_cache(128)
        out = ours.forward(ids, cache)
        ref, past = hf_step(hf, ids[None])
        assert (out.logits - ref.logits[0]).abs().max().item() < 1e-4
        token = ref.logits[0, -1].argmax()
        for _ in range(12):
            mine = ours.decode(token.view(1), cache)
            ref, past = hf_step(hf, token.view(1, 1), past)
            assert (mine - ref.logits[0, -1]).abs().max().item() < 1e-4
            token = ref.logits[0, -1].argmax()
    finally:
        configure_cpu(was)
        use_native_cpu(was_native)


def test_mtp_and_dflash2_drafters_against_it_are_lossless(qwen38_tiny, tmp_path):
    model = load_target(qwen38_tiny, max_positions=512)
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=4)
    plain = plain_greedy(model, prompt, 16)
    drafter = write_dflash2_drafter(tmp_path / "d2", qwen38_tiny, seed=5, num_layers=2, block_size=8,
                                    target_layer_ids=[1, 3, 5], sliding_layers=2, sliding_window=2048,
                                    selector_rank=8)
    for arch in ("base", "thor"):
        graphs = select_hooks(arch, CPU).defaults.cuda_graphs
        for prop in (MTPProposer.from_target(model, max_seq_len=256),
                     load_dflash2_checkpoint(drafter, model, window_size=16, cuda_graphs=graphs)):
            session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, max_len=128)
            out = session.generate(prompt, max_tokens=16, policy=StrictGreedy())
            assert out.token_ids == plain, (arch, prop.name)
            assert out.telemetry.cycles > 0
