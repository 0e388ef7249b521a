"""DFlash2 drafters against z-lab's own ``dflash`` package (test-time oracle): tiny random checkpoints written by
its ``DFlash2DraftModel.save_pretrained`` load, and edgespec's proposals equal the package's token for token in fp32
(the chain is the selector's greedy path) in every cycle of a session with partial accepts, with the window
seeded or not, wider or narrower than the history, eager and on the device-position (graph-mode) path. Speculative
output equals plain decoding on the tiny hybrid target, dense and quantized; the settings pick DFlash2 from the
checkpoint; bad checkpoints are refused by name.

The reference runs statelessly: every cycle it gets the context features of the tokens edgespec's window holds (the
target's taps, through its own ``fc`` / ``hidden_norm``), at their positions, and drafts the block from scratch
with its own attention, convolutions and selector.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _plans import proposer_from
from test_dflash import MixedProposer, _variant, plain_greedy, prompt_ids

from edgespec.arch.detect import select_hooks
from edgespec.config import Settings
from edgespec.drafters.base import Draft
from edgespec.drafters.dflash2_loader import load_dflash2_checkpoint
from edgespec.drafters.dflash2_proposer import DFlash2Proposer
from edgespec.drafters.lookup import LookupFirstProposer
from edgespec.errors import CheckpointError, ConfigError
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

transformers = pytest.importorskip("transformers")
dflash_model = pytest.importorskip("dflash.model")

CPU = torch.device("cpu")
TARGET = "qwen3_5"


def write_reference_drafter(folder: Path, target_hidden: int, vocab: int, *, seed: int, layer_types: list[str],
                            window: int | None, is_causal: bool | None = None, block_size: int = 8,
                            multiplier: float = 1.0, softcap: float | None = None) -> Path:
    """A random DFlash2 drafter built and saved by the ``dflash`` package (its ``save_pretrained`` layout)."""
    extra = {} if is_causal is None else {"is_causal": is_causal}
    cfg = transformers.Qwen3Config(
        hidden_size=target_hidden, intermediate_size=96, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=vocab, layer_types=layer_types, rms_norm_eps=1e-6,
        sliding_window=window, use_sliding_window=window is not None, rope_parameters={"rope_theta": 1e6,
                                                                                       "rope_type": "default"},
        max_position_embeddings=1024, num_target_layers=6, architectures=["DFlash2DraftModel"], **extra)
    dflash = {"block_size": block_size, "mask_token_id": vocab - 3, "target_layer_ids": [1, 3, 5],
              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 16,
              "output_multiplier": multiplier}
    if softcap is not None:
        dflash["final_logit_softcapping"] = softcap
    cfg.dflash_config = dflash
    model = dflash_model.DFlash2DraftModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * (2 * torch.rand(p.shape, generator=gen) - 1))
            elif name.endswith("base_kernel"):
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))
                p[:, 0] += 1.0                                     # around the identity: the block keeps its signal
            elif "codebook" in name:
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))  # transitions strong enough to overrule unary
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def ref_drafters(tiny_checkpoints, tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Written by the package: a sliding (causal, window 5) + a full layer with a scaled, soft-capped head; and the
    published layout (every layer sliding, ``is_causal`` false, window 2048)."""
    root = tmp_path_factory.mktemp("dflash2")
    H, V = tiny_models[TARGET].config.hidden_size, tiny_models[TARGET].config.vocab_size
    return {
        "mixed": write_reference_drafter(root / "mixed", H, V, seed=1, layer_types=["sliding_attention",
                                         "full_attention"], window=5, multiplier=1.3, softcap=6.0),
        "published": write_reference_drafter(root / "published", H, V, seed=2, layer_types=["sliding_attention"] * 2,
                                             window=2048, is_causal=False),
    }


