"""The compiled CPU path: the C sources and per-ISA headers (``gguf_cpu.c``, ``gguf_kernels.c``, ``simd_*.h``; shipped
as package data), their build and ctypes binding (:mod:`.gguf_native`) and the fp32 step helpers on it
(:mod:`.cpu_step`)."""
