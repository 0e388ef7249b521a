"""DFlash drafter: checkpoint loading (both config layouts, both key prefixes, sliding layers, every mismatch),
the per-token window (one feature per committed token, in order, after every cycle), parity of the cached
windowed block forward with a naive full recompute, and the losslessness gate with DFlash drafting.

Random drafters on random targets almost never agree with the target, so the gate and the parity tests wrap the
real proposer: its block forward and window run every cycle, but the drafts it hands the session are the known
plain continuation with one corrupted token, which forces partial accepts of every length.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _devices import DEVICES
from _plans import dflash_from, proposer_from
from safetensors.torch import load_file, save_file

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench import random_drafter as make_drafter
from edgespec.config import Settings
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.dflash import (
    DFlashDraftModel,
    DFlashProposer,
    default_target_layer_ids,
    load_dflash_checkpoint,
    parse_dflash_config,
)
from edgespec.drafters.window import FeatureWindow
from edgespec.errors import CheckpointError, ConfigError
from edgespec.kernels.attention.block_attention import block_attention, block_attention_ref
from edgespec.kernels.attention.rope import head_norm_rope
from edgespec.models.layers import RMSNorm
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


# ---- shared helpers (also used by test_mtp.py) ----------------------------------------------------------------
class MixedProposer(Proposer):
    """Runs a real proposer every cycle but hands the session the plain continuation with one random token
    corrupted (or none), so partial accepts of every length happen. ``check(stage, inner, history)`` runs after
    every propose and commit."""

    def __init__(self, inner: Proposer, continuation: Sequence[int], vocab: int, seed: int = 0,
                 check: Callable[[str, Proposer, list[int]], None] | None = None) -> None:
        self.inner, self.continuation, self.vocab = inner, list(continuation), vocab
        self.name, self.taps = inner.name, inner.taps
        self.default_k, self.max_k = inner.default_k, inner.max_k
        self.rng = random.Random(seed)
        self.check = check
        self.history: list[int] = []
        self.emitted = 0

    def begin(self, prompt_ids, prefill) -> None:
        self.inner.begin(prompt_ids, prefill)
        self.history, self.emitted = list(prompt_ids), 0

    def propose(self, last_token: int, k: int) -> Draft | None:
        real = self.inner.propose(last_token, k)
        if self.check is not None:
            self.check("propose", self.inner, self.history)
        future = self.continuation[self.emitted:self.emitted + real.tokens.shape[0]]
        if not future:
            return None
        bad = self.rng.randrange(len(future) + 1)
        if bad < len(future):
            future[bad] = (future[bad] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return Draft(torch.tensor(future, dtype=torch.long))

    def commit(self, tokens, accepted, verify, drafted=0) -> None:
        self.inner.commit(tokens, accepted, verify, drafted)
        self.history.extend(tokens)
        self.emitted += len(tokens)
        if self.check is not None:
            self.check("commit", self.inner, self.history)


def plain_greedy(model, prompt, n, kv_fp8=False):
    s = SpecSession.with_defaults(model, select_hooks("base", CPU), None, kv_fp8=kv_fp8, max_len=256)
    return s.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids


def prompt_ids(vocab: int, n: int = 23, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (6,), generator=g).tolist()
    return (motif * 2 + torch.randint(0, vocab, (n,), generator=g).tolist())[:n]


# ---- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafters(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Random drafters for the tiny targets: sliding + full layers on qwen3_5 (published-like), a full-attention
    one on qwen3 with the ``model.`` prefix and top-level keys, and one shipping its own embedding and head."""
    root = tmp_path_factory.mktemp("dflash")
    w = make_drafter.write_dflash_drafter
    return {
        "qwen3_5": w(root / "q35", tiny_checkpoints["qwen3_5"], seed=1, num_layers=2, block_size=6,
                     target_layer_ids=[1, 3, 5], sliding_layers=1, sliding_window=5),
        "qwen3": w(root / "q3", tiny_checkpoints["qwen3"], seed=2, num_layers=2, block_size=5,
                   target_layer_ids=[0, 2], layout="top", prefix="model."),
        "own": w(root / "own", tiny_checkpoints["qwen3"], seed=3, num_layers=1, block_size=4,
                 target_layer_ids=[2, 1], own_embed=True, own_lm_head=True),
    }


