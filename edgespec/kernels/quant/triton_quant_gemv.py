"""Weight-only quantized products ``y = x W^T`` for 1..64 activation rows (decode and verify) in Triton, reading
each packed weight byte once per call: ``int4`` (group-wise asymmetric, AWQ/GPTQ repacked), ``nvfp4`` (e2m1 with
per-16 e4m3 scales and a global fp32 scale) and ``fp8_block`` (e4m3 with 128x128 fp32 block scales), all in the
contract layouts of ``edgespec.kernels.quant.quant_ref`` (the torch reference each kernel is tested against).

Why these shapes: a batch-1 step is bound by the bytes of the weights, so a kernel must stream the packed bytes at
copy speed and do little enough arithmetic per byte to keep up (at 3 TB/s, a 4-bit weight arrives every ~0.15 ns
per chip, ~4 instructions per weight across an H100's 132 SMs). Each program owns ``BLOCK_N`` output rows and
walks its K range one tile at a time; a tile is one quantization group (int4: ``group_size`` inputs, so one scale
and zero per row; fp8: one 128x128 block, so one scale per program; nvfp4: 128 inputs, eight per-16 scales).

* Nibbles are never interleaved in registers: the low nibbles of a tile multiply the even inputs and the high
  nibbles the odd ones (two products over half-width tiles), so unpacking is one AND or one shift per weight.
* int4 codes become floats by OR-ing them into the mantissa of 2^23 (no integer-to-float conversion); the zero
  point is subtracted in the same register (``(2^23 + q) - (2^23 + z)``, exact), and the scale is applied to the
  accumulated tile, not to every weight.
* e2m1 codes are placed into fp16 bits (magnitude into the exponent/mantissa, sign into bit 15): that is the
  e2m1 value times 2^-14 exactly (subnormal codes included), folded into the block scale.
* ``DOT`` programs (2..16 rows, and one row where it pays) run the rows as one 16-row tensor-core tile over the
  dequantized bf16 tile; one row can also go down a CUDA-core path (``DOT=False``) that multiplies in fp32.
  17..64 rows (tree verification) run as one 32- or 64-row tile, so the weight is still read and decoded once.
* Narrow matrices split K across programs and sum fp32 partials in a fixed order (no atomics: the same bits on
  every run), with ``edgespec.kernels.quant.triton_gemv``'s split-sum kernel.

No repacking is needed for these loads (:func:`prepare_for_kernel` only checks the buffers), so the weight
classes' ``matmul_ref`` reads the very same tensors.

This module chooses and launches the products; the Triton programs are in
:mod:`edgespec.kernels.quant.triton_quant_kernels`, the word decode they share with the other packed products in
:mod:`edgespec.kernels.quant.triton_quant_tiles`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_launch
from edgespec.kernels.quant.triton_gemv import _split_sum_kernel
from edgespec.kernels.quant.triton_quant_kernels import (
    _fp8_block_kernel,
    _int4_gemv_h2_kernel,
    _int4_gemv_kernel,
    _int4_kernel,
    _int4_pair_dot_kernel,
    _nvfp4_kernel,
    _nvfp4_pair_dot_kernel,
)
from edgespec.kernels.quant.triton_quant_prefill import DEQUANT_GEMM_MIN_ROWS, dequant_gemm
from edgespec.kernels.quant.triton_quant_tiles import pair_order, wave_splits

MAX_ROWS = 16
# 17..WIDE_MAX_ROWS rows (tree and long-chain verifies): the same tiles with 32 or 64 activation rows in one row
# block, so each weight is still read and decoded once per call (no dequantize-then-GEMM below the crossover).
WIDE_MAX_ROWS = 64
FORMATS = ("int4", "nvfp4", "fp8_block")


# (format, row bucket: 1, 2..16 -> 16, 17..32 -> 32, 33..64 -> 64) -> the weight-major tile of
# edgespec.kernels.quant.triton_quant_wide where it beat this module's tiles on the Qwen3.5-27B stack on a 16-SM green
# context (tools/tile_sweep.py --sm-limit 16; figures: docs/benchmarks.md, "Weight-major tiles on Thor's SM
# budget"). Elsewhere (int4 1..32 rows, block-FP8 1..32) this module's activation-major tiles won and stay.
WIDE_LAUNCHES: dict[tuple[str, int], dict[str, int]] = {
    ("nvfp4", 1): {"T": 1, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 16): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 32): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("int4", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 1},
    ("fp8_block", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
}


def quant_config(fmt: str, N: int, K: int, M: int, sms: int) -> dict[str, int]:
    """Launch of one product: the per-matrix winners of ``tools/quant_bench.py --sweep`` (H100 2026-11-25; int4
    H200 2026-11-26, docs/quant_kernels.md). 1..16 rows: ``BLOCK_N`` weight rows per program, ``SPLIT_K`` K
    ranges when there are too few row blocks to fill the chip (about ``waves`` programs per SM). One int4/nvfp4
    row takes the CUDA-core path (int4: the word kernel with fp16-pair products, ``H2``; a vocabulary-wide int4
    matrix the pair tile), fp8 rows and 2+ rows the tensor-core tile (int4: the pair tile). More rows (prefill):
    64x128 output tiles, the row blocks of a weight tile side by side."""
    if M > WIDE_MAX_ROWS:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 1, "DOT": 1, "num_warps": 8, "num_stages": 3}
    if M > MAX_ROWS:
        # 17..64 rows: one row block of 32 or 64 rows, so a weight tile is decoded once for all of them; wider
        # weight blocks than at 16 rows, because every program reads the whole activation block from L2 once per
        # tile (at 64 rows and 64 weight rows that is as many L2 bytes as weight bytes). Warps, block widths and
        # where x is permuted once on the host (XPAIR) are the winners of tools/quant_bench.py --wide-sweep
        # (figures: docs/benchmarks.md, "Kernel launch choices")
        block_m = max(32, triton.next_power_of_2(M))
        block_n, x_pair = {("int4", 32): (128, 0), ("int4", 64): (64, 1), ("nvfp4", 32): (128, 1),
                           ("nvfp4", 64): (64, 1), ("fp8_block", 32): (64, 0), ("fp8_block", 64): (128, 0)}[
            fmt, block_m]
        warps, stages, waves = 4, 3, 2
        cfg = {"BLOCK_M": block_m, "DOT": 1, "PAIRS": int(fmt != "fp8_block"), "XPAIR": x_pair, "num_warps": warps,
               "num_stages": stages}
    elif fmt == "int4" and (M > 1 or N >= 65536) or fmt == "nvfp4" and M > 1:
        # 2..16 rows, and one int4 row of a vocabulary-wide matrix: the pair-ordered tensor-core tile
        # (``_int4_pair_dot_kernel``, ``_nvfp4_pair_dot_kernel``); the int4 lm_head asks L2 for its first lines
        # before the PDL wait
        block_n, warps, stages, waves = (64 if N <= 8192 else 128), 4, 3, 4
        # nvfp4 2..16 rows: x permuted once on the host (XPAIR) rather than in every program, which won there
        cfg = {"BLOCK_M": 16, "DOT": 1, "PAIRS": 1, "PREFETCH": 4 if N >= 65536 else 0, "num_warps": warps,
               "num_stages": stages, "XPAIR": int(fmt == "nvfp4" and M > 1)}
    elif M == 1 and fmt != "fp8_block":
        block_n, warps, stages, waves = {"int4": (64, 4, 3, 4), "nvfp4": (32, 4, 4, 4)}[fmt]
        cfg = {"BLOCK_M": 16, "DOT": 0, "num_warps": warps, "num_stages": stages, "H2": int(fmt == "int4")}
    else:
        # fp8: one row rides the 16-row tensor-core tile too (it won the per-matrix sweep on most 27B matrices), so
        # a decode row and a verify row take the same launch
        block_n, warps, stages, waves = (128, 4, 3, 2) if fmt != "fp8_block" else (32, 4, 4, 4)
        cfg = {"BLOCK_M": 16, "DOT": 1, "num_warps": warps, "num_stages": stages}
    wide = WIDE_LAUNCHES.get((fmt, 1 if M == 1 else 16 if M <= MAX_ROWS else 32 if M <= 32 else 64))
    if wide is not None:      # a tile of edgespec.kernels.quant.triton_quant_wide won this row bucket
        cfg, block_n = {**cfg, **wide}, wide["BLOCK_N"]
    n_blocks = triton.cdiv(N, block_n)
    n_tiles = triton.cdiv(K, 128)
    want = waves * sms
    if M == 1:
        # one row: the smallest even K split that reaches the programs wanted, which won the per-matrix split sweep
        # on the 4B's 2560-wide matrices (tools/tile_sweep.py --split-shape; figures: docs/benchmarks.md)
        splits = wave_splits(n_blocks, n_tiles, want)
    else:
        splits = 1 if n_blocks >= want // 2 else max(1, min(triton.cdiv(want, n_blocks), n_tiles // 4))
    # PDL (where the device has it) for int4 only: it made the int4 products faster and the 16-row tiles of
    # block-FP8 and NVFP4 slower (figures: docs/benchmarks.md, "Kernel launch choices"); WIDE_LAUNCHES name their own
    return {**cfg, "BLOCK_N": block_n, "SPLIT_K": splits, "PDL": cfg.get("PDL", int(fmt == "int4"))}


def _check(packed, x: torch.Tensor) -> None:
    fmt = packed.format
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"{fmt} product: x {tuple(x.shape)} does not end in in_features={packed.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{fmt} product: x must be bf16 or fp16, got {x.dtype}")
    if fmt == "int4" and (packed.group_size not in (32, 64, 128, 256) or packed.in_features % packed.group_size):
        raise ValueError(f"int4 product: group size {packed.group_size} must be 32..256 (a power of two) and "
                         f"divide in_features={packed.in_features}")
    if fmt == "nvfp4" and packed.in_features % 128:
        raise ValueError(f"nvfp4 product: in_features={packed.in_features} must be a multiple of 128")


def quant_matmul(packed, x: torch.Tensor, bias: torch.Tensor | None = None,
                 config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` for bf16/fp16 ``x`` and a packed weight with the contract buffer names
    (``packed.format`` picks the kernel), output in x's dtype. 1..16 rows: the decode/verify launch; 17..64
    (:data:`WIDE_MAX_ROWS`): the same tiles with one 32- or 64-row block (each weight read once); below
    ``DEQUANT_GEMM_MIN_ROWS[format]``: the many-row launch of the same kernels; more (prefill): dequantize-then-GEMM.
    ``config`` overrides the launch (benchmark sweeps; ``DEQUANT`` 0/1 forces the fused or the GEMM path)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _check(packed, x2)
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    fmt = packed.format
    cfg = {**quant_config(fmt, N, K, M, sm_count(x.device)), **(config or {})}
    if cfg.get("DEQUANT", int(M >= DEQUANT_GEMM_MIN_ROWS[fmt])):
        # prefill: dequantize a band of rows, multiply on the tensor cores (edgespec.kernels.quant.triton_quant_prefill)
        return dequant_gemm(packed, x2, bias).reshape(*lead, N)
    if cfg.get("T", 0) and M <= WIDE_MAX_ROWS:
        # the weight-major tiles (weights the left MMA operand): edgespec.kernels.quant.triton_quant_wide
        from edgespec.kernels.quant.triton_quant_wide import wide_t_matmul
        y = wide_t_matmul(packed, x2, bias, cfg, sm_count(x.device))
        if y is not None:
            return y.reshape(*lead, N)
    tiling = _tiling(packed, M, cfg)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part = y if tiling.direct else torch.empty((tiling.splits, M, N), dtype=torch.float32, device=x.device)
    # PDL (SM90+): the next launch is scheduled while this one drains; every kernel waits for its predecessor first
    pdl = pdl_launch(x.device) if cfg.get("PDL", 0) else {}
    _launch_fused(packed, x2, bias, cfg, tiling, part, y, pdl)
    if not tiling.direct:
        _split_sum_kernel[(M, triton.cdiv(N, 1024))](
            part, bias if bias is not None else part, y, M, N, tiling.splits, part.stride(0), part.stride(1),
            y.stride(0), HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(tiling.splits)),
            BLOCK=1024, num_warps=4, PDL=bool(pdl), **pdl)
    return y.reshape(*lead, N)


@dataclass(frozen=True)
class _Tiling:
    """How one fused product of :func:`quant_matmul` is cut: row and column blocks, K tiles and their split."""

    many: bool          # more than WIDE_MAX_ROWS rows: the many-row launch (row blocks on the grid)
    block_m: int
    block_n: int
    tile: int           # K elements per scale tile (the int4 group, else 128)
    n_tiles: int
    splits: int         # K split across programs (1: each program writes its output directly)
    per_split: int

    @property
    def direct(self) -> bool:
        return self.splits == 1

    def grid(self, M: int, N: int) -> tuple[int, int]:
        return (triton.cdiv(N, self.block_n) * (triton.cdiv(M, self.block_m) if self.many else 1), self.splits)


def _tiling(packed, M: int, cfg: dict[str, int]) -> _Tiling:
    """The tiling of a fused product of ``M`` rows; sets ``cfg``'s ``DOT`` (tensor-core dot above one row) and
    ``SPLIT_K`` (none for many rows) in place, as the launch reads them."""
    many = M > WIDE_MAX_ROWS
    # 1..16 rows: one 16-row tile; 17..64: one row block of 32 or 64 (never fewer rows than M: one weight read)
    block_m = cfg["BLOCK_M"] if many else 16 if M <= MAX_ROWS else max(cfg["BLOCK_M"], triton.next_power_of_2(M))
    if M > 1:
        cfg["DOT"] = 1
    if many:
        cfg["SPLIT_K"] = 1
    block_n = cfg["BLOCK_N"]
    if packed.format == "fp8_block" and 128 % block_n:
        raise ValueError(f"fp8_block product: BLOCK_N {block_n} must divide the 128-row scale block")
    tile = 128 if packed.format != "int4" else packed.group_size
    n_tiles = triton.cdiv(packed.in_features, tile)
    splits = max(d for d in range(1, min(cfg["SPLIT_K"], n_tiles) + 1) if n_tiles % d == 0)
    return _Tiling(many, block_m, block_n, tile, n_tiles, splits, n_tiles // splits)


def _launch_fused(packed, x2: torch.Tensor, bias: torch.Tensor | None, cfg: dict[str, int], t: _Tiling,
                  part: torch.Tensor, y: torch.Tensor, pdl: dict) -> None:
    """Launch the format's fused kernel: into ``y`` directly, or per K split into ``part`` (summed after)."""
    fmt, direct, tile, n_tiles, per_split = packed.format, t.direct, t.tile, t.n_tiles, t.per_split
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    b = bias if bias is not None else y
    grid = t.grid(M, N)
    launch = dict(PDL=bool(pdl), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    common = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, DOT=bool(cfg["DOT"]), DIRECT=direct,
                  HAS_BIAS=bias is not None, M_FAST=t.many, **launch)
    ps, pm = (part.stride(0), part.stride(1)) if not direct else (0, 0)
    pairs = fmt in ("int4", "nvfp4") and cfg["DOT"] and cfg.get("PAIRS", 0) and not t.many
    x_paired = bool(pairs and cfg.get("XPAIR", 0))
    xk = pair_order(x2) if x_paired else x2
    if fmt == "int4" and pairs:
        q, s, z = packed.qweight, packed.scales, packed.zeros
        qw = q.view(torch.int32)                 # 8 codes per word: rows of in/2 bytes are whole words
        _int4_pair_dot_kernel[grid](xk, qw, s, z, part, b, y, M, N, n_tiles, per_split, xk.stride(0), qw.stride(0),
                                    s.stride(0), z.stride(0), ps, pm, y.stride(0), GROUP=tile, BLOCK_M=t.block_m,
                                    BLOCK_N=t.block_n, IS_BF16=x2.dtype == torch.bfloat16, DIRECT=direct,
                                    HAS_BIAS=bias is not None, PREFETCH=cfg.get("PREFETCH", 0) if pdl else 0,
                                    X_PAIRED=x_paired, **launch)
    elif fmt == "int4" and M == 1 and not cfg["DOT"] and cfg.get("WORDS", 1):
        q, s, z = packed.qweight, packed.scales, packed.zeros
        qw = q.view(torch.int32)                 # 8 codes per word: rows of in/2 bytes are whole words
        kern = _int4_gemv_h2_kernel if cfg.get("H2", 0) else _int4_gemv_kernel
        kern[grid](x2, qw, s, z, part, b, y, M, N, n_tiles, per_split, qw.stride(0), s.stride(0),
                   z.stride(0), ps, GROUP=tile, BLOCK_N=t.block_n, DIRECT=direct, HAS_BIAS=bias is not None,
                   **launch)
    elif fmt == "int4":
        q, s, z = packed.qweight, packed.scales, packed.zeros
        _int4_kernel[grid](x2, q, s, z, part, b, y, M, N, n_tiles, per_split, x2.stride(0), q.stride(0),
                           s.stride(0), z.stride(0), ps, pm, y.stride(0), GROUP=tile, **common)
    elif fmt == "nvfp4" and pairs:
        qw = packed.weight.view(torch.int32)     # 8 codes per word: rows of in/2 bytes are whole words
        s = packed.weight_scale
        _nvfp4_pair_dot_kernel[grid](xk, qw, s, packed.weight_scale_2, part, b, y, M, N, n_tiles, per_split,
                                     xk.stride(0), qw.stride(0), s.stride(0), ps, pm, y.stride(0),
                                     BLOCK_M=t.block_m, BLOCK_N=t.block_n, IS_BF16=x2.dtype == torch.bfloat16,
                                     DIRECT=direct, HAS_BIAS=bias is not None, X_PAIRED=x_paired, **launch)
    elif fmt == "nvfp4":
        q, s = packed.weight, packed.weight_scale
        _nvfp4_kernel[grid](x2, q, s, packed.weight_scale_2, part, b, y, M, N, n_tiles, per_split, x2.stride(0),
                            q.stride(0), s.stride(0), ps, pm, y.stride(0), TILE=tile, **common)
    elif fmt == "fp8_block":
        w, s = packed.weight, packed.weight_scale_inv
        _fp8_block_kernel[grid](x2, w, s, part, b, y, M, N, K, n_tiles, per_split, x2.stride(0), w.stride(0),
                                s.stride(0), ps, pm, y.stride(0), EVEN_K=K % 128 == 0, **common)
    else:
        raise ValueError(f"no Triton product for weight format {fmt!r}")


