"""The verify forward's own kernels: the greedy verdict of a chain (row argmax, accepted prefix) and of a tree, and
attention, short convolution and Gated DeltaNet masked by the draft tree (:mod:`.tree`)."""
