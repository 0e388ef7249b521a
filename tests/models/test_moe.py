"""The Qwen3.5 MoE hybrid (qwen3_5_moe): routing and the grouped expert product against row-by-row oracles,
checkpoint layouts (per-expert, fused, VLM-wrapped) loading to the same model, the weight formats against their
dequantized reference, the memory budget, and greedy speculative output equal to plain for every drafter.
Golden logits against transformers run with the other families in tests/models/test_golden.py (TINY_SHAPES)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from _devices import DEVICES
from quant_layouts import write_quantized
from safetensors.torch import load_file, save_file
from test_dflash import MixedProposer, make_drafter, plain_greedy, prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.drafters.mtp import MTPProposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.kernels.moe.moe import (
    group_by_expert,
    grouped_expert_product,
    moe_ref,
    route,
    stacked_expert_product,
    stacked_expert_product_ref,
)
from edgespec.loading.checkpoint import load_target
from edgespec.loading.hf_config import parse_config
from edgespec.loading.weights import checkpoint_bytes
from edgespec.memory import MemoryBudgetError
from edgespec.models.moe import RouterLinear, SparseMoE, attach_routing_log
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights.base import PackedLinear

new_session = SpecSession.with_defaults   # every knob not given takes the arch defaults

CPU = torch.device("cpu")
FAMILY = "qwen3_5_moe"


# ---- routing and the grouped product --------------------------------------------------------------------------
def test_route_matches_softmax_topk_renormalised():
    logits = torch.randn(16, 8)
    w, e = route(logits, 3)
    probs = torch.softmax(logits, -1)
    want = probs.gather(1, e)
    torch.testing.assert_close(w, want / want.sum(-1, keepdim=True))
    assert torch.equal(e, probs.topk(3, -1).indices)
    raw, _ = route(logits, 3, normalise=False)
    torch.testing.assert_close(raw, want)
    with pytest.raises(ValueError, match="top-k of 9 experts out of 8"):
        route(logits, 9)


@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_grouped_product_equals_row_by_row(rows):
    """Every touched expert runs once on all its rows, and the result equals the per-row oracle."""
    E, H = 8, 16
    mats = [torch.randn(H, H) for _ in range(E)]
    calls: list[int] = []

    def expert(i):
        def fn(x):
            calls.append(i)
            return x @ mats[i].T
        return fn

    fns = [expert(i) for i in range(E)]
    x = torch.randn(rows, H)
    w, e = route(torch.randn(rows, E), 2)
    got = grouped_expert_product(x, w, e, fns)
    touched = sorted(set(e.flatten().tolist()))
    assert calls == touched                              # once each, ascending
    assert group_by_expert(e).union == len(touched)
    torch.testing.assert_close(got, moe_ref(x, w, e, fns), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_product_equals_grouped(device, dtype):
    """Experts stacked per layer (w13 = [gate; up], w2): the stacked product (Triton on CUDA) equals the grouped
    product over the same experts as MLPs, for 1 to 64 rows, including shapes that are not multiples of a tile."""
    from edgespec.kernels.pointwise.activation import silu_mul_ref

    E, H, I, k = 8, 96, 40, 3
    gen = torch.Generator().manual_seed(2)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(device, dtype)
    fns = [lambda x, e=e: (silu_mul_ref((x.float() @ w13[e].float().T).to(dtype)).float() @ w2[e].float().T)
           for e in range(E)]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 2, 16, 64):
        x = torch.randn(rows, H, generator=gen).to(device, dtype)
        w, e = route(torch.randn(rows, E, generator=gen).to(device, dtype), k)
        want = grouped_expert_product(x.float(), w.float(), e, fns)
        torch.testing.assert_close(stacked_expert_product_ref(x, w, e, w13, w2).float(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(stacked_expert_product(x, w, e, w13, w2).float(), want, rtol=tol, atol=tol)
    if device == "cuda":
        from edgespec.kernels.moe.triton_moe import stacked_expert_product_triton
        with pytest.raises(ValueError, match="stacked experts"):
            stacked_expert_product_triton(x, w, e, w13, w2[:, :, :-1])


def test_loaded_experts_are_views_of_the_stacks(tiny_models):
    moe = tiny_models[FAMILY].model.layers[1].mlp
    assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32)
    assert moe.experts[3].gate_up_proj.weight.data_ptr() == moe.w13[3].data_ptr()
    assert moe.experts[3].down_proj.weight.data_ptr() == moe.w2[3].data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_stacked_path_spec_equals_plain(tmp_path):
    """On CUDA the stacked Triton path serves the model: logits close to the CPU model's, and greedy speculative
    output equal to plain (fp32, n-gram and oracle drafts, every rollback). Head dim 64: the Triton attention's."""
    cuda = torch.device("cuda")
    path = write_random_checkpoint(tmp_path / "m", tiny_config(FAMILY, head_dim=64), seed=7)
    model = load_target(path, device=cuda, max_positions=256)
    cpu_model = load_target(path, max_positions=256)
    assert model.model.layers[0].mlp.w13.is_cuda
    check_cuda_model(model, cpu_model, "base")