class _Target(torch.nn.Module):
    """What the reference reads of a target: its input embedding and its lm_head (edgespec's, shared)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(model.model.embed_tokens.weight)
        self.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        self.lm_head.weight = torch.nn.Parameter(model.lm_head_weight)

    def get_input_embeddings(self):
        return self.embed


def reference_draft(ref, target: _Target, taps: torch.Tensor, start: int, anchor: int) -> tuple[list[int], list[int]]:
    """The package's draft of the block after ``anchor`` with context taps ``[n, n_taps, H]`` at positions
    ``start ..``: (the selector's path, each position's argmax)."""
    n, bs = taps.shape[0], ref.block_size
    block = torch.tensor([[anchor] + [ref.mask_token_id] * (bs - 1)])
    noise = F.embedding(block, target.get_input_embeddings().weight)
    with torch.no_grad():
        hidden = ref(target_hidden=taps.reshape(1, n, -1), noise_embedding=noise,
                     position_ids=torch.arange(start, start + n + bs)[None])[:, 1:]
        path, _, _ = ref.propose(hidden, block[:, 0], target.lm_head, 0.0)
        argmax = ref.compute_logits(hidden, target.lm_head).argmax(-1)
    return path[0].tolist(), argmax[0].tolist()


def checked_session(model, prop: DFlash2Proposer, ref_folder: Path, prompt: list[int], n: int, selector: bool):
    """A session whose every propose is compared with the package's draft over the window's tokens."""
    ref = dflash_model.DFlash2DraftModel.from_pretrained(str(ref_folder)).eval()
    target = _Target(model)
    real_propose, compared = prop.propose, []

    def propose(last_token: int, k: int) -> Draft | None:
        draft = real_propose(last_token, k)
        w = prop.window
        start = w.end - w.length
        taps = model.prefill(torch.tensor(prop.history[:w.end]), model.new_cache(w.end + 8),
                             taps=prop.cfg.target_layer_ids).taps[start:]
        path, argmax = reference_draft(ref, target, taps, start, last_token)
        want = path if selector else argmax
        assert draft.tokens.tolist() == want[:draft.tokens.shape[0]], (w.end, draft.tokens.tolist(), want)
        compared.append((path[:k], argmax[:k]))
        return draft

    prop.propose = propose
    plain = plain_greedy(model, prompt, n)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), MixedProposer(prop, plain, 320, seed=5),
                                        k=prop.max_k, max_len=128)
    out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
    assert out.token_ids == plain
    assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
    return compared


@pytest.mark.parametrize("drafter,window,seed,graphs", [
    ("mixed", 64, True, False),        # the whole history in the window, seeded from the prompt
    ("mixed", 10, True, True),         # a window narrower than the history (ring wraps), device-position path
    ("mixed", 64, False, False),       # unseeded: the window grows from the last prompt token
    ("published", 12, True, False),    # all layers sliding and bidirectional, as published
])
def test_proposals_equal_the_dflash_package(tiny_models, ref_drafters, drafter, window, seed, graphs):
    model = tiny_models[TARGET]
    prop = load_dflash2_checkpoint(ref_drafters[drafter], model, window_size=window, window_seed=seed,
                                   cuda_graphs=graphs)
    assert isinstance(prop, DFlash2Proposer) and prop.cfg.selector_top_k == 16
    compared = checked_session(model, prop, ref_drafters[drafter], prompt_ids(320, n=13), 24, selector=True)
    assert len(compared) >= 4
    # The selector's path is not just each position's argmax: the oracle would not notice a missing selector.
    assert any(path != argmax for path, argmax in compared)


def test_selector_off_drafts_each_positions_argmax(tiny_models, ref_drafters):
    model = tiny_models[TARGET]
    prop = load_dflash2_checkpoint(ref_drafters["mixed"], model, window_size=32, use_selector=False)
    checked_session(model, prop, ref_drafters["mixed"], prompt_ids(320, n=13), 16, selector=False)


def test_speculative_equals_plain_with_its_own_drafts(tiny_models, ref_drafters):
    """The drafter's own drafts on every arch's defaults (rtx/thor: the device-position path), dense and int4."""
    model = tiny_models[TARGET]
    prompt = prompt_ids(320, n=21, seed=5)
    plain = plain_greedy(model, prompt, 18)
    for arch, weights in (("base", "model"), ("thor", "model"), ("rtx", "int4"), ("thor", "fp8")):
        graphs = select_hooks(arch, CPU).defaults.cuda_graphs
        prop = load_dflash2_checkpoint(ref_drafters["mixed"], model, window_size=16, cuda_graphs=graphs,
                                       weights=weights)
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, max_len=128)
        out = session.generate(prompt, max_tokens=18, policy=StrictGreedy())
        assert out.token_ids == plain, (arch, weights)
        assert prop.window.end == session.cache.length


def test_tree_first_path_is_the_selector_chain(tiny_models, ref_drafters):
    model = tiny_models[TARGET]
    prop = load_dflash2_checkpoint(ref_drafters["mixed"], model, window_size=16)
    prompt = prompt_ids(320, n=13)
    cache = model.new_cache(64)
    prop.begin(prompt[:-1], model.prefill(torch.tensor(prompt[:-1]), cache, taps=prop.taps))
    prop.commit([prompt[-1]], 0, None)
    chain = prop.propose(prompt[-1], 7).tokens.tolist()
    tree = prop.propose_tree(prompt[-1], 7, budget=20, chain_first=True)
    assert tree.first_chain().tolist() == chain and tree.size == 20
    cands = prop.last_candidates
    assert cands.ids.shape == (7, 16) and cands.transitions.shape == (7, 16, 16)
    for token, depth in zip(tree.tokens.tolist(), tree.depths.tolist(), strict=True):
        assert token in cands.ids[depth - 1].tolist()          # every node is one of its position's candidates


def test_settings_pick_dflash2_from_the_checkpoint(tiny_models, ref_drafters):
    model = tiny_models[TARGET]
    prop = proposer_from(Settings(drafter="dflash", drafter_path=str(ref_drafters["mixed"])), model)
    assert isinstance(prop, LookupFirstProposer) and isinstance(prop.model, DFlash2Proposer)
    assert prop.model.use_selector
    off = proposer_from(Settings(drafter="dflash", drafter_path=str(ref_drafters["mixed"]), dflash_selector=False,
                                 lookup_min_match=0, drafter_weights="int4"), model)
    assert isinstance(off, DFlash2Proposer) and not off.use_selector
    with pytest.raises(ConfigError, match="num_draft_tokens 9 exceeds what the dflash2 drafter"):
        proposer_from(Settings(drafter="dflash", drafter_path=str(ref_drafters["mixed"]), num_draft_tokens=9), model)


def _bare_codebooks(t: dict) -> None:
    for name in ("predecessor_codebook", "successor_codebook"):
        t[f"candidate_selector.{name}"] = t.pop(f"candidate_selector.{name}.weight")


@pytest.mark.parametrize("cfg_edit,tensor_edit,error,match", [
    (lambda c: c["dflash_config"].pop("selector_rank"), None, CheckpointError, "needs selector_rank"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), None, CheckpointError,
     "hidden_size 64 is not a multiple of conv_group_size 24"),
    (lambda c: c["dflash_config"].update(selector_top_k=400), None, CheckpointError, "selector_top_k 400 exceeds"),
    (lambda c: c["dflash_config"].update(output_multiplier=-1), None, CheckpointError, "must be positive"),
    (None, lambda t: t.pop("candidate_selector.successor_codebook.weight"), CheckpointError,
     "missing candidate_selector.successor_codebook"),
    (None, lambda t: t.update({"candidate_selector.predecessor_codebook.weight": torch.zeros(300, 8)}),
     CheckpointError, r"predecessor_codebook has shape \(300, 8\), expected \(320, 8\)"),
    (None, lambda t: t.update({"layers.1.mlp_conv.base_kernel": torch.zeros(2, 3, 64)}), CheckpointError,
     "layers.1.mlp_conv.base_kernel"),
    (None, lambda t: t.pop("layers.0.attention_conv.kernel_projection.weight"), CheckpointError,
     "layers.0.attention_conv.kernel_projection.weight"),
    (lambda c: c.update(num_target_layers=8), None, ConfigError, "target with 8 layers"),
])
def test_bad_checkpoints_are_refused_by_name(tiny_models, ref_drafters, tmp_path, cfg_edit, tensor_edit, error,
                                             match):
    folder = _variant(tmp_path, ref_drafters["mixed"], cfg_edit, tensor_edit)
    with pytest.raises(error, match=match):
        load_dflash2_checkpoint(folder, tiny_models[TARGET])


def test_bare_codebooks_as_published_load_the_same(tiny_models, ref_drafters, tmp_path):
    model = tiny_models[TARGET]
    bare = _variant(tmp_path, ref_drafters["mixed"], tensor_edit=_bare_codebooks)
    a = load_dflash2_checkpoint(ref_drafters["mixed"], model).drafter.candidate_selector
    b = load_dflash2_checkpoint(bare, model).drafter.candidate_selector
    assert torch.equal(a.predecessor_codebook, b.predecessor_codebook)
    assert torch.equal(a.successor_codebook, b.successor_codebook)
    with pytest.raises(CheckpointError, match="folder not found"):
        load_dflash2_checkpoint(tmp_path / "nowhere", model)
    with pytest.raises(ConfigError, match="window_size 4 is below the block_size 8"):
        load_dflash2_checkpoint(bare, model, window_size=4)
