"""The ``edgespec quantize`` flags, apart from the quantizer (``edgespec.convert.quantize``) so that parsing them,
and ``--help``, imports no torch."""

from __future__ import annotations

import argparse

# What --format offers: int4 (AWQ GEMM layout), nvfp4 (ModelOpt), fp8 (Qwen block FP8).
FORMATS = ("int4", "nvfp4", "fp8")


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``edgespec quantize`` on its parser ``p``."""
    p.add_argument("src", help="source checkpoint folder (bf16/fp16/fp32 safetensors + config.json)")
    p.add_argument("dst", help="output folder (created; must be empty unless --force)")
    p.add_argument("--format", required=True, choices=FORMATS, help="int4 (AWQ GEMM layout), nvfp4 (ModelOpt), "
                   "fp8 (Qwen block FP8)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                   help="keep matching layers unquantized (glob on the module name, or re:REGEX; repeatable)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (inputs per scale)")
    p.add_argument("--quantize-mtp", action="store_true", help="quantize the MTP layers too (default: keep them)")
    p.add_argument("--drop-mtp", action="store_true", help="leave the MTP weights out of the output")
    p.add_argument("--shard-mb", type=int, default=4096, help="output shard size in MB")
    p.add_argument("--force", action="store_true", help="write into a non-empty DST")
