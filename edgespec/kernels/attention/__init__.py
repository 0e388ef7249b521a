"""Attention and its prologue: causal GQA attention of new rows over the KV cache (torch reference, split-K
Triton, the Gluon FP8-KV decode), the DFlash draft block's attention, and the q/k norm + RoPE + KV-cache write."""