def _variant(tmp_path: Path, base: Path, cfg_edit=None, tensor_edit=None) -> Path:
    """A copy of drafter ``base`` with its config and/or tensors edited."""
    out = tmp_path / "variant"
    shutil.copytree(base, out)
    if cfg_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if tensor_edit is not None:
        tensors = load_file(str(out / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


# ---- window ---------------------------------------------------------------------------------------------------
def test_feature_window_ring():
    w = FeatureWindow(4, 3, n_layers=2, n_kv_heads=1, head_dim=2, dtype=torch.float32, device=CPU,
                      scratch_rows=2)
    feats = torch.arange(30, dtype=torch.float32).view(10, 3)
    kv = torch.arange(40, dtype=torch.float32).view(1, 10, 1, 4).expand(2, -1, -1, -1)[..., :2]
    w.append(7, feats[:2], kv[:, :2], kv[:, :2])                 # positions 7, 8
    assert w.ordered_positions() == [7, 8] and w.length == 2 and w.end == 9
    w.append(9, feats[2:5], kv[:, 2:5], kv[:, 2:5])              # 9, 10, 11: wraps, drops 7
    assert w.ordered_positions() == [8, 9, 10, 11]
    assert torch.equal(w.ordered_features(), feats[1:5])
    assert sorted(w.positions.tolist()) == [8, 9, 10, 11]
    w.append(12, feats[:6], kv[:, :6], kv[:, :6])                # more rows than capacity: newest 4 survive
    assert w.ordered_positions() == [14, 15, 16, 17] and torch.equal(w.ordered_features(), feats[2:6])
    assert w.keys.shape[1] == 6                                  # ring + scratch rows
    with pytest.raises(ValueError, match="contiguous"):
        w.append(20, feats[:1], kv[:, :1], kv[:, :1])
    w.reset()
    assert w.length == 0 and (w.positions == -1).all()


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]       # Qwen3-4B/8B drafters
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]       # Qwen3.5-4B drafter
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]      # Qwen3.6-27B drafter
    assert default_target_layer_ids(64, 1) == [32]