def quant_kernel(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``PackedWeight.kernel`` signature: the Triton product for bf16/fp16 CUDA inputs without autograd,
    the format's torch reference (``packed.matmul_ref``) for anything else (CPU tensors, fp32, gradients)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled():
        return quant_matmul(packed, x, bias)
    return packed.matmul_ref(x, bias)


# Lowest compute capability each kernel runs on: bf16 tensor-core tiles need SM80; e4m3 conversions SM89.
MIN_CAPABILITY = {"int4": (8, 0), "nvfp4": (8, 0), "fp8_block": (8, 9)}


def choose_quant_kernel(packed, capability: tuple[int, int] | None = None):
    """The fast product for a packed weight on its device (for the arch hooks to store in ``packed.kernel``), or
    None when there is none (CPU, no Triton, an unknown format, too old a GPU, a shape the kernels refuse).
    ``capability``: choose for that compute capability, wherever the weight lives (``compile_targets``).

    These are the Hopper-shaped products; from compute capability 10 the Thor hooks give NVFP4 and MXFP4 the
    block-scaled MMA instead (``edgespec.kernels.quant.triton_block_scaled``)."""
    from edgespec.kernels import triton_available
    fmt = getattr(packed, "format", None)
    if fmt not in MIN_CAPABILITY or not triton_available():
        return None
    dev = packed.weight.device if fmt != "int4" else packed.qweight.device
    if capability is None and dev.type != "cuda":
        return None
    if (capability or torch.cuda.get_device_capability(dev)) < MIN_CAPABILITY[fmt]:
        return None
    if fmt == "int4" and (packed.group_size not in (32, 64, 128, 256) or packed.in_features % packed.group_size):
        return None
    if fmt == "nvfp4" and packed.in_features % 128:
        return None
    if fmt == "fp8_block" and _fp8_block_shape(packed) != (128, 128):
        return None     # the tile reads one scale per 128x128 block (compressed-tensors may declare others)
    return quant_kernel


def _fp8_block_shape(packed) -> tuple[int, int]:
    """The scale block of a block-FP8 weight: a packed FP8BlockWeight names it; the kernel view
    (``quant_ref.RawPacked``) keeps its square group."""
    block = getattr(packed, "block", None) or (packed.group_size, packed.group_size)
    return int(block[0]), int(block[1])


def prepare_for_kernel(packed):
    """Make ``packed``'s buffers ready for :func:`quant_kernel` in place and return it. The kernels read the
    contract layouts as they are (no transposition or nibble shuffle pays: rows are streamed along K either
    way), so this only makes the buffers row-contiguous (a no-op for loaded weights) and checks their dtypes;
    ``matmul_ref`` keeps working on the same tensors."""
    names = {"int4": ("qweight", "scales", "zeros"), "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
             "fp8_block": ("weight", "weight_scale_inv")}[packed.format]
    dtypes = {"qweight": torch.uint8, "zeros": torch.uint8, "scales": torch.float16,
              "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32, "weight_scale_inv": torch.float32,
              "weight": torch.uint8 if packed.format == "nvfp4" else torch.float8_e4m3fn}
    for name in names:
        t = getattr(packed, name)
        if t.dtype != dtypes[name]:
            raise ValueError(f"{packed.format}.{name}: dtype {t.dtype}, expected {dtypes[name]}")
        if t.dim() == 2 and t.stride(-1) != 1:
            t = t.contiguous()
            if hasattr(packed, "tensors"):
                packed.tensors[name] = t
            else:
                setattr(packed, name, t)
    return packed
