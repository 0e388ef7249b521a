"""edgespec: batch-1 speculative decoding for robot agents on Jetson Thor and discrete NVIDIA GPUs."""

__version__ = "0.1.0"