# ---- loading --------------------------------------------------------------------------------------------------
def test_parse_published_config_shapes():
    """The published layouts: Qwen3.6-27B-like (nested ids, rope_parameters, 4 sliding + 1 full) and Qwen3-8B-like
    (top-level rope_theta, no layer_types, taps left to the fallback rule)."""
    q36 = {"architectures": ["DFlashDraftModel"], "block_size": 16, "hidden_size": 5120, "intermediate_size": 17408,
           "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
           "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}, "num_target_layers": 64,
           "vocab_size": 248320, "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}}
    cfg = parse_dflash_config(q36, target_layers=64)
    assert (cfg.block_size, cfg.mask_token_id, cfg.rope_theta, cfg.rope_scaling) == (16, 248070, 1e7, None)
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.sliding_window == 2048
    assert [cfg.layer_causal(i) for i in range(5)] == [True] * 4 + [False]
    assert [cfg.layer_window(i) for i in range(5)] == [2048] * 4 + [None]
    q3 = {"block_size": 16, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000,
          "mask_token_id": 151669, "num_target_layers": 36}
    cfg = parse_dflash_config(q3, target_layers=36)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and not cfg.target_layer_ids_from_config
    assert cfg.layer_types == ["full_attention"] * 5 and not any(cfg.layer_causal(i) for i in range(5))


@pytest.mark.parametrize("layout,prefix", [("nested", ""), ("nested", "model."), ("top", ""), ("top", "model.")])
def test_load_layouts_and_prefixes(tiny_models, tiny_checkpoints, tmp_path, layout, prefix):
    target = tiny_models["qwen3_5"]
    folder = make_drafter.write_dflash_drafter(tmp_path / "d", tiny_checkpoints["qwen3_5"], seed=4, num_layers=3,
                                               block_size=8, target_layer_ids=[5, 0], sliding_layers=2,
                                               sliding_window=7, layout=layout, prefix=prefix, mask_token_id=300)
    raw = json.loads((folder / "config.json").read_text())
    assert ("dflash_config" in raw) == (layout == "nested")
    prop = load_dflash_checkpoint(folder, target, window_size=16)
    cfg = prop.cfg
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 300, [5, 0])
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert [layer.causal for layer in prop.drafter.layers] == [True, True, False]
    assert [layer.sliding_window for layer in prop.drafter.layers] == [7, 7, None]
    assert prop.taps == (5, 0) and prop.default_k == prop.max_k == 7
    weights = load_file(str(folder / "model.safetensors"))
    attn = prop.drafter.layers[1].self_attn
    assert torch.equal(attn.k_norm.weight, weights[f"{prefix}layers.1.self_attn.k_norm.weight"])
    # q/k/v load under the checkpoint's names, then run as one merged projection.
    qkv = torch.cat([weights[f"{prefix}layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv) and not hasattr(attn, "q_proj")
    assert torch.equal(prop.drafter.fc.weight, weights[f"{prefix}fc.weight"])
    # Borrowed embedding and head: the target's own tensors, not copies.
    assert prop._embed_weight is target.model.embed_tokens.weight and prop._head_weight is target.lm_head_weight


def test_load_own_embed_and_head_and_ignored_keys(tiny_models, drafters, tmp_path):
    target = tiny_models["qwen3"]
    folder = _variant(tmp_path, drafters["own"],
                      tensor_edit=lambda t: t.update({"rotary_emb.inv_freq": torch.ones(8)}))
    prop = load_dflash_checkpoint(folder, target)
    weights = load_file(str(folder / "model.safetensors"))
    assert torch.equal(prop.drafter.embed_tokens.weight, weights["embed_tokens.weight"])
    assert prop._head_weight is prop.drafter.lm_head.weight
    assert prop.taps == (2, 1) and prop._tap_order is None


def test_tap_fallback_rule(tiny_models, tiny_checkpoints, tmp_path):
    folder = make_drafter.write_dflash_drafter(tmp_path / "d", tiny_checkpoints["qwen3_5"], num_layers=2,
                                               block_size=4, write_layer_ids=False)
    prop = load_dflash_checkpoint(folder, tiny_models["qwen3_5"])
    assert prop.cfg.target_layer_ids == default_target_layer_ids(6, 2) == [1, 3]
    assert not prop.cfg.target_layer_ids_from_config


def _set(path: str, value):
    def edit(cfg):
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return edit


_DELETE = object()


@pytest.mark.parametrize("cfg_edit,tensor_edit,error,match", [
    (_set("hidden_size", 96), None, ConfigError, "hidden_size 96"),
    (_set("vocab_size", 151936), None, ConfigError, "vocab_size 151936"),
    (_set("dflash_config.mask_token_id", 320), None, ConfigError, "mask_token_id 320"),
    (_set("dflash_config.target_layer_ids", [1, 6, 5]), None, ConfigError, r"\[6\]"),
    (_set("num_target_layers", 64), None, ConfigError, "64 layers"),
    (_set("dflash_config.mask_token_id", _DELETE), None, CheckpointError, "mask_token_id"),
    (_set("sliding_window", None), None, CheckpointError, "sliding_window"),
    (_set("dflash_config.target_layer_ids", [1, 3]), None, CheckpointError, "fc.weight.*2 taps"),
    (None, lambda t: t.pop("layers.1.mlp.up_proj.weight"), CheckpointError, "missing key.*layers.1.mlp.up_proj"),
    (None, lambda t: t.update({"candidate_selector.x": torch.ones(2)}), CheckpointError,
     "unexpected key.*candidate_selector"),
    (None, lambda t: t.update({"norm.weight": torch.ones(65)}), CheckpointError, "norm.weight.*65"),
])
def test_mismatch_errors(tiny_models, drafters, tmp_path, cfg_edit, tensor_edit, error, match):
    folder = _variant(tmp_path, drafters["qwen3_5"], cfg_edit, tensor_edit)
    with pytest.raises(error, match=match):
        load_dflash_checkpoint(folder, tiny_models["qwen3_5"])


def test_missing_files(tiny_models, drafters, tmp_path):
    target = tiny_models["qwen3_5"]
    with pytest.raises(CheckpointError, match="not found"):
        load_dflash_checkpoint(tmp_path / "nowhere", target)
    folder = _variant(tmp_path, drafters["qwen3_5"])
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_dflash_checkpoint(folder, target)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_dflash_checkpoint(folder, target)


def test_settings_and_factory(tiny_models, drafters):
    target = tiny_models["qwen3_5"]
    with pytest.raises(ConfigError, match="drafter_path"):
        proposer_from(Settings(drafter="dflash"), target)
    with pytest.raises(ConfigError, match="num_draft_tokens 9"):
        dflash_from(Settings(drafter="dflash", drafter_path=str(drafters["qwen3_5"]), num_draft_tokens=9), target)
    prop = proposer_from(Settings(drafter="dflash", drafter_path=str(drafters["qwen3_5"]), window_size=7,
                                   window_seed=False, cuda_graphs=True, lookup_min_match=0), target)
    assert isinstance(prop, DFlashProposer) and prop.window_size == 7 and not prop.window_seed and prop.cuda_graphs
    for arch in ("base", "thor"):
        prop = proposer_from(Settings(drafter="dflash", drafter_path=str(drafters["qwen3_5"]), arch=arch,
                                       lookup_min_match=0), target)
        defaults = select_hooks(arch, CPU).defaults
        assert (prop.window_seed, prop.cuda_graphs, prop.window_size) == (defaults.window_seed,
                                                                          defaults.cuda_graphs, 128)
        assert defaults.window_size == 128


def test_make_drafter_cli(tiny_checkpoints, tiny_models, tmp_path):
    out = tmp_path / "cli"
    assert make_drafter.main(["dflash", "--target", str(tiny_checkpoints["qwen3"]), "--out", str(out),
                              "--layers", "2", "--block-size", "4", "--sliding", "1", "--sliding-window", "3",
                              "--taps", "0,2", "--prefix", "model.", "--dtype", "float32"]) == 0
    prop = load_dflash_checkpoint(out, tiny_models["qwen3"])
    assert prop.cfg.layer_types == ["sliding_attention", "full_attention"] and prop.taps == (0, 2)


# ---- parity with a naive full recompute ------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _reference_mask(q_len: int, k_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """The reference implementation's mask, in key-index space (keys = context then block, contiguous)."""
    q_idx = k_len - q_len + torch.arange(q_len)[:, None]
    k_idx = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        visible &= k_idx <= q_idx
    if window is not None:
        visible &= q_idx - k_idx < window
        if not causal:
            visible &= k_idx - q_idx < window
    return visible


def checkpoint_drafter(prop: DFlashProposer, folder: Path) -> DFlashDraftModel:
    """The drafter as its checkpoint stores it, read straight from the file: separate q/k/v and gate/up
    projections, nothing merged or fused (the layout the drafter ran in before the projections were merged)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update({k.removeprefix("model."): v for k, v in load_file(str(path)).items() if "rotary_emb" not in k})
    embed = tensors["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in tensors else None
    head = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
    ref = DFlashDraftModel(prop.cfg, prop.target.config.hidden_size, embed, head)
    ref.load_state_dict(tensors, strict=True)
    return ref.to(prop.dtype).eval().requires_grad_(False)


def naive_block_hidden(prop: DFlashProposer, ref: DFlashDraftModel, feats: torch.Tensor, ctx_start: int,
                       anchor: int) -> torch.Tensor:
    """Recompute the block from scratch with the checkpoint-layout drafter ``ref`` over context features ``feats``
    at positions ``ctx_start ..``: K/V of context and block together, RoPE from its formula, GQA by repeating
    heads, explicit softmax."""
    raw = dataclasses.asdict(prop.cfg)
    bs, n = raw["block_size"], feats.shape[0]
    nh, nkv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    emb = ref.embed_tokens if ref.embed_tokens is not None else prop.target.model.embed_tokens
    h = emb(torch.tensor([anchor] + [raw["mask_token_id"]] * (bs - 1)))
    pos = torch.arange(ctx_start, ctx_start + n + bs, dtype=torch.float64)
    inv = 1.0 / raw["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    for i, layer in enumerate(ref.layers):
        a = layer.self_attn
        sliding = raw["layer_types"][i] == "sliding_attention"
        x = layer.input_layernorm(h)
        kv_in = torch.cat([feats, x])
        q = a.q_norm(a.q_proj(x).view(bs, nh, hd))
        k = a.k_norm(a.k_proj(kv_in).view(n + bs, nkv, hd))
        v = a.v_proj(kv_in).view(n + bs, nkv, hd)
        q = q * cos[-bs:] + _rotate_half(q) * sin[-bs:]
        k = k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        mask = _reference_mask(bs, n + bs, causal=sliding, window=raw["sliding_window"] if sliding else None)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + a.o_proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(bs, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return ref.norm(h)


def reference_features(prop: DFlashProposer, history: list[int], end: int, count: int) -> torch.Tensor:
    """Context features of positions ``end-count .. end-1`` from a plain target forward over history[:end]."""
    model = prop.target
    cache = model.new_cache(end + 8)
    taps = model.prefill(torch.tensor(history[:end]), cache, taps=prop.cfg.target_layer_ids).taps
    with torch.inference_mode():
        return prop.drafter.context_features(taps[end - count:end])


def window_checker(seed_rows: int, ref: DFlashDraftModel, atol: float = 2e-4):
    """Checks the window after every commit and the block forward after every propose (against the
    checkpoint-layout drafter ``ref``)."""
    stats = {"commits": 0, "proposes": 0, "wrapped": False}

    def check(stage: str, prop: DFlashProposer, history: list[int]) -> None:
        w = prop.window
        end = w.end
        assert prop.history == history and len(history) == end + 1   # the pending anchor has no feature yet
        first = stats.setdefault("first", end - seed_rows)          # position of the first feature ever stored
        expected_len = min(w.capacity, end - first)
        assert w.length == expected_len
        assert w.ordered_positions() == list(range(end - expected_len, end))
        assert prop.window_tokens() == history[end - expected_len:end]
        feats_ref = reference_features(prop, history, end, expected_len)
        assert torch.allclose(w.ordered_features(), feats_ref, atol=atol), (stage, end)
        stats["wrapped"] |= end - first > w.capacity
        if stage == "propose":
            stats["proposes"] += 1
            got = prop.block_hidden(history[-1])
            want = naive_block_hidden(prop, ref, feats_ref, end - expected_len, history[-1])
            assert torch.allclose(got, want, atol=atol), (end, (got - want).abs().max())
            k = prop.last_logits.shape[0]
            assert torch.allclose(prop.last_logits, prop.logits(want[1:1 + k]), atol=10 * atol)
        else:
            stats["commits"] += 1

    return check, stats


@pytest.mark.parametrize("family,drafter,window,seed,k,graphs", [
    ("qwen3_5", "qwen3_5", 6, True, 5, False),     # ring wraps every few cycles; sliding window 5 < W + bs
    ("qwen3_5", "qwen3_5", 6, True, 5, True),      # the same through the device-position (graph-mode) path
    ("qwen3_5", "qwen3_5", 64, False, 3, False),   # unseeded: the window grows from the last prompt token; K < bs-1
    ("qwen3", "own", 9, True, 3, True),            # own embedding/head, taps in non-sorted order
])
def test_window_and_block_parity(tiny_models, drafters, family, drafter, window, seed, k, graphs):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=13)
    plain = plain_greedy(model, prompt, 24)
    prop = load_dflash_checkpoint(drafters[drafter], model, window_size=window, window_seed=seed, cuda_graphs=graphs)
    check, stats = window_checker(min(window, len(prompt)) if seed else 1, checkpoint_drafter(prop, drafters[drafter]))
    mixed = MixedProposer(prop, plain, vocab, seed=11, check=check)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), mixed, k=k, max_len=128)
    out = session.generate(prompt, max_tokens=24, policy=StrictGreedy())
    assert out.token_ids == plain
    tel = out.telemetry
    assert 0 < tel.accepted_tokens < tel.draft_tokens
    # One commit after prefill, one per cycle; cycles without a propose (no room left) are plain decodes.
    assert stats["proposes"] >= 4 and stats["commits"] >= stats["proposes"] + 1
    assert stats["wrapped"] == (window < 20)


# ---- the merged, fused drafter against the checkpoint's layout --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norm_rope_is_per_part_rms_norm(device, dtype):
    """The q and k norms of one merged projection in one launch (head_norm_rope, with the rotation made the
    identity) give q_norm(q) and k_norm(k): bit for bit on the CPU path; on CUDA the Triton kernel's sum of squares
    may round rstd differently in the last bit (tests/kernels/test_head_norm_rope.py bounds that), so to rounding."""
    heads = (torch.randn(5, 4 + 2 + 2, 128) * 3).to(device, dtype)     # [rows, q heads | k heads | v heads, hd]
    q_norm, k_norm = (RMSNorm(128, 1e-6, zero_centred=False).to(device, dtype) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.normal_(1.0, 0.5)
        k_norm.weight.normal_(1.0, 0.5)
        weight = torch.cat([q_norm.weight.expand(4, 128), k_norm.weight.expand(2, 128)])
        cos = torch.ones(5, 1, 128, device=device, dtype=dtype)          # x * 1 + rotated * 0 = x exactly
        got = head_norm_rope(heads, 6, weight, cos, torch.zeros_like(cos), 1e-6)
        want = torch.cat([q_norm(heads[:, :4]), k_norm(heads[:, 4:6])], dim=1)
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                                     else {"atol": 2e-2, "rtol": 1e-2}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["reference", "dispatch"])
@pytest.mark.parametrize("shape", [(6, 8, 2, 5, 32), (16, 32, 8, 128, 128)], ids=["tiny", "27b-drafter"])
def test_block_attention_matches_sdpa(device, dtype, path, shape):
    """Block attention (the torch reference, and the dispatcher: Triton on CUDA) = SDPA with a boolean mask and GQA
    (what the block ran before), to rounding. The scratch rows start as NaN: the reference overwrites them with the
    block's keys/values, the Triton kernel must not read them at all."""
    T, Hq, Hkv, W, hd = shape
    S = W + T
    q = torch.randn(T, Hq, hd, device=device).to(dtype)
    keys, values = torch.randn(2, S, Hkv, hd, device=device).to(dtype).float()     # the window keeps fp32
    k_block, v_block = keys[W:].to(dtype).clone(), values[W:].to(dtype).clone()
    want_k, want_v = keys.clone(), values.clone()
    keys[W:], values[W:] = float("nan"), float("nan")
    mask = torch.rand(T, S, device=device) < 0.6
    mask[:, W:] |= torch.eye(T, dtype=torch.bool, device=device)       # every query sees at least its own key
    bias = torch.where(mask, 0.0, float("-inf")).repeat(Hq // Hkv, 1)
    fn = block_attention_ref if path == "reference" else block_attention
    got = fn(q, k_block, v_block, keys, values, bias, hd ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), want_k.transpose(0, 1).to(dtype),
                                          want_v.transpose(0, 1).to(dtype), attn_mask=mask, scale=hd ** -0.5,
                                          enable_gqa=True).transpose(0, 1).reshape(T, Hq * hd)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **({"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32
                                             else {"atol": 1e-2, "rtol": 1e-2}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_attention_triton_equals_reference_on_drafter_masks():
    """The Triton block attention against the float32 reference on the masks a drafter builds: causal and not, a
    sliding window, empty ring slots (position -1, never visible); bf16 queries and K/V values, 27B-drafter heads."""
    from edgespec.kernels.attention.triton_block_attention import block_attention_triton
    T, Hq, Hkv, W, hd = 16, 32, 8, 128, 128
    S = W + T
    q = torch.randn(T, Hq, hd, device="cuda").bfloat16()
    keys, values = torch.randn(2, S, Hkv, hd, device="cuda").bfloat16().float()   # the drafter's K/V: bf16 values
    k_block, v_block = torch.randn(2, T, Hkv, hd, device="cuda").bfloat16()
    key_pos = torch.cat([torch.arange(-40, W - 40, device="cuda"), torch.arange(W - 40, W - 40 + T, device="cuda")])
    q_pos = key_pos[W:]
    dist = q_pos[:, None] - key_pos[None, :]
    for causal, window in ((True, None), (False, None), (True, 32)):
        visible = (key_pos >= 0)[None, :].expand(T, -1)
        if causal:
            visible = visible & (dist >= 0)
        if window is not None:
            visible = visible & (dist < window)
        bias = torch.where(visible, 0.0, float("-inf")).repeat(Hq // Hkv, 1)
        got = block_attention_triton(q, k_block, v_block, keys, values, bias, hd ** -0.5).float()
        want = block_attention_ref(q, k_block, v_block, keys.clone(), values.clone(), bias, hd ** -0.5).float()
        # Both round float32 results to bf16: they may differ by one bf16 step where the float32 values straddle it.
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert ((got - want).norm() / want.norm()).item() < 5e-3, (causal, window)


def test_block_attention_rejects_bad_shapes():
    q = torch.randn(4, 8, 16)
    keys = torch.randn(9, 2, 16)
    kb = torch.randn(4, 2, 16)
    bias = torch.zeros(16, 9)
    with pytest.raises(ValueError, match="block attention shapes"):
        block_attention(q, kb, kb, keys, keys, bias[:, :8], 0.25)                 # bias width != W + T
    with pytest.raises(ValueError, match="block attention shapes"):
        block_attention(q, kb[:3], kb, keys, keys, bias, 0.25)                    # block rows != T
    with pytest.raises(ValueError, match="block attention shapes"):
        block_attention(q, kb, kb, keys.double(), keys.double(), bias, 0.25)     # window not float32


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "device-position"])
@pytest.mark.parametrize("family,drafter", [("qwen3_5", "qwen3_5"), ("qwen3", "qwen3"), ("qwen3", "own")])
def test_fused_drafter_matches_checkpoint_layout(tiny_models, drafters, family, drafter, graphs):
    """The served drafter (merged q/k/v and gate/up, stacked head norms, grouped fp32 attention, one k|v GEMM per
    layer for the context, argmax over the head's own dtype) drafts what the checkpoint's unmerged layout drafts,
    with logits equal to fp32 rounding, in every cycle of a session with partial accepts (multi-row appends)."""
    model = tiny_models[family]
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=13)
    plain = plain_greedy(model, prompt, 20)
    prop = load_dflash_checkpoint(drafters[drafter], model, window_size=6, cuda_graphs=graphs)
    ref = checkpoint_drafter(prop, drafters[drafter])
    checked = []
    real_propose = prop.propose

    def propose(last_token: int, k: int) -> Draft | None:
        draft = real_propose(last_token, k)
        n, w = draft.tokens.shape[0], prop.window
        hidden = naive_block_hidden(prop, ref, w.ordered_features().to(prop.dtype), w.end - w.length, last_token)
        want = prop.logits(hidden[1:1 + n])
        assert draft.tokens.tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(prop.last_logits, want, rtol=0, atol=1e-5)
        checked.append(n)
        return draft

    prop.propose = propose
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), MixedProposer(prop, plain, vocab, seed=7),
                                        k=prop.max_k, max_len=128)
    out = session.generate(prompt, max_tokens=20, policy=StrictGreedy())
    assert out.token_ids == plain and len(checked) >= 4
    assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens


# ---- losslessness gate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_dflash_equals_plain(tiny_models, drafters, family, kv_fp8):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=21, seed=3 if family == "qwen3" else 5)
    n = 18
    plain = plain_greedy(model, prompt, n, kv_fp8)
    for arch, rollback in itertools.product(("base", "rtx", "thor"), ROLLBACK_STRATEGIES):
        graphs = select_hooks(arch, CPU).defaults.cuda_graphs           # rtx/thor: device-position path
        prop = load_dflash_checkpoint(drafters[family], model, window_size=8, cuda_graphs=graphs)
        mixed = MixedProposer(prop, plain, vocab, seed=len(arch) + len(rollback))
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), mixed, kv_fp8=kv_fp8, rollback=rollback,
                                            max_len=128)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, (arch, rollback)
        assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
        assert prop.window.end == session.cache.length              # window in step with the target cache
    # The drafter's own drafts (almost all rejected by a random target), once per arch default.
    for arch in ("base", "thor"):
        prop = load_dflash_checkpoint(drafters[family], model, window_size=8)
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, kv_fp8=kv_fp8, max_len=128)
        assert session.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids == plain


