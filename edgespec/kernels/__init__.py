"""Compute kernels. Each op has a pure-torch reference (CPU and oracle) and, where it pays, a Triton version.

The public function of each op dispatches: Triton when the tensors are on CUDA and Triton imports, the torch
reference otherwise. Tests compare the two on fresh random inputs. See ``docs/architecture.md`` and
``docs/benchmarks.md``.

One subpackage per kind of op, each reference beside its Triton twin: ``quant`` (linear products, dense and packed),
``moe`` (routed experts), ``attention`` (attention and its prologue), ``recurrent`` (Gated DeltaNet, convolutions),
``pointwise`` (norms, activations), ``verify`` (verdicts, tree-masked mixers), ``draft`` (DFlash selector and
window), ``cpu`` (the compiled C path) and ``launch`` (PDL, SM read-back, SASS). This module holds the dispatch test
and the device facts every kernel reads; ``options`` the kernel options.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present (and the ``no_triton`` kernel option is off)."""
    from edgespec.kernels.options import active
    if active().no_triton:
        return False
    try:
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def use_triton(x: torch.Tensor) -> bool:
    """The test every dispatcher makes: ``x`` lives on CUDA and the Triton kernels can run."""
    return x.is_cuda and triton_available()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a nominal 132 off CUDA, e.g. TRITON_INTERPRET=1 on CPU tensors): launch
    heuristics size their grids by it."""
    import torch
    if device.type != "cuda":
        return 132
    if _sm_count_limit is not None:
        return _sm_count_limit
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_sm_count_limit: int | None = None     # set while the process runs on a green context (edgespec.bench.sm_limit)


def set_sm_count_limit(n: int | None) -> None:
    """Make :func:`sm_count` answer ``n`` on CUDA (the SMs a green context was granted), or the device's own
    count again (None): launch heuristics then size grids for the emulated GPU."""
    global _sm_count_limit
    if n is not None and n < 1:
        raise ValueError(f"SM count limit must be positive, got {n}")
    _sm_count_limit = n


def device_sync() -> None:
    """Wait until the GPU has finished what this thread queued: the current stream, then the whole device. The
    stream goes first because on a green context (``edgespec.bench.sm_limit``) the device-wide synchronize does not
    wait for the context's stream (a stage's kernels would be counted in the next stage's time)."""
    import torch
    torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()


def split_count(waves: int, sm_count: int, parallel: int, key_len_hint: int, tile_keys: int) -> int:
    """Splits of the key range of a split-K attention launch: enough for ``waves`` programs per SM when each split
    runs ``parallel`` programs (row blocks x KV heads), but never below ~4 tiles of ``tile_keys`` keys per split,
    because every split costs a partial-output write and read, and at most 256 (the merge's tile)."""
    by_chip = -(-waves * sm_count // parallel)
    by_len = max(1, -(-key_len_hint // (4 * tile_keys)))
    return max(1, min(by_chip, by_len, 256))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch for our Triton kernels (``edgespec.kernels.launch.triton_pdl``): on CUDA devices of
    compute capability 9.0 or newer, unless the ``pdl`` kernel option is off (``EDGESPEC_PDL=0``)."""
    from edgespec.kernels.options import active
    if device.type != "cuda" or not active().pdl:
        return False
    import torch
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


def attention_bytes(T: int, n_q: int, n_kv: int, hd: int, key_len: int, fp8: bool, q_bytes: int = 2) -> int:
    """Fewest bytes one call must move: every visible KV row (and its scales) once, q in, out back."""
    kv = 2 * key_len * n_kv * hd * (1 if fp8 else q_bytes)
    scales = 2 * key_len * n_kv * 4 if fp8 else 0
    return kv + scales + 2 * T * n_q * hd * q_bytes
