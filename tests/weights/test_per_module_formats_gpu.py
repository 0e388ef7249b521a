"""compressed-tensors and ModelOpt MIXED_PRECISION checkpoints on CUDA: the arch hooks give their int4 / NVFP4
layers the Triton products (per-channel FP8 keeps the torch reference), logits agree with the reference
product, and greedy speculative output equals plain output to the bf16 standard of ``speculative.parity``.
Skipped without CUDA (and without compressed-tensors for its checkpoints)."""

from __future__ import annotations

import pytest
import torch
from quant_layouts import write_modelopt_mixed
from test_dflash import prompt_ids

from edgespec.arch.detect import select_hooks
from edgespec.drafters.ngram import NGramProposer
from edgespec.loading.checkpoint import load_target
from edgespec.loading.synthetic import tiny_config, write_random_checkpoint
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
CT = ("int4-g32-sym", "int4-g64-asym", "int4-g128-sym", "nvfp4", "mixed")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_module_gpu")
    dense = write_random_checkpoint(root / "q35", tiny_config("qwen3_5", **WIDE), seed=21)
    made = {"modelopt": write_modelopt_mixed(dense, root / "mo", root / "mo-ref", seed=3)[0]}
    try:
        from ct_layouts import write_ct
    except ImportError:
        return made
    for scheme in CT:
        made[scheme] = write_ct(dense, root / scheme, root / f"{scheme}-ref", scheme)[0]
    return made


@pytest.mark.parametrize("name", ("modelopt", *CT))
def test_kernels_chosen_logits_agree_and_speculation_stays_lossless(folders, name):
    if name not in folders:
        pytest.skip("compressed-tensors is not installed")
    model = load_target(folders[name], dtype=torch.bfloat16, device=CUDA, max_positions=256)
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    hooks = select_hooks("rtx", CUDA)
    chosen = hooks.choose_weight_kernels(model)
    if name != "modelopt":          # the ModelOpt file's attention is per-tensor FP8: reference products
        assert chosen * 2 > len(packed), (chosen, len(packed))
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
    plain = SpecSession(model, hooks, None, max_len=256).generate(prompt, max_tokens=20,
                                                                  policy=StrictGreedy()).token_ids
    s = SpecSession(model, select_hooks("rtx", CUDA), NGramProposer(), k=5, max_len=256)
    out = s.generate(prompt, max_tokens=20, policy=StrictGreedy())
    assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8)
