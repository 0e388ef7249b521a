"""Sequence mixers other than attention: Gated DeltaNet (recurrent, deferred advance, chunked prefill), the
depthwise causal conv1d in front of it, and the DFlash2 drafter's grouped dynamic convolution."""
