#!/usr/bin/env python3
"""Run the GGUF K-quant GEMV (``edgespec.kernels.triton_kquant_gemv``) in Triton's interpreter on the CPU against
the CPU decode of the same bytes: the kernel's arithmetic checked without a GPU (the GPU tests,
tests/kernels/test_kquant_gemv_gpu.py, check the compiled kernel the same way).

Per type (Q4_K, Q5_K, Q6_K), on small odd shapes, at one and two K splits: one-hot fp32 rows return the CPU's fp32
weights bit for bit at 1..4 rows; random fp32 rows agree with the float64 product within 2e-6; a row gives the same
bits at 1..4 rows; bf16 and fp16 rows (the bf16 inputs are read two to a word) give the bits of the same rows
widened to fp32, rounded once at the end. Prints one line per check and exits 1 on the first failure.

    python lab/kquant_gemv_interp.py            # ~10 s on one CPU core
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"        # before Triton is imported: the kernels then run in numpy

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.kernels.triton_kquant_gemv import kquant_gemv  # noqa: E402
from edgespec.weights.gguf_kquants import K_FORMATS, random_kquant  # noqa: E402

_patch = interpreter._patch_lang_tensor


def _patch_index(tensor, scope) -> None:
    """The interpreter reads a loop bound with ``int()`` of a one-element array, which numpy >= 2.4 refuses for
    arrays of rank 1: read its one element instead (the value is the same)."""
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_index

KINDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# rows no block width divides; 2 super-blocks, and 3 for Q6_K (an odd count: its rows then not word aligned)
SHAPES = {"Q4_K": (37, 512), "Q5_K": (37, 512), "Q6_K": (37, 768)}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(kind: str, rows: int, cols: int) -> list[str]:
    """The failures of one weight (empty when every check holds)."""
    raw = torch.from_numpy(random_kquant(rows, cols, kind, np.random.default_rng(rows)))
    w = K_FORMATS[KINDS[kind]](raw, rows, cols, torch.float32)
    ref = w.dequantize(torch.float32)                                   # [out, in]
    bad = []
    nb = cols // 256
    for split in sorted({1, nb}):
        launch = {"BLOCK_N": 32, "SPLIT_K": split}
        hot = torch.randperm(cols, generator=torch.Generator().manual_seed(split))[:4]
        eye = torch.zeros(4, cols)
        eye[torch.arange(4), hot] = 1.0
        for m in (1, 4):
            if not torch.equal(kquant_gemv(w, eye[:m], launch=launch), ref[:, hot[:m]].t()):
                bad.append(f"{kind} {rows}x{cols} split {split}: one-hot rows ({m}) are not the CPU weights")
        x = torch.randn(4, cols, generator=torch.Generator().manual_seed(7))
        four = kquant_gemv(w, x, launch=launch)
        err = _rel(four, x.double() @ ref.double().t())
        if err > 2e-6:
            bad.append(f"{kind} {rows}x{cols} split {split}: fp32 rows {err:.2e} from the float64 product")
        for m in (1, 2, 3):
            if not torch.equal(kquant_gemv(w, x[:m], launch=launch), four[:m]):
                bad.append(f"{kind} {rows}x{cols} split {split}: a row's bits change with {m} rows beside it")
        for dtype in (torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            got = kquant_gemv(w, xd, launch=launch).float()
            want = kquant_gemv(w, xd.float(), launch=launch)
            # fp16: the same bits; bf16: within one bf16 step (the interpreter's fp32 -> bf16 rounding is not
            # torch's), which still catches a swapped or misplaced half of a word
            step = 0.0 if dtype == torch.float16 else 2.0 ** -7
            if not torch.allclose(got, want.to(dtype).float(), rtol=step, atol=0.0):
                bad.append(f"{kind} {rows}x{cols} split {split}: {dtype} rows differ from the same rows in fp32")
    return bad


def main() -> int:
    failures = []
    for kind, (rows, cols) in SHAPES.items():
        bad = check(kind, rows, cols)
        print(f"{kind} {rows}x{cols}: {'ok' if not bad else 'FAILED'}")
        failures += bad
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
