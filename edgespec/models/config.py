"""The architecture description every target model is built from (parsed from a HF ``config.json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

LayerKind = Literal["full_attention", "linear_attention"]


@dataclass
class VisionConfig:
    """The vision tower of a Qwen3.5/3.6 (or Qwen3-VL) checkpoint (``vision_config`` of ``config.json``).

    An image is cut into ``patch_size`` squares, each repeated to ``temporal_patch_size`` frames (a still image is a
    two-frame clip), embedded, run through ``depth`` ViT blocks, and every ``spatial_merge_size`` x
    ``spatial_merge_size`` block of patches is merged into one token of the text model's hidden size
    (``out_hidden_size``). ``deepstack_visual_indexes``: blocks whose output is merged again and added to the text
    model's hidden states at the image rows after its first decoder layers (Qwen3-VL; empty for Qwen3.5).
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    deepstack_visual_indexes: list[int] = field(default_factory=list)
    # Token ids of the text model's vocabulary that frame an image in a prompt.
    image_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x frames x patch x patch (the processor's layout)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text token."""
        return self.spatial_merge_size ** 2


@dataclass
class ModelConfig:
    """Shape and math switches of a target model. ``family`` selects the implementation.

    family: ``llama`` (Llama, SmolLM2; no q/k norm), ``qwen3`` (Llama + per-head q/k RMSNorm),
    ``qwen3_5`` (hybrid Gated DeltaNet + gated full attention, zero-centred norms). ``num_experts`` > 0 makes
    every layer's MLP a routed mixture of experts with a gated shared expert (``qwen3_5_moe``; edgespec.models.moe).
    """

    family: Literal["llama", "qwen3", "qwen3_5"]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: list[LayerKind] = field(default_factory=list)
    # Gated DeltaNet (qwen3_5 only)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Which key head each value head reads when there are more value heads than key heads (r = hv / hk):
    # "grouped" (HF checkpoints) -- value heads r*g .. r*g+r-1 share key head g; "tiled" (llama.cpp's qwen35 GGUFs,
    # whose converter reorders the value heads so ggml can broadcast) -- value head h reads key head h % hk.
    linear_value_head_order: Literal["grouped", "tiled"] = "grouped"
    mtp_num_hidden_layers: int = 0
    # Mixture of experts (qwen3_5_moe): router over num_experts, num_experts_per_tok routed experts of width
    # moe_intermediate_size per token, plus a shared expert of width shared_expert_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Multimodal RoPE (Qwen3.5/3.6, Qwen3-VL): the rotary frequencies split into temporal, height and width
    # sections (``mrope_section``, in frequency pairs), interleaved t,h,w,t,h,w,... or in three runs. For text the
    # three positions are equal and it is plain RoPE; image tokens get their own (t, h, w) (edgespec.models.mrope).
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = True
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        dim = int(self.head_dim * self.partial_rotary_factor)
        return dim - dim % 2

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a mixture of experts (edgespec.models.moe)."""
        return self.num_experts > 0

    @property
    def zero_centred_norms(self) -> bool:
        """Qwen3.5 norms scale by (1 + w); Llama/Qwen3 by w."""
        return self.family == "qwen3_5"

    @property
    def has_qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_5")

    @property
    def gated_attention(self) -> bool:
        """Qwen3.5 full attention: q_proj emits [q | gate] per head and the output is multiplied by sigmoid(gate)."""
        return self.family == "qwen3_5"

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim)
