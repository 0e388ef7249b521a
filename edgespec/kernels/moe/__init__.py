"""Mixture-of-experts: routing, experts stacked per layer (dense, int4, NVFP4, block FP8) and their routed product,
each torch reference beside its Triton kernels (tensor-core tiles, CUDA-core few-row GEMVs, the fused route)."""
