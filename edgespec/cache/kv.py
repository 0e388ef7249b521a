"""Preallocated KV cache of one full-attention layer, in the model dtype or FP8 e4m3 with per-token-head scales.

The buffers are sized to ``max_len`` at start-up and never reallocated: a decode step, a verify of K+1 rows and
a rollback touch only rows of the existing tensors. Truncation is O(1) because the valid length lives in the
owning :class:`~edgespec.cache.model_cache.ModelCache`, not here.

FP8 layout: ``k`` is ``float8_e4m3fn [max_len, n_kv_heads, head_dim]``, ``v`` is key-blocked and transposed,
``float8_e4m3fn [cdiv(max_len, v_block), n_kv_heads, head_dim, v_block]`` (key ``n`` of head ``h``, column ``d`` at
``v[n // v_block, h, d, n % v_block]``), and ``k_scale``/``v_scale`` are ``float32 [max_len, n_kv_heads]``. Why V
is stored that way: the ``p . V`` product reduces over keys, and the tensor cores take that operand as pairs of
consecutive keys. A 16-bit V is transposed on the way by ``ldmatrix``, which has no 8-bit form on sm_90, so a
key-major e4m3 V was gathered byte by byte from shared memory (128 byte loads per thread per 32-key tile); with the
keys contiguous the tile is copied and converted as 16-byte vectors (see ``triton_attention``). ``v_block=0`` keeps
the key-major layout (benchmarks compare the two); model-dtype caches are always key-major.

Each (token, head) vector is scaled by its own amax / 448 before the cast, so outlier heads and tokens keep their
precision (FlashRT fixes one scale at 1.0, which clips and underflows). Rows are quantised once, when written, and
every later read sees exactly the same values: decode, verify and replay all attend over identical keys, which is
what lets speculative output equal plain output in FP8 mode.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Keys per block of an FP8 cache's transposed V: one 32-key attention tile is one contiguous 8 KB run at hd 256
# (a multiple of 16 keys: the attention kernel reads 16-key vectors).
V_BLOCK = 32
# Smallest scale: keeps all-zero rows finite (0 / tiny = 0) without dividing by zero.
_MIN_SCALE = 1e-12


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to e4m3 with one float32 scale per leading index."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def lazy_zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` zeros of ``dtype`` on the CPU whose pages become resident only when written: an anonymous mapping
    straight from the OS (zero pages on first touch), where ``torch.zeros`` writes every byte and numpy's zeros ask
    for 2 MB huge pages (one written row then makes 2 MB resident). A KV cache preallocated to ``max_seq_len`` then
    costs memory for the rows in use (the demo's 4096 rows: 189 MB, of which a 300-token request writes 14 MB)."""
    import mmap

    import numpy as np

    nbytes = max(1, n * torch.empty((), dtype=dtype).element_size())
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)).view(dtype)[:n]   # numpy keeps the mapping alive


