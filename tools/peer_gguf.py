"""Write a random-weight llama GGUF (F16) of a given shape with llama.cpp's own gguf-py, for the peer run of
``tools/peer_llamacpp.sh`` (llama-quantize then makes Q8_0 / Q4_0 / Q4_K_M from it).

    python tools/peer_gguf.py OUT.gguf --gguf-py DIR [--hidden 3072 --layers 28 --heads 24 --kv-heads 8
                                                      --ffn 8192 --vocab 49152]

The vocabulary is llama.cpp's "none" tokenizer with ``vocab_size`` dummy tokens: llama-bench draws random token
ids, so no tokenizer is needed. Weights are N(0, 0.02) (norms 1), seeded.

``--q4-k-m`` writes the matrices directly as random Q4_K / Q6_K super-blocks in llama-quantize's Q4_K_M mix
(output, and attn_v / ffn_down of the layers ``use_more_bits`` picks, in Q6_K; the rest Q4_K): the same bytes per
token without the llama.cpp build, for edgespec's side alone (``python -m edgespec.bench.gguf_file``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


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
    ap.add_argument("--q4-k-m", action="store_true", help="random K-quant blocks in the Q4_K_M mix (see above)")
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf

    h, hd = args.hidden, args.hidden // args.heads
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("edgespec-peer-random")
    w.add_context_length(args.ctx)
    w.add_embedding_length(h)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(args.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if args.q4_k_m else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("none")
    ones = np.ones(h, dtype=np.float32)

    def more_bits(layer: int) -> bool:     # llama.cpp's use_more_bits(i_layer, n_layers)
        n = args.layers
        return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2

    def matrix(name: str, rows: int, cols: int, layer: int = -1) -> None:
        if not args.q4_k_m:
            w.add_tensor(name, rand(rows, cols))
            return
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the checkout's edgespec, installed or not
        from edgespec.weights.gguf_kquants import random_kquant
        role = name.split(".")[-2]
        six = role == "output" or role in ("attn_v", "ffn_down") and more_bits(layer)
        kind = "Q6_K" if six else "Q4_K"
        w.add_tensor(name, random_kquant(rows, cols, kind, rng), raw_dtype=getattr(gguf.GGMLQuantizationType, kind))

    matrix("token_embd.weight", args.vocab, h)
    w.add_tensor("output_norm.weight", ones)
    matrix("output.weight", args.vocab, h)
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        matrix(p + "attn_q.weight", args.heads * hd, h, i)
        matrix(p + "attn_k.weight", args.kv_heads * hd, h, i)
        matrix(p + "attn_v.weight", args.kv_heads * hd, h, i)
        matrix(p + "attn_output.weight", h, args.heads * hd, i)
        w.add_tensor(p + "ffn_norm.weight", ones)
        matrix(p + "ffn_gate.weight", args.ffn, h, i)
        matrix(p + "ffn_up.weight", args.ffn, h, i)
        matrix(p + "ffn_down.weight", h, args.ffn, i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
