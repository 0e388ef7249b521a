"""Weight formats: how a linear layer's ``[out, in]`` matrix is stored in memory and multiplied.

One module per format (``dense`` here in ``base``; block-FP8, NVFP4, int4 AWQ/GPTQ and GGUF blocks in their own
modules). Each format is a :class:`~edgespec.weights.base.PackedWeight`: the packed tensors exactly as the
checkpoint stores them, a torch reference product that dequantizes one tile at a time inside the step (the CPU
path and the oracle of the fast kernels), and an optional fast kernel chosen per device.
"""

from edgespec.weights.base import PackedEmbedding, PackedLinear, PackedWeight, is_packed, register_format, weight_format

__all__ = ["PackedEmbedding", "PackedLinear", "PackedWeight", "is_packed", "register_format", "weight_format"]
