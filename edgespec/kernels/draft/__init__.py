"""Kernels of a DFlash drafter's step outside its layers: the DFlash2 candidate selector's scores and greedy walk, and
the append of verified rows to the drafter's context window (features, every layer's K/V, positions)."""
