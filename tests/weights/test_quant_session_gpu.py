"""Quantized models on CUDA: the arch hooks pick the Triton products, the graphed decode and verify use them, and
greedy speculative output equals plain output on every format, to the bf16 standard of ``edgespec.speculative.parity``
(equal, or a tie flip at the first divergence: a 1-row decode and a K+1-row verify run different launches).
Skipped without CUDA.

The tiny shapes are widened to 256 hidden / 512 intermediate so every matrix meets the kernels' block sizes
(NVFP4 needs ``in % 128``; int4 group 128): otherwise the hooks would keep the torch reference and the test would
check nothing about the kernels.
"""

from __future__ import annotations

import pytest
import torch
from quant_layouts import write_quantized
from test_dflash import prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.ngram import NGramProposer
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.parity import lossless
from edgespec.speculative.session import SpecSession
from edgespec.weights import PackedWeight

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

CUDA = torch.device("cuda")
WIDE = dict(hidden_size=256, intermediate_size=512, vocab_size=512, head_dim=64)  # FP8-KV attention: 64+


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_gpu")
    made = {}
    for family in ("llama", "qwen3_5"):
        dense = write_random_checkpoint(root / family, tiny_config(family, **WIDE), seed=21)
        for fmt in ("fp8", "nvfp4", "awq"):
            made[family, fmt] = write_quantized(dense, root / f"{family}-{fmt}", root / f"{family}-{fmt}-ref", fmt,
                                                group=128, seed=3)
    return made


def _packed(model) -> list[PackedWeight]:
    return [m for m in model.modules() if isinstance(m, PackedWeight)]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "awq"])
def test_hooks_choose_kernels_and_speculation_stays_lossless(folders, family, fmt):
    from edgespec.kernels.quant.triton_quant_gemv import choose_quant_kernel

    model = load_target(folders[family, fmt][0], dtype=torch.bfloat16, device=CUDA, max_positions=512)
    packed = _packed(model)
    assert packed, "the checkpoint loaded no packed layer"
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=21, seed=7)
    n = 24
    for arch in ("rtx", "thor"):
        # Plain decoding with the same hooks: thor serves an FP8 KV cache, so its plain output is its own.
        plain_session = SpecSession.with_defaults(model, select_hooks(arch, CUDA), None, max_len=256)
        # Every layer whose shape the kernels take runs on one (e.g. NVFP4 needs in % 128: the tiny GDN out_proj
        # does not qualify and keeps the reference), and most layers do.
        assert all((p.kernel is not None) == (choose_quant_kernel(p) is not None) for p in packed), arch
        assert sum(p.kernel is not None for p in packed) * 2 > len(packed), arch
        plain = plain_session.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids
        for prop in (NGramProposer(), OracleProposer(plain, vocab, seed=5)):
            s = SpecSession.with_defaults(model, select_hooks(arch, CUDA), prop, k=7, max_len=256)
            out = s.generate(prompt, max_tokens=n, policy=StrictGreedy())
            # bf16: equal, or a tie flip at the first divergence (speculative.parity, as for dense bf16 weights)
            assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8), (family, fmt, arch,
                                                                                   type(prop).__name__)


# fp32 activations: the packed products take them too, and fp32 makes "lossless" exact (in bf16 the teacher-forced
# tie check runs other kernels than the 32-row verify, so a post-flip near-tie can read above TIE_REGRET).
WIDE_DTYPE = torch.float32


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "awq"])
def test_wide_verify_17_to_64_rows_stays_lossless(folders, fmt):
    """K = 31 (32-row verifies, the oracle's most: the wide one-row-block tile of the packed products) with an
    oracle drafter and the n-gram drafter: speculative output equals plain output."""
    model = load_target(folders["qwen3_5", fmt][0], dtype=WIDE_DTYPE, device=CUDA, max_positions=512)
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=21, seed=9)
    plain = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), None, max_len=256).generate(
        prompt, max_tokens=90, policy=StrictGreedy()).token_ids
    for prop in (OracleProposer(plain, vocab, seed=5), NGramProposer()):
        s = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), prop, k=31, max_len=256)
        out = s.generate(prompt, max_tokens=90, policy=StrictGreedy())
        assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8), (fmt, type(prop).__name__)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "awq"])
