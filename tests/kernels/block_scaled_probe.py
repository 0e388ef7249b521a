"""Capability probe of ``tl.dot_scaled`` for the block-scaled products' two operand formats, for the GPU tests
(``test_block_scaled_gpu``): does the installed Triton lower the scale format on this device, and does the
result equal the torch decoding of the same operands?

The probe is one tile of the product kernel (``edgespec.kernels.quant.triton_block_scaled``) as that kernel feeds it:
128 weight rows of e2m1 codes (the left operand) and 16 activation columns (the right one), K = 128, with

* ``nvfp4``: E4M3 scales per 16 on both sides, e2m1 activations (``kind::mxf4nvf4.block16`` on Blackwell);
* ``mxfp4``: E8M0 scales per 32 on both sides, e4m3 activations (``kind::mxf8f6f4.block32``).

A Triton that cannot lower a format fails while compiling (Triton 3.6 on sm_90 stops in
``TritonGPUAccelerateMatmul`` on E4M3 scales); one whose MLIR assertion aborts would take the test process with
it, so the probe runs in a child process (``python block_scaled_probe.py FORMAT ...``) that prints one JSON line
per format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from edgespec.kernels.quant.block_scaled_ref import BLOCK_SCALED_FORMATS, SCALE_BLOCK
from edgespec.kernels.quant.quant_ref import e2m1_decode, unpack_nibbles

ROOT = Path(__file__).resolve().parents[2]
# The product kernel's tile: BLOCK_N weight rows, the fewest MMA columns of a row block, one BLOCK_K step.
PROBE_N, PROBE_C, PROBE_K = 128, 16, 128
# What each format's scales are and what the product needs of them (skip reasons name it).
CAPABILITY = {"nvfp4": "tl.dot_scaled with E4M3 scales per 16 (NVFP4: e2m1 x e2m1)",
              "mxfp4": "tl.dot_scaled with E8M0 scales per 32 (MXFP4: e2m1 x e4m3)"}
# The operands hold at most 12 significant bits per product: the fp32 sums of 128 of them are exact but for the
# order of rounding past 24 bits.
PROBE_TOL = 1e-6
CHILD_TIMEOUT_S = 240


@triton.jit
def _probe_kernel(w_ptr, ws_ptr, x_ptr, xs_ptr, y_ptr, NVFP4: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
                  K: tl.constexpr):
    """``y[n, c] = sum_k W[n, k] X[c, k]`` in one ``tl.dot_scaled``, operands loaded as the product kernel loads
    them (weights ``[N, K/2]`` codes and ``[N, K/B]`` scales, activations transposed to ``[XK, C]``)."""
    B: tl.constexpr = 16 if NVFP4 else 32
    XK: tl.constexpr = K // 2 if NVFP4 else K
    ACT: tl.constexpr = "e2m1" if NVFP4 else "e4m3"
    n = tl.arange(0, N)
    c = tl.arange(0, C)
    w = tl.load(w_ptr + n[:, None] * (K // 2) + tl.arange(0, K // 2)[None, :])
    ws = tl.load(ws_ptr + n[:, None] * (K // B) + tl.arange(0, K // B)[None, :])
    x = tl.load(x_ptr + c[None, :] * XK + tl.arange(0, XK)[:, None])
    xs = tl.load(xs_ptr + c[:, None] * (K // B) + tl.arange(0, K // B)[None, :])
    acc = tl.dot_scaled(w, ws, "e2m1", x, xs, ACT)
    tl.store(y_ptr + n[:, None] * C + c[None, :], acc)


@dataclass
class ProbeOperands:
    """One probe tile's operands on a device and what they stand for in fp32 (the torch decoding)."""

    fmt: str
    w: torch.Tensor
    ws: torch.Tensor
    x: torch.Tensor
    xs: torch.Tensor
    w_f32: torch.Tensor      # [N, K]
    x_f32: torch.Tensor      # [C, K]


def _e4m3_scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """E4M3 scales with mantissa bits set (0.125 .. 8, not only powers of two: a format read as E8M0 fails)."""
    return (torch.rand(shape, generator=gen) * 7.875 + 0.125).to(torch.float8_e4m3fn)


def _e8m0_scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """E8M0 exponents 2^-4 .. 2^4."""
    return torch.randint(123, 132, shape, generator=gen, dtype=torch.uint8)


