"""The DFlash2 candidate selector's scores and its greedy walk, over the top-K candidates of each draft position.

A DFlash2 drafter keeps the ``K`` best tokens of each of its ``D`` draft positions (``ids [D, K]``, their logits
``unary [D, K]``) and scores a step from a candidate ``p`` at position ``d - 1`` (the anchor for ``d = 0``) to a
candidate ``c`` at ``d`` by the unary logit plus a low-rank bilinear term::

    score(d, p -> c) = unary[d, c] + < pred[ids[d-1, p]] * gate[d], succ[ids[d, c]] >

``pred`` / ``succ`` are the codebooks ``[V, r]`` and ``gate [D, r]`` the projected hidden state of each position.
:func:`selector_transitions` gives the bilinear term for every predecessor candidate, ``[D, K, K]`` (row ``d = 0``
holds the anchor's term in every predecessor slot), so a tree builder can score any parent; :func:`selector_walk`
follows the greedy path from the anchor: ``c_d = argmax_c unary[d, c] + T[d, c_{d-1}, c]``, and returns the
chosen index per position and the scores of every candidate given the path's predecessor. Everything stays on the
device (no host sync), so the whole selector can sit inside the draft's CUDA graph; on CUDA the walk, a loop of D
tiny steps, is one Triton program (:mod:`edgespec.kernels.draft.triton_selector`) instead of four launches per step.
Ties pick the lowest candidate index (``torch.argmax``'s rule).
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton


def selector_transitions(gates: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, pred: torch.Tensor,
                         succ: torch.Tensor) -> torch.Tensor:
    """Bilinear terms ``[..., D, K, K]`` fp32 (module docstring) of ``gates [..., D, r]``, candidates ``ids [...,
    D, K]`` and the anchor tokens ``anchor [...]`` (``[1]`` for one draft; int64, on the device), with the
    codebooks ``pred`` / ``succ [V, r]``. Leading dimensions are independent drafts. Differentiable."""
    D, K = ids.shape[-2:]
    lead = ids.shape[:-2]
    first = anchor.reshape(*lead, 1, 1).expand(*lead, 1, K)
    prev = torch.cat([first, ids[..., :-1, :]], dim=-2)                              # [..., D, K] predecessor ids
    a = pred[prev].float() * gates.float()[..., None, :]                             # [..., D, K_prev, r]
    return a @ succ[ids].float().transpose(-1, -2)                                   # [..., D, K_prev, K]


def selector_walk_ref(unary: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the greedy walk: ``(choice [..., D] int64, path_scores [..., D, K] fp32)`` of
    ``unary [..., D, K]`` and ``transitions [..., D, K, K]`` (leading dimensions: independent drafts)."""
    lead, K = unary.shape[:-2], unary.shape[-1]
    prev = torch.zeros(*lead, 1, 1, dtype=torch.int64, device=unary.device).expand(*lead, 1, K)
    choices, scores = [], []
    for d in range(unary.shape[-2]):
        s = unary[..., d, :].float() + transitions[..., d, :, :].gather(-2, prev)[..., 0, :]
        choice = s.argmax(-1)
        prev = choice[..., None, None].expand(*lead, 1, K)
        choices.append(choice)
        scores.append(s)
    return torch.stack(choices, -1), torch.stack(scores, -2)


def selector_walk(unary: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy path through ``unary [D, K]`` and ``transitions [D, K, K]``: ``(choice [D] int64, path_scores
    [D, K] fp32)``. One Triton program on CUDA, the reference elsewhere. Raises ValueError on shapes that do not
    fit."""
    D, K = unary.shape
    if transitions.shape != (D, K, K):
        raise ValueError(f"selector walk shapes: unary{tuple(unary.shape)} transitions{tuple(transitions.shape)}: "
                         f"expected transitions ({D}, {K}, {K})")
    if use_triton(unary):
        from edgespec.kernels.draft.triton_selector import selector_walk_triton
        return selector_walk_triton(unary, transitions)
    return selector_walk_ref(unary, transitions)


__all__ = ["selector_transitions", "selector_walk", "selector_walk_ref"]