def check_cuda_model(model, cpu_model, plain_arch: str) -> None:
    """A CUDA model's logits close to its CPU twin's (fp32), and greedy speculative output equal to plain
    (``plain_arch``'s hooks) for n-gram and oracle drafts under every rollback, with the expert union reported."""
    cuda = torch.device("cuda")
    ids = torch.tensor(prompt_ids(320, n=20))
    got = model.forward(ids.to(cuda), model.new_cache(64)).logits.cpu()
    want = cpu_model.forward(ids, cpu_model.new_cache(64)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    prompt = prompt_ids(320, n=21, seed=6)
    plain = new_session(model, select_hooks(plain_arch, cuda), None, kv_fp8=False, max_len=128).generate(
        prompt, max_tokens=16, policy=StrictGreedy()).token_ids
    for rollback, kind in itertools.product(ROLLBACK_STRATEGIES, ("ngram", "oracle")):
        prop = NGramProposer() if kind == "ngram" else OracleProposer(plain, 320, seed=len(rollback))
        s = new_session(model, select_hooks("rtx", cuda), prop, k=5, kv_fp8=False, rollback=rollback, max_len=128)
        out = s.generate(prompt, max_tokens=16, policy=StrictGreedy())
        assert out.token_ids == plain, (rollback, kind)
        assert out.telemetry.expert_union


# ---- config ---------------------------------------------------------------------------------------------------
def test_config_fields_and_refusals():
    cfg = parse_config(tiny_config(FAMILY))
    assert cfg.is_moe and cfg.family == "qwen3_5" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.intermediate_size == cfg.shared_expert_intermediate_size == 48
    for other in ("qwen3_moe", "mixtral"):
        with pytest.raises(UnsupportedModelError, match="mixture-of-experts.*qwen3_5_moe"):
            parse_config({**tiny_config("qwen3"), "model_type": other})
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):     # experts under a dense type
        parse_config({**tiny_config("qwen3_5"), "num_experts": 8})
    bad = tiny_config(FAMILY)
    del bad["num_experts_per_tok"]
    with pytest.raises(CheckpointError, match="missing required field.*num_experts_per_tok"):
        parse_config(bad)
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 exceeds num_experts 8"):
        parse_config(tiny_config(FAMILY, num_experts_per_tok=9))


# ---- layouts --------------------------------------------------------------------------------------------------
def _fuse(src, dst, prefix="model."):
    """Rewrite a per-expert checkpoint with fused ``experts.gate_up_proj`` / ``experts.down_proj`` per layer."""
    t = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    E = cfg["num_experts"]
    out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    bases = sorted({k.split(".mlp.experts.")[0] for k in t if ".mlp.experts." in k})
    for b in bases:
        out[f"{b}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([t[f"{b}.mlp.experts.{e}.gate_proj.weight"], t[f"{b}.mlp.experts.{e}.up_proj.weight"]])
             for e in range(E)])
        out[f"{b}.mlp.experts.down_proj"] = torch.stack([t[f"{b}.mlp.experts.{e}.down_proj.weight"]
                                                         for e in range(E)])
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, out


def test_fused_and_vlm_layouts_load_identically(tiny_checkpoints, tiny_models, tmp_path):
    ref = tiny_models[FAMILY]
    ids = torch.randint(0, 320, (30,))
    want = ref.forward(ids, ref.new_cache(32)).logits
    fused, _ = _fuse(tiny_checkpoints[FAMILY], tmp_path / "fused")
    model = load_target(fused, max_positions=1024)
    assert model.mtp is not None                        # fused MTP experts split too
    assert torch.equal(model.forward(ids, model.new_cache(32)).logits, want)
    # The VLM wrapper: text under text_config, keys under model.language_model., sharded.
    cfg = tiny_config(FAMILY)
    vlm = {"model_type": "qwen3_5_moe", "text_config": dict(cfg, model_type="qwen3_5_moe_text"),
           "tie_word_embeddings": False}
    path = write_random_checkpoint(tmp_path / "vlm", cfg, seed=7, prefix="model.language_model.", shards=3,
                                   with_mtp=True)
    (path / "config.json").write_text(json.dumps(vlm))
    model = load_target(path, max_positions=1024)
    assert torch.equal(model.forward(ids, model.new_cache(32)).logits, want)


