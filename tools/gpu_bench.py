"""One GPU run of the whole speed sweep (same as ``edgespec bench shapes ...``).

    python tools/gpu_bench.py [--shapes smollm2-135m,qwen3.5-4b,...] [--compare-hf qwen3.5-4b] [--sweep-out DIR]

Prints a table last and writes ``gpu_bench.json`` (to --sweep-out, default $OUT). Thor figures are projections from
the measured bytes per token and Thor's 273 GB/s.
"""

from __future__ import annotations

import argparse
import sys

from edgespec.bench.gpu import add_sweep_arguments, run_sweep
from edgespec.config import load_settings
from edgespec.plan import install_kernel_options

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_sweep_arguments(parser)
    args = parser.parse_args()
    install_kernel_options(load_settings())   # the kernel switches of EDGESPEC_CONFIG / EDGESPEC_* (no engine here)
    sys.exit(run_sweep(args))
