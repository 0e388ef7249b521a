"""Emulating a smaller GPU's SM budget on a larger one (``--sm-limit N`` of the benchmarks): a CUDA green context.

A Jetson AGX Thor has 20 SMs; an H100/H200 has 132. A green context (``torch.cuda.green_contexts``) owns a
subset of the SMs, and every kernel launched into one of its streams runs only there, so a stage's time on that
context is its time on a GPU of that many SMs at the larger GPU's clock and memory. Hopper hands SMs out in groups
(of 8 on an H200: asking for 20 gives 24), so the count actually granted is read back from ``%smid`` in a kernel,
eagerly and through a replayed CUDA graph (how every benchmark times its stages), and is what the benchmarks print
and record. The context is made current before anything else runs on the GPU, so the streams torch creates
afterwards (its pool, the graph capture stream) belong to it; :func:`limit_sms` refuses to go on when a graph
replay is not confined to the granted SMs.

While a limit is active, :func:`edgespec.kernels.sm_count` answers the granted count, so the launch heuristics
size their grids for the emulated GPU as they would on the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgespec.kernels import set_sm_count_limit

# Programs of the read-back kernel per SM of the whole device: enough that every SM the context owns gets some.
_PROGRAMS_PER_SM = 16
_SPIN = 4096            # dependent FMAs per program (~10 us): programs overlap, so the scheduler spreads them


@dataclass
class SmLimit:
    """An active SM limit: what was asked, what the device has, what the context was granted (read back in a
    kernel), and the green context itself (kept alive for the process)."""

    requested: int
    device_sms: int
    granted: int
    api: str
    context: Any

    def describe(self) -> str:
        return (f"SM limit: asked {self.requested} of {self.device_sms} SMs, granted {self.granted} "
                f"(read back from %smid in a replayed graph; green context via {self.api})")


_ACTIVE: SmLimit | None = None


def active_limit() -> SmLimit | None:
    """The SM limit of this process, or None when the whole chip is in use."""
    return _ACTIVE


def limit_sms(n: int, device: torch.device | None = None) -> SmLimit:
    """Confine every later kernel of this process to a green context of ``n`` SMs on ``device`` (call it before
    anything else touches the GPU). Returns the limit with the SM count actually granted; raises ValueError for a
    count the device cannot give and RuntimeError where green contexts are unavailable or do not hold."""
    global _ACTIVE
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--sm-limit: the SM count must be a positive integer, got {n!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("--sm-limit needs a CUDA device (green contexts are a CUDA feature)")
    if _ACTIVE is not None:
        raise RuntimeError(f"--sm-limit: this process already runs on a {_ACTIVE.granted}-SM green context")
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    full = torch.cuda.get_device_properties(index).multi_processor_count
    if n > full:
        raise ValueError(f"--sm-limit {n}: the device has only {full} SMs")
    context, api = _make_current(n, index)
    dev = torch.device("cuda", index)
    eager = granted_sms(dev, graph=False)
    replayed = granted_sms(dev, graph=True)
    if replayed != eager or replayed >= full > n:
        raise RuntimeError(f"--sm-limit {n}: the green context does not hold (kernels reached {eager} SMs eagerly "
                           f"and {replayed} in a replayed graph, of {full}); make it current before any other "
                           "CUDA work")
    set_sm_count_limit(replayed)
    _ACTIVE = SmLimit(n, full, replayed, api, context)
    return _ACTIVE


def _make_current(n: int, index: int) -> tuple[Any, str]:
    """Create a green context of ``n`` SMs and make it current, across torch's API versions: torch 2.9-2.11
    (``GreenContext.create`` and ``set_context``, which also makes the context's default stream current) and later
    ones (``GreenContext(num_sms=...)`` and ``Stream()``)."""
    try:
        from torch.cuda import green_contexts
    except ImportError as e:
        raise RuntimeError(f"--sm-limit: this torch ({torch.__version__}) has no torch.cuda.green_contexts") from e
    cls = green_contexts.GreenContext
    try:
        if hasattr(cls, "create"):
            ctx = cls.create(n, index)
        else:
            ctx = cls(num_sms=n, device_id=index)
    except Exception as e:     # driver or build without green contexts: say so in the flag's words
        raise RuntimeError(f"--sm-limit {n}: cannot create a green context ({type(e).__name__}: {e})") from e
    if hasattr(ctx, "set_context"):
        ctx.set_context()
        return ctx, "GreenContext.set_context"
    stream = ctx.Stream()
    torch.cuda.set_stream(stream)
    return ctx, "GreenContext.Stream"


def granted_sms(device: torch.device, graph: bool = True) -> int:
    """Distinct SMs that the programs of one wide launch ran on (``%smid``), launched directly or captured in a
    CUDA graph and replayed (``graph``): the SM budget the current stream really has."""
    from edgespec.kernels.launch.triton_smid import smid_kernel
    full = torch.cuda.get_device_properties(device).multi_processor_count
    programs = _PROGRAMS_PER_SM * full
    ids = torch.full((programs,), -1, dtype=torch.int32, device=device)
    sink = torch.empty(programs, dtype=torch.float32, device=device)

    def launch() -> None:
        smid_kernel[(programs,)](ids, sink, _SPIN, num_warps=4)

    launch()
    torch.cuda.synchronize(device)
    if graph:
        ids.fill_(-1)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        ids.fill_(-1)
        g.replay()
        torch.cuda.synchronize(device)
    if bool((ids < 0).any()):
        raise RuntimeError("SM read-back: some programs did not run")
    return int(torch.unique(ids).numel())
