"""Write a random-weight llama GGUF (F16) of a given shape with llama.cpp's own gguf-py, for the peer run of
``tools/peer_llamacpp.sh`` (llama-quantize then makes Q8_0 / Q4_0 / Q4_K_M from it).

    python tools/peer_gguf.py OUT.gguf --gguf-py DIR [--hidden 3072 --layers 28 --heads 24 --kv-heads 8
                                                      --ffn 8192 --vocab 49152]

The vocabulary is llama.cpp's "none" tokenizer with ``vocab_size`` dummy tokens: llama-bench draws random token
ids, so no tokenizer is needed. Weights are N(0, 0.02) (norms 1), seeded.
"""

from __future__ import annotations

import argparse
import sys

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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("none")
    ones = np.ones(h, dtype=np.float32)
    w.add_tensor("token_embd.weight", rand(args.vocab, h))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", rand(args.vocab, h))
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", rand(args.heads * hd, h))
        w.add_tensor(p + "attn_k.weight", rand(args.kv_heads * hd, h))
        w.add_tensor(p + "attn_v.weight", rand(args.kv_heads * hd, h))
        w.add_tensor(p + "attn_output.weight", rand(h, args.heads * hd))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", rand(args.ffn, h))
        w.add_tensor(p + "ffn_up.weight", rand(args.ffn, h))
        w.add_tensor(p + "ffn_down.weight", rand(h, args.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
