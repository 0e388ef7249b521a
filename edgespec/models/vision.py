"""The vision tower of the Qwen3.5/3.6 (and Qwen3-VL) vision-language checkpoints: pixels in, text-model tokens out.

One image (``grid = (t, h, w)`` patches, from :mod:`edgespec.loading.images`) goes through

1. the patch embedding: each patch of ``in_channels x temporal_patch_size x patch_size x patch_size`` values (a still
   image repeats itself over the two frames) times one matrix -- the checkpoint's Conv3d, whose kernel equals its
   stride, read as the linear map it is;
2. a learned position embedding: a square grid of ``num_position_embeddings`` vectors resampled bilinearly (corners
   aligned) to the image's ``h x w`` patches;
3. ``depth`` pre-norm ViT blocks (LayerNorm, bidirectional attention within the image with 2-D rotary positions --
   half the rotary channels turn with the patch row, half with its column -- then a GELU MLP);
4. the merger: LayerNorm, then every 2 x 2 block of neighbouring patches (consecutive in the processor's order)
   concatenated and projected by a two-layer GELU MLP to the text model's hidden size: one text token each.

``deepstack_visual_indexes`` (Qwen3-VL): the outputs of those blocks pass their own mergers (LayerNorm after the
2 x 2 concatenation) and are added to the text model's hidden states at the image rows after its first decoder
layers (:class:`edgespec.models.multimodal.ImageRows`).

The parameters keep the checkpoint's names under ``model.visual.`` (loaded as ``visual.``); the linear layers are
:class:`~edgespec.models.layers.Linear`, so a checkpoint that quantized them loads them packed like the text
model's. The maths follows ``transformers``' ``Qwen3_5VisionModel``, which the golden test compares against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.kernels.quant.linear import linear
from edgespec.models.config import VisionConfig
from edgespec.models.layers import Linear


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding, kept under its checkpoint name (``proj``) and shape. On CUDA it runs as the
    product it is (one GEMM through :func:`~edgespec.kernels.quant.linear.linear`); elsewhere as the Conv3d itself,
    transformers' op and rounding (the CPU golden test's reference)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size,
                              kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
                              stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size), bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``patches [N, patch_dim]`` (channel, frame, row, column order) -> ``[N, hidden]``."""
        w = self.proj.weight
        x = patches.to(w.dtype)
        if x.device.type == "cuda":
            return linear(x, w.reshape(w.shape[0], -1), self.proj.bias)
        return self.proj(x.view(-1, *w.shape[1:])).view(x.shape[0], w.shape[0])


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(_act(self.act, self.linear_fc1(x)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches, 2-D rotary positions on q and k (in fp32)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.n_heads, self.hd = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]``; ``cos, sin [N, head_dim]`` float32 (:meth:`VisionTower.rotary`)."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.n_heads, self.hd).unbind(1)       # each [N, heads, hd]
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        # [1, heads, N, hd]: the fused (flash / memory-efficient) kernels take 4-D inputs; no N x N scores in memory
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return self.proj(out[0].transpose(0, 1).reshape(N, self.n_heads * self.hd))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2 x 2 patches -> one text token: LayerNorm (per patch, or after the concatenation: ``post_shuffle``), then
    ``fc2(gelu(fc1(.)))`` to ``out_hidden_size``."""

    def __init__(self, cfg: VisionConfig, post_shuffle: bool = False) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.width if post_shuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.post_shuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def interpolation_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (corners aligned) of target positions ``index`` on an axis of ``size`` into a ``side``-long
    table: the two source indices ``[n, 2]`` and their weights ``[n, 2]`` (float32)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def merge_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch in the processor's order: ``merge x merge`` blocks row-major, and within a
    block row-major (the order the merger concatenates). ``[h * w]`` each."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


class VisionTower(nn.Module):
    """``model.visual``: one image's patches ``[t*h*w, patch_dim]`` -> text-model tokens ``[t*h*w/4, out_hidden]``
    (and the deepstack features, if the config has them). See the module doc for the stages."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, post_shuffle=True) for _ in cfg.deepstack_visual_indexes])

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned position embedding resampled to the image's patches ``[t*h*w, hidden]`` (float32 weights
        times the table's rows, summed, cast to the table's dtype -- transformers' order)."""
        t, h, w = grid
        device = self.pos_embed.weight.device
        rows, cols = merge_order(h, w, self.config.spatial_merge_size, device)
        h_taps, h_w = interpolation_taps(rows, h, self.side)
        w_taps, w_w = interpolation_taps(cols, w, self.side)
        index = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        emb = (self.pos_embed(index) * weight[:, :, None]).sum(1)
        return emb.to(self.dtype).repeat(t, 1)

    def rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [t*h*w, head_dim]`` float32 of the 2-D rotary positions: the first quarter of the frequencies
        turns with the patch row, the second with its column, and the pair repeats over the two halves."""
        t, h, w = grid
        device = self.pos_embed.weight.device
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float,
                                                                  device=device) / quarter))
        rows, cols = merge_order(h, w, self.config.spatial_merge_size, device)
        freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1).repeat(t, 1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``patches [t*h*w, patch_dim]`` of one image -> (tokens ``[t*h*w/merge_unit, out_hidden]``, deepstack
        features of the same shape, one per ``deepstack_visual_indexes`` entry)."""
        t, h, w = grid
        if patches.shape != (t * h * w, self.config.patch_dim):
            raise ValueError(f"image patches {tuple(patches.shape)} do not fit grid {grid} "
                             f"(expected [{t * h * w}, {self.config.patch_dim}])")
        x = self.patch_embed(patches) + self.positions(grid)
        cos, sin = self.rotary(grid)
        deep: list[torch.Tensor] = []
        frame = h * w
        for i, block in enumerate(self.blocks):
            # Each frame attends within itself (a still image is one frame of two repeated time steps).
            x = torch.cat([block(x[s:s + frame], cos[s:s + frame], sin[s:s + frame])
                           for s in range(0, x.shape[0], frame)]) if t > 1 else block(x, cos, sin)
            if i in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)]
                deep.append(merger(x))
        return self.merger(x), deep
