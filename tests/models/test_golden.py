"""Golden logits against Hugging Face transformers on tiny random checkpoints (fp32, CPU).

Prefill logits of every row for a prompt over 64 tokens (so the chunked GDN form crosses a chunk boundary),
then 16 steps of cached decode, each within 1e-4 of transformers.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _hf_cache import hf_step

transformers = pytest.importorskip("transformers")

from edgespec.bench.shapes import TINY_SHAPES, tiny_config, write_random_checkpoint  # noqa: E402
from edgespec.cache.state import StateMode  # noqa: E402
from edgespec.loading.checkpoint import load_target  # noqa: E402

TOL = 1e-4


@pytest.fixture(autouse=True)
def _torch_matmul_on_cpu():
    """Compare with transformers on torch's own CPU matmul, as transformers runs. An Engine built earlier in the
    same process switches fp32 CPU linears to the OpenBLAS path (``configure_cpu``), whose other summation order
    the chunked GDN of the random hybrid amplifies to 2e-4 (3e-5 on torch's matmul); that path is checked against
    the torch reference in tests/kernels/test_linear.py."""
    from edgespec.kernels.quant.linear import configure_cpu, cpu_blas_active, use_native_cpu

    was_active = cpu_blas_active()
    configure_cpu(False)
    # and not the compiled fp32 product either: its rounding flips a near-tied expert of the random MoE router
    # (it is checked against torch's product in tests/kernels/test_linear_route.py)
    was_native = use_native_cpu(False)
    yield
    use_native_cpu(was_native)
    if was_active:
        configure_cpu(True)


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_layout_models(tiny_checkpoints):
    """The tiny checkpoints in their own (unmerged) projection layout and torch's matmul: the same roundings as
    transformers, so the comparison tests the math. The served layout is checked against this one below."""
    return {fam: load_target(path, max_positions=1024, merge=False) for fam, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("family", sorted(TINY_SHAPES))
def test_prefill_and_decode_match_transformers(family, tiny_checkpoints, hf_layout_models):
    ours, hf = hf_layout_models[family], _hf_model(tiny_checkpoints[family])
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, ours.config.vocab_size, (80,), generator=gen)
    cache = ours.new_cache(256)
    out = ours.forward(prompt, cache)                        # all 80 rows, chunked GDN (64 + 16)
    ref, past = hf_step(hf, prompt[None])
    assert (out.logits - ref.logits[0]).abs().max().item() < TOL
    token = ref.logits[0, -1].argmax()
    for _ in range(16):
        mine = ours.decode(token.view(1), cache)
        ref, past = hf_step(hf, token.view(1, 1), past)
        assert (mine - ref.logits[0, -1]).abs().max().item() < TOL
        token = ref.logits[0, -1].argmax()


def test_multi_token_forward_over_cache_matches_full_forward(tiny_models):
    """A verify-style forward of 5 rows over an existing cache equals the same rows of one long forward (both in
    the recurrent GDN form: chunked vs recurrent is covered by its own test with its own bound)."""
    gen = torch.Generator().manual_seed(4)
    for model in tiny_models.values():
        ids = torch.randint(0, model.config.vocab_size, (40,), generator=gen)
        full = model.forward(ids, model.new_cache(64), chunked=False).logits
        cache = model.new_cache(64, checkpoint_rows=8)
        model.forward(ids[:35], cache, chunked=False)
        part = model.forward(ids[35:], cache, mode=StateMode.CHECKPOINT, chunked=False).logits
        assert (part - full[35:]).abs().max().item() < TOL


def test_chunked_prefill_equals_recurrent(tiny_models):
    """Both GDN forms through the whole model over 150 tokens (3 chunks). Each form is within ~5e-7 of a float64
    recurrence at the kernel level (tests/kernels/test_kernels_ref.py); six random layers amplify fp32 rounding about
    1000x, so the model-level bound is 1e-3 on logits of magnitude ~5."""
    model = tiny_models["qwen3_5"]
    ids = torch.randint(0, model.config.vocab_size, (150,))
    a = model.forward(ids, model.new_cache(160), chunked=True).logits
    b = model.forward(ids, model.new_cache(160), chunked=False).logits
    assert (a - b).abs().max().item() < 1e-3


def test_prefill_in_chunks_equals_one_pass(tiny_models):
    model = tiny_models["qwen3_5"]
    ids = torch.randint(0, model.config.vocab_size, (100,))
    one = model.prefill(ids, model.new_cache(128))
    pieces = model.prefill(ids, model.new_cache(128), chunk=33, taps=(1, 3))
    assert (one.logits - pieces.logits).abs().max().item() < TOL
    assert pieces.taps.shape == (100, 2, model.config.hidden_size)


def test_taps_are_layer_outputs(tiny_checkpoints, hf_layout_models):
    """Tap id L is the output of decoder layer L = transformers' hidden_states[L + 1]."""
    ours, hf = hf_layout_models["qwen3"], _hf_model(tiny_checkpoints["qwen3"])
    ids = torch.randint(0, 320, (20,))
    out = ours.forward(ids, ours.new_cache(32), taps=(0, 2))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
    assert (out.taps[:, 0] - ref[1][0]).abs().max() < TOL
    # The last layer's entry in HF is post-norm; compare layer 1 instead of 2 for the pre-norm residual.
    out2 = ours.forward(ids, ours.new_cache(32), taps=(1,))
    assert (out2.taps[:, 0] - ref[2][0]).abs().max() < TOL


def test_vlm_key_prefix_and_shards_load_identically(tmp_path, tiny_models):
    """``model.language_model.`` keys (Qwen3.5 VLM layout) in a sharded checkpoint load to the same model."""
    cfg = tiny_config("qwen3_5")
    vlm_cfg = {"model_type": "qwen3_5", "text_config": {k: v for k, v in cfg.items() if k != "model_type"},
               "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    vlm_cfg["text_config"]["model_type"] = "qwen3_5_text"
    path = write_random_checkpoint(tmp_path / "vlm", cfg, seed=7, prefix="model.language_model.", shards=3,
                                   with_mtp=True)
    (path / "config.json").write_text(__import__("json").dumps(vlm_cfg))
    model = load_target(path, max_positions=1024)
    ref = tiny_models["qwen3_5"]
    ids = torch.randint(0, 320, (30,))
    a = model.forward(ids, model.new_cache(32)).logits
    b = ref.forward(ids, ref.new_cache(32)).logits
    assert torch.equal(a, b)
    assert model.mtp is not None and ref.mtp is not None
    shutil.rmtree(path)


def test_merged_projections_compute_the_same_model(tiny_checkpoints):
    """q/k/v, gate/up and GDN input projections merged into one Linear each (the served layout) give the same logits
    up to fp32 rounding of the different matrix shapes (amplified by the random hybrid's depth, as for chunking)."""
    for family, path in tiny_checkpoints.items():
        plain = load_target(path, max_positions=256, merge=False)
        merged = load_target(path, max_positions=256)
        assert not hasattr(merged.model.layers[0].mlp, "gate_proj")
        ids = torch.randint(0, 320, (70,))
        a = plain.forward(ids, plain.new_cache(80)).logits
        b = merged.forward(ids, merged.new_cache(80)).logits
        tol = 1e-3 if family.startswith("qwen3_5") else TOL
        assert (a - b).abs().max().item() < tol, family