class KVCache:
    """K and V of one attention layer for positions ``0..max_len-1``."""

    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: bool = False, v_block: int | None = None,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``storage``: zero-filled K and V tensors ``[max_len, n_kv_heads, head_dim]`` of ``dtype`` to use instead
        of allocating them (a model's caches carved from one lazily zeroed block: :func:`lazy_zeros`)."""
        self.max_len = max_len
        self.dtype = dtype  # compute dtype reads are returned in
        self.fp8 = fp8
        # Keys per block of the transposed V (FP8 only; 0: key-major V).
        self.v_block = (V_BLOCK if v_block is None else int(v_block)) if fp8 else 0
        if self.v_block < 0 or self.v_block % 16:
            raise ValueError(f"v_block {v_block} must be 0 (key-major V) or a positive multiple of 16")
        store = FP8_DTYPE if fp8 else dtype
        shape = (max_len, n_kv_heads, head_dim)
        if storage is not None:
            if fp8 or any(t.shape != shape or t.dtype != dtype for t in storage):
                raise ValueError(f"KV storage must be two {dtype} tensors of shape {list(shape)} (no FP8)")
            self.k, self.v = storage
            return
        self.k = torch.zeros(shape, dtype=store, device=device)
        if self.v_block:
            # Zeroed: the attention kernel reads whole 16-key groups past the last row (with p = 0), which must
            # be finite.
            blocks = -(-max_len // self.v_block)
            self.v = torch.zeros((blocks, n_kv_heads, head_dim, self.v_block), dtype=store, device=device)
        else:
            self.v = torch.zeros(shape, dtype=store, device=device)
        if fp8:
            self.k_scale = torch.ones(max_len, n_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(max_len, n_kv_heads, dtype=torch.float32, device=device)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor | None = None) -> None:
        """Store rows ``start .. start+T-1`` from ``k, v [T, n_kv_heads, head_dim]``.

        With ``pos_t`` (the start as a device tensor) the rows are scattered with ``index_copy_``, so the same
        captured CUDA graph writes wherever the sequence currently ends.
        """
        if pos_t is not None:
            rows = pos_t + torch.arange(k.shape[0], device=k.device)
            if self.fp8:
                qk, sk = quantize_fp8(k)
                qv, sv = quantize_fp8(v)
                # index_copy_ has no float8 kernel: move the bytes as uint8.
                self.k.view(torch.uint8).index_copy_(0, rows, qk.view(torch.uint8))
                self._write_v_rows(rows, qv)
                self.k_scale.index_copy_(0, rows, sk)
                self.v_scale.index_copy_(0, rows, sv)
            else:
                self.k.index_copy_(0, rows, k.to(self.k.dtype))
                self.v.index_copy_(0, rows, v.to(self.v.dtype))
            return
        end = start + k.shape[0]
        if self.fp8:
            self.k[start:end], self.k_scale[start:end] = quantize_fp8(k)
            qv, self.v_scale[start:end] = quantize_fp8(v)
            if self.v_block:
                self._write_v_rows(torch.arange(start, end, device=v.device), qv)
            else:
                self.v[start:end] = qv
        else:
            self.k[start:end] = k
            self.v[start:end] = v

    @property
    def v_row_shape(self) -> tuple[int, int]:
        """``(n_kv_heads, head_dim)`` of one V row, whatever the layout."""
        return tuple(self.v.shape[1:3] if self.v_block else self.v.shape[1:])

    def v_strides(self) -> tuple[int, int, int]:
        """Element strides of V for kernels: (per key, per head, per key block); the unused one is 0 (key-major V
        has no blocks; blocked V steps one key by 1 within a block)."""
        if self.v_block:
            return 0, self.v.stride(1), self.v.stride(0)
        return self.v.stride(0), self.v.stride(1), 0

    def _v_by_row(self) -> torch.Tensor:
        """The blocked V as a ``[blocks, v_block, n_kv_heads, head_dim]`` view (row ``n`` at ``[n // vb, n % vb]``)."""
        return self.v.permute(0, 3, 1, 2)

    def _write_v_rows(self, rows: torch.Tensor, qv: torch.Tensor) -> None:
        """Store quantised V rows ``qv [T, n_kv_heads, head_dim]`` at positions ``rows`` (a device tensor)."""
        if not self.v_block:
            self.v.view(torch.uint8).index_copy_(0, rows, qv.view(torch.uint8))
            return
        # index_put_ has no float8 kernel either; a scatter into the permuted view, no host sync (graph-safe).
        self._v_by_row().view(torch.uint8)[rows // self.v_block, rows % self.v_block] = qv.view(torch.uint8)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the stored rows ``src`` to ``dst`` (device index tensors of one length), bytes and scales as they
        are: a tree verify's accepted rows move to the positions of their depths, exactly as written (an FP8 row is
        not quantised again). All rows are read before any is written, so the two sets may overlap."""
        k = self.k.view(torch.uint8) if self.fp8 else self.k
        k.index_copy_(0, dst, k.index_select(0, src))
        if self.v_block:
            by_row = self._v_by_row().view(torch.uint8)
            by_row[dst // self.v_block, dst % self.v_block] = by_row[src // self.v_block, src % self.v_block]
        else:
            v = self.v.view(torch.uint8) if self.fp8 else self.v
            v.index_copy_(0, dst, v.index_select(0, src))
        if self.fp8:
            self.k_scale.index_copy_(0, dst, self.k_scale.index_select(0, src))
            self.v_scale.index_copy_(0, dst, self.v_scale.index_select(0, src))

    def v_rows(self, end: int) -> torch.Tensor:
        """V of positions ``0 .. end-1`` as stored (e4m3 for FP8), ``[end, n_kv_heads, head_dim]``; a copy when V is
        blocked."""
        if not self.v_block:
            return self.v[:end]
        blocks = -(-end // self.v_block)
        return self._v_by_row()[:blocks].reshape(blocks * self.v_block, *self.v.shape[1:3])[:end]

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``0 .. end-1`` in the compute dtype (dequantised for FP8)."""
        if self.fp8:
            return (dequantize_fp8(self.k[:end], self.k_scale[:end], self.dtype),
                    dequantize_fp8(self.v_rows(end), self.v_scale[:end], self.dtype))
        return self.k[:end], self.v[:end]

    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.fp8:
            total += self.k_scale.nbytes + self.v_scale.nbytes
        return total
