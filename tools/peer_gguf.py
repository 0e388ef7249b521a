"""Write a random-weight llama GGUF (F16) of a given shape with llama.cpp's own gguf-py, for the peer run of
``tools/peer_llamacpp.sh`` (llama-quantize then makes Q8_0 / Q4_0 / Q4_K_M from it).

    python tools/peer_gguf.py OUT.gguf --gguf-py DIR [--hidden 3072 --layers 28 --heads 24 --kv-heads 8
                                                      --ffn 8192 --vocab 49152]
    python tools/peer_gguf.py OUT.gguf --gguf-py DIR --moe 256 --experts-used 8 --expert-ffn 512 --head-dim 256
                              --hidden 2048 --layers 40 --heads 16 --kv-heads 2 --vocab 248320

``--moe E`` writes llama.cpp's ``qwen3moe`` (an attention-only MoE: q/k norms, E routed SwiGLU experts of width
``--expert-ffn`` per layer, top ``--experts-used``, no shared expert) instead of a dense llama: the expert
dimensions of Qwen3.5-35B-A3B without its Gated DeltaNet layers (llama.cpp's hybrid qwen35moe GGUF is not written
here), for the MoE peer row. At that size the F16 file would be ~66 GB, so ``--qtype Q4_K`` writes every matrix as
random Q4_K super-blocks directly (the output projection as Q6_K; the router and norms F32), from
:func:`edgespec.weights.gguf_kquants.random_kquant`. Decode speed does not depend on the values; the file is
Q4_K_S-like. ``--qtype Q4_K_M`` (or ``--q4-k-m``) writes llama-quantize's Q4_K_M mix instead (output, and attn_v /
ffn_down of the layers ``use_more_bits`` picks, in Q6_K; the rest Q4_K): the same bytes per token without the
llama.cpp build, for edgespec's side alone (``python -m edgespec.bench.gguf_file``).

The vocabulary is llama.cpp's "none" tokenizer with ``vocab_size`` dummy tokens: llama-bench draws random token
ids, so no tokenizer is needed. Weights are N(0, 0.02) (norms 1), seeded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def add_tensor(w, gguf):
    """``add(name, matrix)`` for an F16 array or a ``(bytes, quant type name)`` pair of random K-quant blocks."""
    def add(name: str, t) -> None:
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=getattr(gguf.GGMLQuantizationType, t[1]))
        else:
            w.add_tensor(name, t)
    return add


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--moe", type=int, default=0, help="routed experts per layer: write qwen3moe (0: a dense llama)")
    ap.add_argument("--experts-used", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=0, help="attention head width (0: hidden / heads)")
    ap.add_argument("--qtype", default="F16", choices=("F16", "Q4_K", "Q4_K_M"), help="matrices as F16, or as "
                    "random Q4_K blocks (output Q6_K), or in the Q4_K_M mix, written directly")
    ap.add_argument("--q4-k-m", action="store_true", help="the same as --qtype Q4_K_M")
    args = ap.parse_args()
    if args.q4_k_m:
        args.qtype = "Q4_K_M"
    if args.moe and not 0 < args.experts_used <= args.moe:
        ap.error(f"--experts-used {args.experts_used} must be 1..{args.moe}")
    sys.path.insert(0, args.gguf_py)
    import gguf
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the checkout's edgespec, installed or not
    from edgespec.weights.gguf_kquants import random_kquant

    h, hd = args.hidden, args.head_dim or args.hidden // args.heads
    rng = np.random.default_rng(0)

    def f16(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def more_bits(layer: int) -> bool:     # llama.cpp's use_more_bits(i_layer, n_layers)
        n = args.layers
        return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2

    def rand(*shape: int, qtype: str | None = None, layer: int = -1, role: str = ""):
        """A random matrix of ``shape`` (numpy order, input dim last) in ``--qtype`` (or ``qtype``); in the Q4_K_M
        mix, ``role`` and ``layer`` pick Q6_K where llama-quantize does."""
        qtype = qtype or args.qtype
        if qtype == "F16":
            return f16(*shape)
        if qtype == "Q4_K_M":
            qtype = "Q6_K" if role in ("attn_v", "ffn_down") and more_bits(layer) else "Q4_K"
        if shape[-1] % 256:
            raise SystemExit(f"--qtype {qtype}: the input width {shape[-1]} is not a multiple of 256")
        rows = int(np.prod(shape[:-1]))
        return random_kquant(rows, shape[-1], qtype, rng).reshape(*shape[:-1], -1), qtype

    w = gguf.GGUFWriter(args.out, "qwen3moe" if args.moe else "llama")
    w.add_name("edgespec-peer-random")
    w.add_context_length(args.ctx)
    w.add_embedding_length(h)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(hd)
    if args.moe:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_count(args.moe)
        w.add_expert_used_count(args.experts_used)
        w.add_expert_feed_forward_length(args.expert_ffn)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(args.vocab)
    w.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
                     "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}[args.qtype])
    w.add_tokenizer_model("none")
    ones = np.ones(h, dtype=np.float32)
    add = add_tensor(w, gguf)
    add("token_embd.weight", rand(args.vocab, h))
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", rand(args.vocab, h, qtype="Q6_K" if args.qtype != "F16" else None))
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        add(p + "attn_q.weight", rand(args.heads * hd, h))
        add(p + "attn_k.weight", rand(args.kv_heads * hd, h))
        add(p + "attn_v.weight", rand(args.kv_heads * hd, h, layer=i, role="attn_v"))
        add(p + "attn_output.weight", rand(h, args.heads * hd))
        w.add_tensor(p + "ffn_norm.weight", ones)
        if args.moe:
            E, f = args.moe, args.expert_ffn
            w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(p + "ffn_gate_inp.weight", f16(E, h).astype(np.float32))     # the router stays float
            add(p + "ffn_gate_exps.weight", rand(E, f, h))                # GGUF dims reversed: {h, f, E}
            add(p + "ffn_up_exps.weight", rand(E, f, h))
            add(p + "ffn_down_exps.weight", rand(E, h, f))
            continue
        add(p + "ffn_gate.weight", rand(args.ffn, h))
        add(p + "ffn_up.weight", rand(args.ffn, h))
        add(p + "ffn_down.weight", rand(h, args.ffn, layer=i, role="ffn_down"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