def probe_operands(fmt: str, device: torch.device | str, seed: int = 0) -> ProbeOperands:
    """Random codes and scales of ``fmt``'s two operands (layouts of ``block_scaled_ref``) and their decoding."""
    gen = torch.Generator().manual_seed(seed)
    blk = SCALE_BLOCK[fmt]
    w = torch.randint(0, 256, (PROBE_N, PROBE_K // 2), generator=gen, dtype=torch.uint8)
    w_vals = e2m1_decode(unpack_nibbles(w))
    if fmt == "nvfp4":
        ws, xs = _e4m3_scales((PROBE_N, PROBE_K // blk), gen), _e4m3_scales((PROBE_C, PROBE_K // blk), gen)
        x = torch.randint(0, 256, (PROBE_C, PROBE_K // 2), generator=gen, dtype=torch.uint8)
        x_vals = e2m1_decode(unpack_nibbles(x))
        w_scale, x_scale = ws.float(), xs.float()
    else:
        ws, xs = _e8m0_scales((PROBE_N, PROBE_K // blk), gen), _e8m0_scales((PROBE_C, PROBE_K // blk), gen)
        x = (torch.randn(PROBE_C, PROBE_K, generator=gen) * 4).to(torch.float8_e4m3fn)
        x_vals = x.float()
        w_scale, x_scale = (torch.exp2(s.float() - 127) for s in (ws, xs))
    w_f32 = w_vals * w_scale.repeat_interleave(blk, dim=-1)
    x_f32 = x_vals * x_scale.repeat_interleave(blk, dim=-1)
    return ProbeOperands(fmt, *(t.to(device) for t in (w, ws, x, xs, w_f32, x_f32)))


def launch_probe(ops: ProbeOperands) -> torch.Tensor:
    """The probe tile's ``[N, C]`` fp32 result through ``tl.dot_scaled``."""
    y = torch.full((PROBE_N, PROBE_C), float("nan"), dtype=torch.float32, device=ops.w.device)
    _probe_kernel[(1,)](ops.w, ops.ws, ops.x, ops.xs, y, NVFP4=ops.fmt == "nvfp4", N=PROBE_N, C=PROBE_C,
                        K=PROBE_K, num_warps=8)
    return y


def probe_on_device(fmt: str) -> dict[str, object]:
    """Run the probe on CUDA: ``{"fmt", "error"}`` (the launch raised: the format is not lowered) or
    ``{"fmt", "rel_err"}`` (it ran: the result's relative error against the torch decoding)."""
    ops = probe_operands(fmt, "cuda")
    torch.cuda.synchronize()
    print(json.dumps({"launching": fmt}), flush=True)         # a death from here on is the compile's or launch's
    try:
        y = launch_probe(ops)
        torch.cuda.synchronize()
    except Exception as exc:  # what Triton raises on a format it cannot lower: CompilationError, RuntimeError ...
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return {"fmt": fmt, "error": f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"}
    ref = ops.w_f32.double() @ ops.x_f32.double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    return {"fmt": fmt, "rel_err": err if err == err else float("inf")}


@dataclass
class ProbeResult:
    """What the probe found for one format: ``error`` set when Triton could not lower it here (the reason's
    detail), else ``rel_err`` of its result."""

    fmt: str
    error: str | None = None
    rel_err: float | None = None

    @property
    def lowered(self) -> bool:
        return self.error is None

    def skip_reason(self) -> str:
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        where = f"sm_{cap[0]}{cap[1]}" if cap else "this device"
        return f"Triton {triton.__version__} cannot lower {CAPABILITY[self.fmt]} on {where}: {self.error}"


def parse_child(stdout: str, stderr: str, returncode: int, formats: Sequence[str]) -> dict[str, ProbeResult]:
    """The JSON lines of a child that probed ``formats`` in order -> their results. Where a line is missing the
    child died probing that format (an MLIR assertion's abort): it counts as not lowered, with the exit status and
    stderr's last line; the formats after it were not probed and are left out. A child that died before launching
    a format's kernel (no CUDA, out of memory) raises: that is no answer about Triton."""
    results: dict[str, ProbeResult] = {}
    launched = set()
    for line in stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if "launching" in rec:
                launched.add(rec["launching"])
            else:
                results[rec["fmt"]] = ProbeResult(rec["fmt"], rec.get("error"), rec.get("rel_err"))
    missing = [f for f in formats if f not in results]
    if missing:
        tail = [ln for ln in stderr.splitlines() if ln.strip()]
        died = f"the probe process exited with status {returncode}: {tail[-1][:300] if tail else 'no output'}"
        if missing[0] not in launched:             # it died before the kernel: the device, not Triton
            raise RuntimeError(f"block-scaled probe of {missing[0]} could not start: {died}")
        results[missing[0]] = ProbeResult(missing[0], error=died)
    return results


def run_probe(formats: Sequence[str] = BLOCK_SCALED_FORMATS) -> dict[str, ProbeResult]:
    """Probe ``formats`` on this CUDA device in child processes: one for all, another for those after a format
    whose probe killed its child."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    results: dict[str, ProbeResult] = {}
    while todo := [f for f in formats if f not in results]:
        run = subprocess.run([sys.executable, __file__, *todo], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT_S)
        results |= parse_child(run.stdout, run.stderr, run.returncode, todo)
    return results


if __name__ == "__main__":
    for name in sys.argv[1:] or BLOCK_SCALED_FORMATS:
        print(json.dumps(probe_on_device(name)), flush=True)
