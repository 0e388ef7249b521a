"""Checkpoint converters: each reads a checkpoint and writes a new one, in a layout edgespec and other runtimes load.

:mod:`~edgespec.convert.quantize` is ``edgespec quantize`` (a bf16/fp16/fp32 checkpoint -> block-FP8, NVFP4 or
AWQ int4); :mod:`~edgespec.convert.gguf` is ``edgespec convert`` (a GGUF -> safetensors, and the demo model).
Loading a checkpoint is :mod:`edgespec.loading`; packing weights after loading is
:mod:`edgespec.weights.requantize`.
"""
