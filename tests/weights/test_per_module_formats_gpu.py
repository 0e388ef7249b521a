"""compressed-tensors and ModelOpt MIXED_PRECISION checkpoints on CUDA: the arch hooks give their int4 / NVFP4
layers the Triton products (per-channel / per-tensor FP8: the FP8-row product on SM89+), logits agree with the reference
product, and greedy speculative output equals plain output to the bf16 standard of ``speculative.parity``.
Skipped without CUDA (and without compressed-tensors for its checkpoints)."""

from __future__ import annotations

import pytest
import torch
from quant_layouts import write_modelopt_mixed
from test_dflash import prompt_ids

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
WIDE = dict(hidden_size=256, intermediate_size=512, vocab_size=512, head_dim=64)
# (Groups of 128 do not divide the tiny GDN out_proj's 64 inputs: compressed-tensors itself refuses that shape.)
CT = ("int4-g32-sym", "int4-g64-asym", "nvfp4", "mixed")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_module_gpu")
    made = {}
    for family in ("llama", "qwen3_5"):
        dense = write_random_checkpoint(root / family, tiny_config(family, **WIDE), seed=21)
        made[family, "modelopt"] = write_modelopt_mixed(dense, root / f"{family}-mo", root / f"{family}-mo-ref",
                                                        seed=3)[0]
        try:
            from ct_layouts import write_ct
        except ImportError:
            continue
        for scheme in CT:
            made[family, scheme] = write_ct(dense, root / f"{family}-{scheme}", root / f"{family}-{scheme}-ref",
                                            scheme)[0]
    return made


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("name", ("modelopt", *CT))
def test_kernels_chosen_logits_agree_and_speculation_stays_lossless(folders, family, name):
    if (family, name) not in folders:
        pytest.skip("compressed-tensors is not installed")
    model = load_target(folders[family, name], dtype=torch.bfloat16, device=CUDA, max_positions=256)
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    hooks = select_hooks("rtx", CUDA)
    chosen = hooks.choose_weight_kernels(model)
    # Every int4 / NVFP4 layer the kernels take gets one, and every FP8-row layer on SM89+ (e4m3 conversions).
    fp8_rows = torch.cuda.get_device_capability() >= (8, 9)
    want = sum(p.format in ("int4", "nvfp4") and p.in_features % 128 == 0 or p.format == "fp8_row" and fp8_rows
               for p in packed)
    assert chosen >= want > 0, (chosen, want, len(packed))
    if family == "llama":      # (the GDN recurrence amplifies bf16 rounding differences past this bound)
        toks = torch.tensor(prompt_ids(model.config.vocab_size, n=16, seed=2), device=CUDA)
        fast = model.forward(toks, model.new_cache(64)).logits
        kernels = [p.kernel for p in packed]
        for p in packed:
            p.kernel = None
        ref = model.forward(toks, model.new_cache(64)).logits
        assert (fast - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
        for p, k in zip(packed, kernels, strict=True):
            p.kernel = k
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=7)
    plain = SpecSession.with_defaults(model, hooks, None, max_len=256).generate(prompt, max_tokens=20,
                                                                  policy=StrictGreedy()).token_ids
    s = SpecSession.with_defaults(model, select_hooks("rtx", CUDA), NGramProposer(), k=5, max_len=256)
    out = s.generate(prompt, max_tokens=20, policy=StrictGreedy())
    assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8)
