"""On CUDA: graph-captured decode/verify (rtx/thor hooks) keep greedy speculative output equal to plain output."""

from __future__ import annotations

import pytest
import torch

from edgespec.arch.rollback import ROLLBACK_STRATEGIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_graph_spec_equals_plain_on_cuda(tmp_path, family, dtype):
    from edgespec.arch.detect import select_hooks
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.drafters.ngram import NGramProposer
    from edgespec.loading.checkpoint import load_target
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.parity import lossless
    from edgespec.speculative.session import SpecSession

    cfg = tiny_config(family, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    path = write_random_checkpoint(tmp_path / family, cfg, seed=3)
    model = load_target(path, dtype=dtype, device="cuda", max_positions=512)
    dev = torch.device("cuda")
    motif = torch.randint(0, 320, (10,)).tolist()
    prompt = motif * 5
    for kv_fp8 in (False, True):
        plain = SpecSession.with_defaults(model, select_hooks("rtx", dev), None, kv_fp8=kv_fp8, max_len=256,
                                          cuda_graphs=False).generate(prompt, max_tokens=40, policy=StrictGreedy())
        for arch in ("rtx", "thor"):
            for rollback in ROLLBACK_STRATEGIES:
                graphed = SpecSession.with_defaults(model, select_hooks(arch, dev), NGramProposer(), k=7, kv_fp8=kv_fp8,
                                                    rollback=rollback, max_len=256, cuda_graphs=True)
                assert graphed.hooks.static[8].graph is not None
                out = graphed.generate(prompt, max_tokens=40, policy=StrictGreedy())
                # fp32: exact; bf16: equal, or a tie flip at the first divergence (edgespec.speculative.parity).
                assert lossless(model, prompt, plain.token_ids, out.token_ids, kv_fp8), (arch, rollback, kv_fp8)


def test_fp8_decode_over_a_long_cache_runs_the_gluon_program_losslessly(tmp_path, monkeypatch):
    """A graphed plain decode over an FP8 cache of 8192 rows takes the Gluon decode program (its grid is sized for
    the cache: edgespec.kernels.attention.triton_attention.GLUON_MIN_KEYS); greedy output equals the eager session's,
    whose short grids take the Triton program."""
    from edgespec.arch.detect import select_hooks
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.kernels.attention import triton_attention
    from edgespec.loading.checkpoint import load_target
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.parity import lossless
    from edgespec.speculative.session import SpecSession

    if triton_attention.gluon_attention_fp8 is None:
        pytest.skip("this Triton has no Gluon")
    cfg = tiny_config("qwen3_5", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    path = write_random_checkpoint(tmp_path / "m", cfg, seed=5)
    model = load_target(path, dtype=torch.bfloat16, device="cuda", max_positions=8192)
    dev = torch.device("cuda")
    prompt = torch.randint(0, 320, (300,)).tolist()
    calls = []
    real = triton_attention._gluon_decode
    monkeypatch.setattr(triton_attention, "_gluon_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    eager = SpecSession.with_defaults(model, select_hooks("rtx", dev), None, kv_fp8=True, max_len=512,
                                      cuda_graphs=False).generate(prompt, max_tokens=40, policy=StrictGreedy())
    assert not calls
    graphed = SpecSession.with_defaults(model, select_hooks("rtx", dev), None, kv_fp8=True, max_len=8192,
                                        cuda_graphs=True).generate(prompt, max_tokens=40, policy=StrictGreedy())
    assert calls                                       # captured (and warmed up) through the Gluon program
    assert lossless(model, prompt, eager.token_ids, graphed.token_ids, True)
