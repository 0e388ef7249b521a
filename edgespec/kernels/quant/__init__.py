"""Linear products ``y = x W^T``: the dispatch (:mod:`.linear`, which routes each call by format, rows and device)
and its kernels: the dense few-row GEMV / skinny GEMM, the packed formats (int4, NVFP4, block FP8, MXFP4; the torch
oracle in :mod:`.quant_ref`), block-scaled tensor-core products with their twin, GGUF K-quants, per-row FP8, the
dequantize-then-GEMM prefill, and the 16-row-block launch plumbing they share."""