def test_fused_layout_bad_input(tiny_checkpoints, tmp_path):
    folder, tensors = _fuse(tiny_checkpoints[FAMILY], tmp_path / "bad")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    full = tensors[key]
    tensors[key] = full[:7].contiguous()                              # one expert short of the config
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts.gate_up_proj .* shape \[7, 64, 64\], expected \[8, 64, 64\]"):
        load_target(folder)
    tensors[key] = full
    tensors["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="both fused and as its own tensor"):
        load_target(folder)


# ---- weight formats and the memory budget ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "awq", "gptq"])
def test_quantized_experts_match_dequantized_reference(tiny_checkpoints, tmp_path, fmt):
    dense = write_random_checkpoint(tmp_path / "dense", tiny_config(FAMILY), seed=3)
    qdir, rdir = write_quantized(dense, tmp_path / "q", tmp_path / "r", fmt, group=16, seed=1)
    model, ref = load_target(qdir, max_positions=64), load_target(rdir, max_positions=64)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    expert = moe.experts[5]
    assert all(isinstance(m, PackedLinear) for m in (getattr(expert, "gate_up_proj", None) or expert.gate_proj,
                                                      expert.down_proj))
    assert isinstance(moe.gate, RouterLinear) and moe.gate.weight.dtype == torch.float32
    toks = torch.tensor(prompt_ids(320, n=12))
    # The packed product rounds in another order than the dense matmul; the random hybrid's depth amplifies that
    # to ~3e-4 (as merged vs unmerged projections in test_golden). A wrong expert or scale differs by O(1).
    torch.testing.assert_close(model.forward(toks, model.new_cache(64)).logits,
                               ref.forward(toks, ref.new_cache(64)).logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "nvfp4"])
def test_quantize_command_handles_experts(tiny_checkpoints, tmp_path, fmt):
    """``edgespec quantize`` packs every expert (fused source too), keeps the router and shared gate in float,
    and the result loads and decodes."""
    from edgespec.cli import main

    fused, _ = _fuse(tiny_checkpoints[FAMILY], tmp_path / "fused")
    assert main(["quantize", str(fused), str(tmp_path / fmt), "--format", fmt, "--group-size", "16"]) == 0
    keys = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in keys or \
        "model.layers.2.mlp.experts.7.down_proj.qweight" in keys
    assert keys["model.layers.2.mlp.gate.weight"].dtype == torch.float32
    assert keys["model.layers.2.mlp.shared_expert_gate.weight"].dtype == torch.float32
    model = load_target(tmp_path / fmt, max_positions=64)
    experts = [m for n, m in model.named_modules() if isinstance(m, PackedLinear) and ".experts." in n]
    assert len(experts) >= 6 * 8                           # every routed expert of every layer packed
    logits = model.forward(torch.tensor(prompt_ids(320, n=8)), model.new_cache(64)).logits
    assert torch.isfinite(logits).all()


