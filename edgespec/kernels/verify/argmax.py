"""The strict greedy verdict of a verify forward: every row's argmax and the length of the accepted draft prefix.

``tokens = [current, d_1 .. d_K]`` are the R = K + 1 tokens a verify forward ran; row i of its ``logits [R, V]``
predicts the token after ``tokens[i]``. :func:`greedy_verdict` returns one ``int64 [R + 1]`` tensor::

    out[1:] = targets = logits.argmax(-1)
    out[0]  = n       = number of leading i in 0 .. R-2 with tokens[i + 1] == targets[i]

so the accepted tokens are ``d_1 .. d_n`` followed by ``targets[n]`` (the correction, or the bonus token when
every draft matched: n = K). R == 1 (a plain decode step) gives n = 0 and the next greedy token in ``out[1]``.

Why: outside the verify graph the accept stage would run, after the graph's replay, an argmax over ``[16, 248k]``
logits plus ~6 small torch launches (compare, cumprod, sum, cat) and a host transfer. Computed
inside the verify graph with no host synchronisation (no ``.item()``, no branching on tensor values), all the
accept stage has left is one copy of R + 1 integers. On CUDA two Triton launches do it
(:mod:`edgespec.kernels.verify.triton_argmax`); the torch reference below runs elsewhere and is graph-capturable too.

Semantics are torch's, bit for bit:

* ties: the FIRST index among equal maxima (``-0.0 == +0.0`` counts as a tie);
* dtypes: bf16, fp16 and fp32 logits (the kernel compares them exactly, widened to fp32; other floating dtypes
  take the reference). ``-inf`` entries are ordinary values: a row that is entirely ``-inf`` (masked) yields
  index 0;
* NaN: like ``torch.argmax``, a NaN is larger than every number (``+inf`` included), so the first NaN of a row
  is its argmax. Matching it costs the kernel nothing measurable (one select per element in a memory-bound
  pass).

``tokens`` may be int64 or int32; the output is always int64.
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_verdict_ref(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The torch reference: ``[n, targets...]`` as int64 ``[R + 1]`` (see the module docstring). No host sync."""
    targets = logits.argmax(-1)                                           # [R], first index among ties
    match = tokens[1:] == targets[:-1]                                    # [R - 1]: draft i+1 vs row i's argmax
    n = match.to(torch.int64).cumprod(0).sum()                            # leading run of matches (0 if R == 1)
    out = torch.empty(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    out[0] = n
    out[1:] = targets
    return out


def _check(logits: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError naming the first problem with the arguments of :func:`greedy_verdict`."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_verdict: logits must be 2-D [R, V], got shape {tuple(logits.shape)}")
    R, V = logits.shape
    if R == 0:
        raise ValueError("greedy_verdict: logits has no rows (R == 0)")
    if V == 0:
        raise ValueError("greedy_verdict: empty vocab (logits has 0 columns)")
    if not logits.is_floating_point():
        raise ValueError(f"greedy_verdict: logits must be floating point, got {logits.dtype}")
    if tokens.dim() != 1 or tokens.shape[0] != R:
        raise ValueError(f"greedy_verdict: tokens must be 1-D of length R = {R}, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"greedy_verdict: tokens must be int64 or int32, got {tokens.dtype}")
    if tokens.device != logits.device:
        raise ValueError(f"greedy_verdict: tokens on {tokens.device}, logits on {logits.device}")
    if out is not None:
        if out.shape != (R + 1,):
            raise ValueError(f"greedy_verdict: out must have shape ({R + 1},), got {tuple(out.shape)}")
        if out.dtype != torch.int64:
            raise ValueError(f"greedy_verdict: out must be int64, got {out.dtype}")
        if out.device != logits.device:
            raise ValueError(f"greedy_verdict: out on {out.device}, logits on {logits.device}")


def greedy_verdict(logits: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, argmax of each row]`` int64 ``[R + 1]`` for verify ``logits [R, V]`` and the forward's ``tokens [R]``.

    Dispatch: two Triton launches on CUDA for bf16/fp16/fp32 logits, the reference otherwise; both are free of
    host syncs, so the call can sit inside a CUDA graph. ``logits`` may be a row slice of a larger tensor (any row
    stride). When ``out`` (int64 ``[R + 1]``) is given the result is written into it and it is returned. Raises
    ValueError for malformed shapes, dtypes or devices.
    """
    _check(logits, tokens, out)
    if logits.dtype in _TRITON_DTYPES and use_triton(logits):
        from edgespec.kernels.verify.triton_argmax import greedy_verdict_triton
        if out is None:
            out = torch.empty(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
        return greedy_verdict_triton(logits, tokens, out)
    ref = greedy_verdict_ref(logits, tokens)
    if out is None:
        return ref
    out.copy_(ref)
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of ``x [R, V]`` as int64 ``[R]`` (same ties and NaN rule), through :func:`greedy_verdict`'s
    kernels: on CUDA a reduction spread over ~2 programs per SM instead of torch's one block per row, which leaves
    most of the chip idle on the DFlash draft graph's few long rows (docs/benchmarks.md, "Design figures")."""
    tokens = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)   # unused by the argmax half
    return greedy_verdict(x, tokens)[1:]
