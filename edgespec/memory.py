"""The memory budget of a served model, computed before a byte is allocated, and the peak measured after.

A model needs its weights, the preallocated caches (KV of the full-attention layers, GDN states with their
verify checkpoints), the drafter, and a workspace (activations of the largest forward, the reference product's
dequantized tile, allocator slack). :func:`plan_budget` adds these up from the config and the weights as they
will be held (exact: the module tree is built on the meta device first), compares them with the memory the
device has free -- ``torch.cuda.mem_get_info`` on a GPU, ``MemAvailable`` on the CPU and on Jetson Thor, whose GPU
shares the 128 GB with the CPU -- and :meth:`MemoryBudget.check` refuses up front, with the numbers, a
configuration that cannot fit. :func:`peak_bytes` is what a run actually used (CUDA allocator peak; the
process's ``VmHWM`` on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgespec.errors import EdgespecError
from edgespec.models.config import ModelConfig

GiB = 1 << 30
# Allocator slack and small buffers (rotary tables, graph pools, argmax scratch) on top of the counted parts.
SLACK_BYTES = 256 << 20
# Verify rows and prefill chunk the workspace is sized for when the caller does not say.
VERIFY_ROWS = 32
PREFILL_CHUNK = 512


def format_bytes(n: int) -> str:
    """``1.23 GiB`` from a GiB up, ``45.6 MiB`` below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


class MemoryBudgetError(EdgespecError):
    """The model, caches and drafter do not fit the memory the device has free."""


@dataclass
class MemoryBudget:
    """Bytes of each part of a served model and the bytes the device has free for them."""

    device: str
    weights: int
    kv_cache: int
    drafter: int
    workspace: int
    available: int
    # The vision tower (vision-language checkpoints): its weights, the activations of one image of the largest size
    # served and the encoder's cache of recent frames' tokens (vision_bytes). Image tokens sit in the KV cache's
    # max_seq_len rows like text (image_kv_bytes tells what one frame takes).
    vision: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.drafter + self.workspace + self.vision

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def lines(self) -> list[str]:
        """Human-readable split, one part per line."""
        rows = [("weights", self.weights), ("kv cache + states", self.kv_cache), ("drafter", self.drafter),
                ("workspace", self.workspace)] + ([("vision tower", self.vision)] if self.vision else []) + [
                ("total", self.total), (f"free on {self.device}", self.available)]
        return [f"{name:>18}: {format_bytes(value):>11}" for name, value in rows]

    def summary(self) -> str:
        f = format_bytes
        vision = f" + vision tower {f(self.vision)}" if self.vision else ""
        return (f"weights {f(self.weights)} + kv {f(self.kv_cache)} + drafter {f(self.drafter)} + workspace "
                f"{f(self.workspace)}{vision} = {f(self.total)}; free on {self.device}: {f(self.available)}")

    def check(self) -> None:
        """Raise :class:`MemoryBudgetError` naming every part when the total exceeds the free memory."""
        if not self.fits:
            raise MemoryBudgetError(
                f"the model does not fit {self.device}: {self.summary()}. Use a quantized checkpoint "
                f"(`edgespec quantize`), a shorter max_seq_len, the FP8 KV cache or a smaller drafter")

    def to_dict(self) -> dict[str, int | str]:
        return {"device": self.device, "weights": self.weights, "kv_cache": self.kv_cache, "drafter": self.drafter,
                "workspace": self.workspace, "vision": self.vision, "total": self.total, "available": self.available}


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers as held (meta tensors count as allocated)."""
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for name, b in module.named_buffers():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if name.rsplit(".", 1)[-1] not in getattr(owner, "_non_persistent_buffers_set", set()):
            total += b.numel() * b.element_size()
    return total


def kv_cache_bytes(cfg: ModelConfig, max_len: int, dtype: torch.dtype, kv_fp8: bool = False,
                   verify_rows: int = VERIFY_ROWS) -> int:
    """Bytes of the caches :meth:`TargetModel.new_cache` preallocates: K and V of every full-attention layer (FP8
    values plus a float32 scale per token and head, or the model dtype), GDN conv and recurrent states with a
    checkpoint slot per verify row and the deferred rows' inputs."""
    elt = torch.empty((), dtype=dtype).element_size()
    n_attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    per_tok = cfg.num_key_value_heads * (cfg.head_dim * (1 if kv_fp8 else elt) + (4 if kv_fp8 else 0))
    kv = 2 * n_attn * max_len * per_tok
    n_gdn = len(cfg.layer_types) - n_attn
    if not n_gdn:
        return kv
    conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elt
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    slots = verify_rows + 2
    pending = verify_rows * (2 * cfg.gdn_conv_dim * elt + 2 * cfg.linear_num_value_heads * 4)
    return kv + n_gdn * ((conv + rec) * slots + pending)


def drafter_window_bytes(layers: int, kv_heads: int, head_dim: int, hidden: int, window: int,
                         block_size: int) -> int:
    """Bytes of a DFlash / DFlash2 drafter's per-token context window (float32,
    :class:`~edgespec.drafters.window.FeatureWindow`): ``window`` features, every layer's keys and values of the
    window and one block of scratch rows, the slots' positions."""
    return 4 * window * hidden + 2 * 4 * layers * (window + block_size) * kv_heads * head_dim + 8 * window