def test_budget_counts_every_expert_and_refuses_with_numbers(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints[FAMILY]
    model = load_target(path, max_positions=64)
    # Every expert lives in memory: the budget's weights are the checkpoint's tensors (fp32 both) minus the MTP
    # head's share, which the model keeps too -- so they are equal.
    assert model.memory_budget.weights == checkpoint_bytes(path)
    routed = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    monkeypatch.setattr("edgespec.memory.available_bytes", lambda device: model.memory_budget.total - routed // 2)
    with pytest.raises(MemoryBudgetError, match=r"does not fit cpu: weights .* MiB \+ kv .*; free on cpu"):
        load_target(path, max_positions=64)


# ---- speculative decoding: lossless for every drafter and rollback -------------------------------------------
def test_greedy_spec_equals_plain_ngram_and_oracle(tiny_models):
    model = tiny_models[FAMILY]
    prompt = prompt_ids(320, n=21, seed=6)
    n = 20
    plain = plain_greedy(model, prompt, n)
    for arch, rollback, kind in itertools.product(("base", "thor"), ROLLBACK_STRATEGIES, ("ngram", "oracle")):
        prop = NGramProposer() if kind == "ngram" else OracleProposer(plain, 320, seed=len(rollback))
        s = new_session(model, select_hooks(arch, CPU), prop, k=5, kv_fp8=False, rollback=rollback, max_len=128)
        out = s.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, (arch, rollback, kind)
        if kind == "oracle":
            assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens


def test_greedy_mtp_and_dflash_equal_plain(tiny_models, tiny_checkpoints, tmp_path):
    model = tiny_models[FAMILY]
    assert model.mtp is not None and isinstance(model.mtp.layers[0].mlp, SparseMoE)
    prompt = prompt_ids(320, n=17, seed=8)
    n = 16
    plain = plain_greedy(model, prompt, n)
    for rollback in ROLLBACK_STRATEGIES:
        mtp = MixedProposer(MTPProposer(model, max_len=128), plain, 320, seed=len(rollback))
        out = new_session(model, select_hooks("base", CPU), mtp, k=3, rollback=rollback, max_len=128).generate(
            prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, rollback
        assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
    own = new_session(model, select_hooks("base", CPU), MTPProposer(model, max_len=128), max_len=128)
    assert own.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids == plain
    drafter = make_drafter.write_dflash_drafter(tmp_path / "dflash", tiny_checkpoints[FAMILY], seed=1, num_layers=1,
                                                block_size=5, target_layer_ids=[1, 3])
    prop = MixedProposer(load_dflash_checkpoint(drafter, model, window_size=8), plain, 320, seed=3)
    out = new_session(model, select_hooks("base", CPU), prop, max_len=128).generate(
        prompt, max_tokens=n, policy=StrictGreedy())
    assert out.token_ids == plain


# ---- routing telemetry ----------------------------------------------------------------------------------------
def test_routing_log_and_bytes_per_forward(tiny_models):
    from edgespec.bench.gpu import weight_bytes_per_token
    from edgespec.bench.moe import expert_bytes

    model = tiny_models[FAMILY]
    log = attach_routing_log(model)
    log.clear()
    try:
        cache = model.new_cache(128)
        model.prefill(torch.randint(0, 320, (70,)), cache)      # more rows than the log keeps: not recorded
        model.decode(torch.tensor([4]), cache)
        model.forward(torch.randint(0, 320, (6,)), cache)
    finally:
        for block in model.modules():
            if isinstance(block, SparseMoE):
                block.routing_log = None
    assert log.mean_union(1) == 2                          # one row reads exactly its k experts per layer
    assert log.layer_calls(6) == 6 and 2 <= log.mean_union(6) <= 8 and log.layer_calls(70) == 0
    sizes = expert_bytes(model, weight_bytes_per_token(model))
    per_expert = sum(p.numel() * 4 for p in model.model.layers[0].mlp.experts[0].parameters())
    assert sizes.per_expert == per_expert and sizes.layers == 6 and sizes.top_k == 2
    assert sizes.decode == sizes.per_forward(2.0) < sizes.per_forward(log.mean_union(6))
    assert attach_routing_log(tiny_models["qwen3_5"]) is None


def test_session_telemetry_reports_expert_union(tiny_models):
    model = tiny_models[FAMILY]
    prompt = prompt_ids(320, n=21, seed=6)
    plain = plain_greedy(model, prompt, 12)
    s = new_session(model, select_hooks("base", CPU), OracleProposer(plain, 320, seed=1), k=4, kv_fp8=False,
                    max_len=128)
    tel = s.generate(prompt, max_tokens=12, policy=StrictGreedy()).telemetry
    assert tel.expert_union and max(tel.expert_union) <= 5 and 5 in tel.expert_union
    assert all(2 <= u <= 8 for u in tel.expert_union.values())
    assert tel.to_dict()["expert_union"] == {str(r): u for r, u in tel.expert_union.items()}
    assert "experts@5=" in tel.summary()
    dense = new_session(tiny_models["qwen3_5"], select_hooks("base", CPU), NGramProposer(), k=4, max_len=128)
    assert "expert_union" not in dense.generate(prompt, max_tokens=4, policy=StrictGreedy()).telemetry.to_dict()


def test_bench_shape_reports_moe_bytes_from_routing(monkeypatch):
    """The shape bench of an MoE model: decode limit from k experts per layer, each verify's limit from the union
    its routing touched (CPU, a small MoE shape; the figures are checked for consistency, not speed)."""
    from edgespec.bench import gpu
    from edgespec.bench.shapes import SHAPES, TINY_SHAPES

    monkeypatch.setitem(SHAPES, "tiny-moe", dict(TINY_SHAPES[FAMILY], mtp_num_hidden_layers=0))
    from edgespec.bench.timing import time_cuda
    monkeypatch.setattr(gpu, "time_cuda", lambda fn, **kw: time_cuda(fn, iters=2, warmup=1, repeats=1))
    r = gpu.bench_shape("tiny-moe", device=CPU, dtype=torch.float32, arch="base", context=24, verify_rows=(4,),
                        prefill_lengths=(), graphs=False, bandwidth=1e10)
    moe = r["moe"]
    assert moe["layers"] == 6 and moe["top_k"] == 2
    assert r["weight_GB"] == pytest.approx(moe["dense_GB"] + 6 * 2 * moe["per_expert_MB"] / 1e3)
    assert r["weight_GB"] < moe["all_weights_GB"]
    v = r["verify"][4]
    assert 2 <= v["expert_union"] <= 8 and v["limit_ms"] > r["decode_limit_ms"] * 0.99