# ---- quantized drafter ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_quantized_drafter_stays_lossless(tiny_models, drafters, fmt):
    """``drafter_weights``: the drafter's linear layers are packed after loading (merged q/k/v and gate/up
    included, its own head kept dense); drafts move, the greedy output equals plain decoding."""
    from edgespec.weights.base import PackedLinear, PackedWeight
    model = tiny_models["qwen3_5"]
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=5)
    plain = plain_greedy(model, prompt, 18)
    dense = load_dflash_checkpoint(drafters["qwen3_5"], model, window_size=8)
    prop = load_dflash_checkpoint(drafters["qwen3_5"], model, window_size=8, weights=fmt)
    attn = prop.drafter.layers[0].self_attn
    assert isinstance(prop.drafter.fc, PackedLinear) and isinstance(attn.qkv_proj.weight, PackedWeight)
    assert isinstance(prop.drafter.layers[0].mlp.gate_up_proj, PackedLinear)
    packed_bytes = sum(m.nbytes for m in prop.drafter.modules() if isinstance(m, PackedWeight))
    dense_bytes = sum(p.numel() * p.element_size() for n, p in dense.drafter.named_parameters()
                      if n.endswith("weight") and p.dim() == 2)
    assert packed_bytes < dense_bytes / 2
    # context rows read the k | v columns of the packed product
    x = torch.randn(3, model.config.hidden_size)
    kv = attn.context_kv(x)
    assert kv.shape == (3, 2 * attn.n_kv * attn.hd)
    assert torch.allclose(kv, attn.qkv_proj(x)[:, attn.n_heads * attn.hd:])
    for arch in ("base", "thor"):
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, max_len=128)
        assert session.generate(prompt, max_tokens=18, policy=StrictGreedy()).token_ids == plain, arch
        prop = load_dflash_checkpoint(drafters["qwen3_5"], model, window_size=8, weights=fmt)


def test_quantized_drafter_own_head_stays_dense_and_setting_checked(tiny_models, drafters):
    from edgespec.weights.base import PackedLinear
    prop = dflash_from(Settings(drafter="dflash", drafter_path=str(drafters["own"]), drafter_weights="int4"),
                       tiny_models["qwen3"])
    assert isinstance(prop.drafter.fc, PackedLinear) and not isinstance(prop.drafter.lm_head, PackedLinear)
    from edgespec.config import load_settings
    with pytest.raises(ConfigError, match="drafter_weights"):
        load_settings(cli={"drafter_weights": "int2"}, environ={})
    with pytest.raises(ConfigError, match="drafter_weights"):
        load_settings(environ={"EDGESPEC_DRAFTER_WEIGHTS": "int2"})
    with pytest.raises(ConfigError, match="drafter_weights 'int2'"):
        load_dflash_checkpoint(drafters["own"], tiny_models["qwen3"], weights="int2")