def gdn_state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every Gated DeltaNet layer's recurrent (float32) and conv state: what one forward reads (and a
    commit writes back) besides weights and KV, whatever the context length."""
    elt = torch.empty((), dtype=dtype).element_size()
    n_gdn = sum(kind == "linear_attention" for kind in cfg.layer_types)
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return n_gdn * (rec + cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elt)


def workspace_bytes(cfg: ModelConfig, dtype: torch.dtype, packed: bool, rows: int = PREFILL_CHUNK) -> int:
    """Activations of the largest forward (``rows`` tokens: every projection's output, logits of the last row),
    plus the reference product's dequantized tile when some weight is packed (it also covers the GPU prefill's
    dequantized band, at most 128 MiB: ``edgespec.kernels.quant.triton_quant_prefill.BAND_ELEMENTS``), plus allocator
    slack."""
    from edgespec.weights.base import REF_TILE_ELEMENTS

    elt = torch.empty((), dtype=dtype).element_size()
    widest = max(2 * cfg.intermediate_size, cfg.gdn_conv_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
                 cfg.num_attention_heads * cfg.head_dim * 2 + 2 * cfg.num_key_value_heads * cfg.head_dim)
    acts = rows * (4 * cfg.hidden_size + 2 * widest) * max(elt, 4)
    logits = VERIFY_ROWS * cfg.vocab_size * 4 * 2
    tile = REF_TILE_ELEMENTS * 4 * 2 if packed else 0
    return acts + logits + tile + SLACK_BYTES


# The image size the vision budget is sized for when the caller does not say: a 1280x720 camera frame (resized to
# 1280x704 by the processor's multiple-of-32 rule).
VISION_PIXELS = 1280 * 704
# Frames whose tokens the encoder keeps (edgespec.models.multimodal.ImageEncoder).
ENCODER_CACHED = 4


def vision_bytes(cfg: ModelConfig, tower_weights: int, dtype: torch.dtype, pixels: int = VISION_PIXELS,
                 cached: int = ENCODER_CACHED) -> int:
    """The vision tower's part of the budget: its weights, the activations of one image of ``pixels`` pixels
    (after resizing: ``pixels / patch^2`` patches through a block -- residual, norm, q/k/v, MLP width, in float32
    where the rotary maths runs; attention runs fused, no patches x patches scores) and ``cached`` frames' tokens."""
    vis = cfg.vision
    if vis is None or not tower_weights:
        return 0
    elt = torch.empty((), dtype=dtype).element_size()
    patches = pixels // (vis.patch_size ** 2)
    per_patch = (6 * vis.hidden_size + vis.intermediate_size) * max(elt, 4) + vis.patch_dim * 4
    tokens = patches // vis.merge_unit
    cache = cached * tokens * vis.out_hidden_size * elt * (1 + len(vis.deepstack_visual_indexes))
    return tower_weights + patches * per_patch + cache


def image_kv_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype, kv_fp8: bool = False) -> int:
    """KV-cache bytes of ``tokens`` prompt rows (an image's tokens take rows like text; the cache is preallocated
    for max_seq_len, so this is the share of it one frame uses)."""
    elt = torch.empty((), dtype=dtype).element_size()
    n_attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    per_tok = cfg.num_key_value_heads * (cfg.head_dim * (1 if kv_fp8 else elt) + (4 if kv_fp8 else 0))
    return 2 * n_attn * tokens * per_tok


def available_bytes(device: torch.device) -> int:
    """Memory free for a new model on ``device``: the CUDA driver's free bytes, else ``MemAvailable``."""
    if device.type == "cuda" and not getattr(torch.cuda.get_device_properties(device), "is_integrated", False):
        return int(torch.cuda.mem_get_info(device)[0])
    # CPU, and integrated GPUs (Jetson Thor) whose memory is the system's: the kernel's estimate of what can be
    # allocated without swapping, page cache included (the driver's free figure leaves the cache out).
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def peak_bytes(device: torch.device) -> int:
    """The peak memory of this process so far: CUDA allocator peak on a GPU, ``VmHWM`` (peak RSS) on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return host_peak_rss()


def host_peak_rss() -> int:
    """Peak resident set of this process (``VmHWM``), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plan_budget(cfg: ModelConfig, weights: int, device: torch.device, dtype: torch.dtype, max_len: int,
                kv_fp8: bool = False, drafter: int = 0, packed: bool = False, vision_weights: int = 0,
                vision_pixels: int = VISION_PIXELS) -> MemoryBudget:
    """The :class:`MemoryBudget` of serving ``cfg`` with ``weights`` bytes of weights on ``device`` (and
    ``vision_weights`` of a vision tower serving images of up to ``vision_pixels``)."""
    return MemoryBudget(str(device), weights, kv_cache_bytes(cfg, max_len, dtype, kv_fp8), drafter,
                        workspace_bytes(cfg, dtype, packed), available_bytes(device),
                        vision_bytes(cfg, vision_weights, dtype, vision_pixels))
