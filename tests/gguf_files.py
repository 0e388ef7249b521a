"""Tiny llama-architecture GGUF files written by the tests (gguf-py's writer; blocks quantized by gguf.quants)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.weights.gguf_kquants import K_D_SCALE, random_kquant

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 96, 2, 4, 2, 256
CONTROL = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = ["Ġt", "Ġth", "Ġthe", "Ġrobot", "Ġcube", "Ġred"]
    return byte_chars + words + CONTROL


def write_tiny_gguf(path: Path, qtype: str = "Q4_1", *, embed_qtype: str = "Q8_0", arch: str = "llama",
                    tied: bool = True, seed: int = 0, hidden: int = HIDDEN, ffn: int = FFN,
                    mix: dict[str, str] | None = None, eos: bool = True,
                    chat_template: str = CHAT_TEMPLATE) -> Path:
    """A 2-layer llama GGUF whose matrices are quantized to ``qtype`` (the embedding to ``embed_qtype``;
    ``"F32"`` keeps a tensor dense). ``tied=False`` adds a separate ``output.weight`` (``qtype``). ``mix``: the
    type of some tensors by role (``attn_v``, ``ffn_down``, ``output`` ...), as llama.cpp's ``_M`` mixes do.
    ``eos=False`` leaves the end-of-generation token out of the metadata. K-quants need ``hidden`` and ``ffn``
    multiples of 256."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    rng = np.random.default_rng(seed)
    qwen3 = arch == "qwen3"      # q/k norms, head_dim in the metadata, Qwen2's pre-tokenizer (single digits)
    tokens = _vocab() + (["12"] if qwen3 else [])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if qwen3 else "default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in CONTROL else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "Ġt h", "Ġth e"] + (["1 2"] if qwen3 else []))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    if eos:
        w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(chat_template)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 0.2) -> None:
        role = name.split(".")[-2]
        kind = (mix or {}).get(role, kind) if len(shape) == 2 else kind
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind in K_D_SCALE:
            w.add_tensor(name, random_kquant(*shape, kind, rng), raw_dtype=getattr(Q, kind))
        elif kind == "F32":
            w.add_tensor(name, data)
        else:
            qt = getattr(Q, kind)
            w.add_tensor(name, quants.quantize(data, qt), raw_dtype=qt)

    head_dim = hidden // HEADS
    if qwen3:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    add("token_embd.weight", (len(tokens), hidden), embed_qtype, 1.0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32", 0.1)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32", 0.1)
        if qwen3:
            add(f"blk.{i}.attn_q_norm.weight", (head_dim,), "F32", 0.1)
            add(f"blk.{i}.attn_k_norm.weight", (head_dim,), "F32", 0.1)
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, hidden), qtype)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, hidden), qtype)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, hidden), qtype)
        add(f"blk.{i}.attn_output.weight", (hidden, HEADS * head_dim), qtype)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), qtype)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), qtype)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), qtype)
    add("output_norm.weight", (hidden,), "F32", 0.1)
    if not tied:
        add("output.weight", (len(tokens), hidden), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
