"""Per-row steps of a layer: the RMSNorm variants (standard, zero-centred, gated) and the activations (SwiGLU
``silu(gate) * up``, the Gated DeltaNet gates)."""