def test_kernel_logits_match_the_reference_product(folders, fmt):
    """The same model with and without the chosen kernels: bf16 logits agree within bf16 rounding."""
    model = load_target(folders["llama", fmt][0], dtype=torch.bfloat16, device=CUDA, max_positions=256)
    hooks = select_hooks("rtx", CUDA)
    toks = torch.tensor(prompt_ids(model.config.vocab_size, n=16, seed=2), device=CUDA)
    results = []
    for use_kernels in (True, False):
        assert hooks.choose_weight_kernels(model) > 0
        if not use_kernels:
            for p in _packed(model):
                p.kernel = None
        cache = model.new_cache(64)
        results.append(model.forward(toks, cache).logits)
    fast, ref = results
    scale = ref.abs().max().item()
    assert (fast - ref).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("drafter_weights", ["int4", "fp8", "nvfp4"])
def test_quantized_dflash_drafter_on_a_quantized_target(folders, tmp_path, drafter_weights):
    """``drafter_weights``: a DFlash drafter quantized at load runs its packed layers on the Triton products (inside
    the proposer's CUDA graphs) and the output stays lossless on an int4 (AWQ) target."""

    from edgespec.bench import random_drafter as make_drafter
    from edgespec.drafters.dflash import load_dflash_checkpoint

    model = load_target(folders["qwen3_5", "awq"][0], dtype=torch.bfloat16, device=CUDA, max_positions=512)
    folder = make_drafter.write_dflash_drafter(tmp_path / "d", tiny_config("qwen3_5", **WIDE), seed=4, num_layers=2,
                                               block_size=8, target_layer_ids=[1, 3])
    prop = load_dflash_checkpoint(folder, model, window_size=16, cuda_graphs=True, weights=drafter_weights)
    packed = _packed(prop.drafter)
    assert packed and all(p.kernel is not None for p in packed)
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=7)
    plain = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), None, max_len=256).generate(
        prompt, max_tokens=24, policy=StrictGreedy()).token_ids
    s = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), prop, max_len=256, cuda_graphs=True)
    out = s.generate(prompt, max_tokens=24, policy=StrictGreedy())
    assert out.telemetry.draft_tokens > 0
    assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8)


def test_quantized_lm_head_on_gpu_stays_lossless(folders):
    """``lm_head_weights: int4`` on CUDA: the head runs on the pair tile inside the graphed verify, lossless."""
    from edgespec.weights.requantize import quantize_lm_head

    model = load_target(folders["qwen3_5", "awq"][0], dtype=torch.bfloat16, device=CUDA, max_positions=512)
    assert quantize_lm_head(model, "int4")
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=7)
    plain = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), None, max_len=256).generate(
        prompt, max_tokens=24, policy=StrictGreedy()).token_ids
    assert model.lm_head.weight.kernel is not None
    s = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), OracleProposer(plain, model.config.vocab_size,
                                  seed=5), k=7, max_len=256)
    out = s.generate(prompt, max_tokens=24, policy=StrictGreedy())
    assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_quantized_tied_head_on_gpu_stays_lossless(tmp_path, fmt):
    """A tied head packed by ``lm_head_weights``: embedding lookups decode packed rows inside the captured graphs,
    the head runs the packed product; lossless."""
    from edgespec.weights.requantize import quantize_lm_head

    folder = write_random_checkpoint(tmp_path / "tied", tiny_config("qwen3_5", tie_word_embeddings=True, **WIDE),
                                     seed=21)
    model = load_target(folder, dtype=torch.bfloat16, device=CUDA, max_positions=512)
    assert model.lm_head is None and quantize_lm_head(model, fmt)
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=7)
    plain = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), None, max_len=256).generate(
        prompt, max_tokens=24, policy=StrictGreedy()).token_ids
    assert model.lm_head_weight.kernel is not None
    s = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), OracleProposer(plain, model.config.vocab_size,
                                  seed=5), k=7, max_len=256)
    assert lossless(model, prompt, plain, s.generate(prompt, max_tokens=24, policy=StrictGreedy()).token_ids,
                    kv_fp8=s.kv_fp8)
