"""The linear stack of a model shape in a packed format, timed as one CUDA graph: what ``tools/quant_bench.py`` and
``tools/tile_sweep.py`` measure the quantized products on (random packed data made on the GPU in the packed dtypes,
no dense copy staged), and the small helpers both scripts share (reference error, per-matrix timing from DRAM,
the green-context switch, the JSON report)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgespec.bench.timing import graph_time_us
from edgespec.kernels.quant.quant_ref import RawPacked

DEV = "cuda"


def random_packed(fmt: str, n: int, k: int) -> RawPacked:
    """Random packed tensors of an ``[n, k]`` weight, made on the GPU in their packed dtypes (no dense copy)."""
    if fmt == "int4":
        t = {"qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV),
             "scales": (torch.rand(n, k // 128, device=DEV) * 2e-3 + 1e-3).half(),
             "zeros": torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=DEV)}
        return RawPacked(fmt, n, k, t, 128)
    if fmt == "nvfp4":
        t = {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV),
             "weight_scale": (torch.rand(n, k // 16, device=DEV) * 200 + 20).to(torch.float8_e4m3fn),
             "weight_scale_2": torch.tensor(1e-4, device=DEV)}
        return RawPacked(fmt, n, k, t, 16)
    if fmt == "fp8_block":
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEV)
        w[(w & 0x7F) == 0x7F] = 0            # the two NaN codes
        t = {"weight": w.view(torch.float8_e4m3fn),
             "weight_scale_inv": torch.rand(-(-n // 128), -(-k // 128), device=DEV) * 1e-4 + 1e-5}
        return RawPacked(fmt, n, k, t, 128)
    raise ValueError(f"random_packed: no packed format {fmt!r} (int4, nvfp4, fp8_block)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def per_matrix_us(items: list, call) -> float:
    """Microseconds per product of ``call(item)``, cycling through ``items`` (more bytes than L2) in a graph."""
    def run() -> None:
        for it in items:
            call(it)
    return graph_time_us(run, reps=2) / len(items)


def copies_for(nbytes: int) -> int:
    """Copies of a matrix of ``nbytes`` that together outgrow L2 (so each product streams from DRAM)."""
    return max(2, (512 << 20) // nbytes)


class QuantStack:
    """One format's linear stack of a shape: ``(weight, N, K)`` in model order, each product through
    ``quant_matmul`` with ``override`` (one launch for every matrix), else ``configs[(N, K, min(rows, 16))]``, else
    ``quant_config``'s default."""

    def __init__(self, fmt: str, counts, configs: dict | None = None) -> None:
        self.fmt = fmt
        self.items = []
        self.configs = configs or {}
        self.override: dict | None = None
        for (n, k), uses in counts.items():
            for _ in range(uses):
                self.items.append((self.make(n, k), n, k))
        self.nbytes = sum(self.weight_bytes(w) for w, _, _ in self.items)

    def make(self, n: int, k: int):
        return random_packed(self.fmt, n, k)

    @staticmethod
    def weight_bytes(w) -> int:
        if isinstance(w, tuple):
            return sum(t.numel() * t.element_size() for t in w)
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        return w.nbytes

    def call(self, w, n: int, k: int, x: torch.Tensor):
        from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
        if self.override is not None:
            return quant_matmul(w, x, config=self.override)
        return quant_matmul(w, x, config=self.configs.get((n, k, min(x.shape[0], 16))))

    def inputs(self, rows: int) -> dict[int, torch.Tensor]:
        """One random ``[rows, K]`` activation per input width of the stack."""
        return {k: torch.randn(rows, k, device=DEV).to(torch.bfloat16) for k in {k for _, _, k in self.items}}

    def time(self, rows: int) -> float:
        """Microseconds of the whole stack for ``rows`` activation rows, as one CUDA graph."""
        xs = self.inputs(rows)

        def run() -> None:
            for w, n, k in self.items:
                self.call(w, n, k, xs[k])
        return graph_time_us(run, reps=1)


def apply_sm_limit(ap: argparse.ArgumentParser, n: int):
    """Confine the process to a green context of ``n`` SMs (0: the whole chip, None returned) before anything else
    runs on the GPU, printing the count granted; a count the device cannot give is a usage error of ``ap``."""
    if not n:
        return None
    from edgespec.bench.sm_limit import limit_sms
    try:
        limit = limit_sms(n)
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))
    print(limit.describe(), flush=True)
    return limit


def write_report(report: dict, stem: str, limit, out: str | Path | None) -> None:
    """``report`` as <out>/<stem>.json (<stem>_sm<N>.json on a green context of N SMs); nothing when ``out`` is
    None (the benches' ``--out``)."""
    if out:
        name = f"{stem}_sm{limit.granted}.json" if limit else f"{stem}.json"
        Path(out, name).write_text(json.dumps(report, indent=2, default=str))
