"""The strict greedy verdict of a tree verify, computed on the device (inside the captured tree forward).

A tree forward of ``P`` rows (row 0 = the root, the token the verify starts from; then the draft nodes in
pre-order, then inert padding rows up to the captured size) scores every row: row r's logits give the target's
next token after r's path. Greedy acceptance (:func:`edgespec.speculative.tree_accept.greedy_tree_accept`, the host
rule) walks down from the root to the child whose token is the target argmax of its parent. Sibling tokens are
distinct (:class:`edgespec.drafters.tree.DraftTree`), so at most one child matches at each step, and the nodes whose
every path token matches form exactly that one path: the accepted path ends at the deepest of them.

:func:`greedy_tree_verdict` returns one ``int64 [P + 2]`` tensor::

    out[0]      = accepted drafts (the depth of the path's last row)
    out[1]      = the target's next token after the path (the argmax of its last row)
    out[2 + d]  = the row at depth d of the path for d <= out[0]; d itself past the end (so a fixed-length move
                  of rows ``path -> 0 .. P-1`` leaves the rows past the path where they are)

Every step is a fixed-shape tensor op with no host value, so it runs inside a CUDA graph, and the accept stage
copies ``P + 2`` integers instead of ``P x vocab`` logits. The commit reads the path from the same tensor
(:meth:`edgespec.cache.model_cache.ModelCache.commit_path_tensor`).
"""

from __future__ import annotations

import torch

from edgespec.kernels.verify.argmax import row_argmax


def greedy_tree_verdict(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                        ancestors: torch.Tensor, real_rows: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``[accepted, next token, path rows...]`` (see the module doc) of ``logits [P, V]`` for the rows' ``tokens``,
    ``parents`` (-1 for the root), ``depths`` and ``ancestors [P, P]`` (a row is its own ancestor);
    ``real_rows [1]``: rows past it are padding, never accepted. Written into ``out`` when given."""
    P = logits.shape[0]
    _check(logits, tokens, parents, depths, ancestors, real_rows, out)
    targets = row_argmax(logits)                                              # [P]
    rows = torch.arange(P, device=logits.device)
    # A draft row matches when its token is its parent's argmax; the root always "matches" (it is committed).
    match = (tokens == targets[parents.clamp_min(0)]) & (rows < real_rows)
    match = match | (rows == 0)
    on_path = ~(ancestors & ~match[None, :]).any(dim=1)                       # every row of its path matches
    # The deepest such row (unique: one path). Indexing goes through gather/index_select with the [1] index, which
    # stays on the device (a 0-d tensor index may be read back to the host).
    end = torch.where(on_path, depths, -1).argmax().view(1)
    depth = depths.gather(0, end)                                             # [1]
    at_depth = ancestors.index_select(0, end) & (depths[None, :] == rows[:, None])   # [d, s]: s = path's row at d
    path = (at_depth.to(torch.int64) * rows[None, :]).sum(dim=1)
    path = torch.where(rows <= depth, path, rows)
    if out is None:
        out = torch.empty(P + 2, dtype=torch.int64, device=logits.device)
    out[0:1] = depth
    out[1:2] = targets.gather(0, end)
    out[2:] = path
    return out


def _check(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
           ancestors: torch.Tensor, real_rows: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError naming the first argument of :func:`greedy_tree_verdict` whose shape is wrong."""
    if logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"greedy_tree_verdict: logits must be [P, V] with P >= 1, got {tuple(logits.shape)}")
    P = logits.shape[0]
    for name, t, shape in (("tokens", tokens, (P,)), ("parents", parents, (P,)), ("depths", depths, (P,)),
                           ("ancestors", ancestors, (P, P)), ("real_rows", real_rows, (1,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"greedy_tree_verdict: {name} must have shape {shape}, got {tuple(t.shape)}")
    if ancestors.dtype != torch.bool:
        raise ValueError(f"greedy_tree_verdict: ancestors must be bool, got {ancestors.dtype}")
    if out is not None and (tuple(out.shape) != (P + 2,) or out.dtype != torch.int64):
        raise ValueError(f"greedy_tree_verdict: out must be int64 of shape ({P + 2},), got {out.dtype} "
                         f"{tuple(out.shape)}")
