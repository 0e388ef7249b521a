"""Side-by-side table of a peer run (tools/peer_llamacpp.sh): llama.cpp's llama-bench JSON per GGUF type and
edgespec's figures on the same shape (formats_peer.json: whole model; quant_bench.json: linear stack), with ratios.

    python tools/peer_report.py DIR      # DIR holds llamacpp_{f16,Q8_0,Q4_0,Q4_K_M}.json and quant_bench.json

edgespec's decode figure is its linear stack alone (one CUDA graph of every matrix of a step), so it bounds an
end-to-end decode from above; llama.cpp's is a whole token (tg128). Prefill likewise counts edgespec's linear
layers only (pp512 / pp2048 on the llama.cpp side).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAIRS = (("f16", "bf16"), ("Q8_0", "fp8_block"), ("Q4_0", "int4"), ("Q4_K_M", "int4"), ("Q4_K_M", "nvfp4"))


def llamacpp_figures(path: Path) -> dict[str, float]:
    """``{"decode": tok/s, "pp512": tok/s, "pp2048": tok/s}`` from one llama-bench JSON output."""
    out = {}
    for r in json.loads(path.read_text()):
        if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["decode"] = r["avg_ts"]
        elif r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out[f"pp{r['n_prompt']}"] = r["avg_ts"]
    return out


def ratio(ours: float | None, theirs: float | None) -> str:
    """``ours / theirs`` in an 8-wide column, ``-`` where either figure is missing."""
    return f"{ours / theirs:8.2f}" if ours and theirs else f"{'-':>8}"


def moe_row(d: Path) -> None:
    """The MoE row (``peer_llamacpp.sh moe``): llama.cpp's qwen3moe Q4_K decode against edgespec's int4 model of
    the same layout (edgespec_moe.json from tools/moe_int4_bench.py), both whole tokens."""
    theirs = llamacpp_figures(d / "llamacpp_moe_q4k.json")
    ours = json.loads((d / "edgespec_moe.json").read_text())
    print(f"MoE (35B-A3B expert dimensions, attention-only): llama.cpp Q4_K {theirs.get('decode', 0):.1f} tok/s "
          f"(pp512 {theirs.get('pp512', 0):.0f}) | edgespec int4 g128 {ours['decode_tok_s']:.1f} tok/s "
          f"({100 * ours['decode_fraction_of_limit']:.1f}% of its byte limit) | decode x "
          f"{ratio(ours['decode_tok_s'], theirs.get('decode')).strip()}")


def main() -> int:
    d = Path(sys.argv[1])
    if (d / "llamacpp_moe_q4k.json").exists() and (d / "edgespec_moe.json").exists():
        moe_row(d)
    if not (d / "quant_bench.json").exists():      # PEER_STACK=0: the whole-model table alone
        whole_model(d)
        return 0
    ours = json.loads((d / "quant_bench.json").read_text())
    stack = ours["shapes"].get("llama", {})
    prefill = ours.get("prefill", {}).get("llama", {})
    print(f"device {ours['device']}, copy bandwidth {ours['bandwidth_GBps']:.0f} GB/s")
    print(f"{'llama.cpp':>8} {'tok/s':>8} {'pp512':>8} {'pp2048':>8} | {'edgespec':>9} {'tok/s*':>8} {'pp512*':>8} "
          f"{'pp2048*':>8} | decode x  pp512 x  pp2048 x")
    for theirs, mine in PAIRS:
        f = d / f"llamacpp_{theirs}.json"
        if not f.exists() or mine not in stack or "us_1" not in stack[mine]:
            continue
        t = llamacpp_figures(f)
        dec = 1e6 / stack[mine]["us_1"]
        pre = {r: v["tok_s"] for r, v in prefill.get(mine if mine != "bf16" else "cublas", {}).items()}
        p512, p2048 = pre.get("512", pre.get(512)), pre.get("2048", pre.get(2048))
        print(f"{theirs:>8} {t.get('decode', 0):8.0f} {t.get('pp512', 0):8.0f} {t.get('pp2048', 0):8.0f} | "
              f"{mine:>9} {dec:8.0f} {p512 or 0:8.0f} {p2048 or 0:8.0f} | {ratio(dec, t.get('decode'))} "
              f"{ratio(p512, t.get('pp512'))} {ratio(p2048, t.get('pp2048'))}")
    print("* edgespec: linear layers only (an upper bound of its end-to-end figure)")
    whole_model(d)
    return 0


# "gguf": edgespec on llama.cpp's own Q4_K_M file (python -m edgespec.bench.gguf_file -> gguf_Q4_K_M.json)
WHOLE_PAIRS = (("f16", "dense"), ("Q8_0", "fp8"), ("Q4_0", "int4"), ("Q4_K_M", "int4"), ("Q4_K_M", "nvfp4"),
               ("Q4_K_M", "gguf"))


def whole_model(d: Path) -> None:
    """The end-to-end table: ``edgespec bench formats`` (whole decode step, whole-model prefill) per format."""
    f = d / "formats_peer.json"
    if not f.exists():
        return
    rows = {r["format"]: r for r in json.loads(f.read_text())["rows"]}
    if (d / "gguf_Q4_K_M.json").exists():
        rows["gguf"] = json.loads((d / "gguf_Q4_K_M.json").read_text())
    print()
    print("whole model, both sides end to end (edgespec: bench formats, decode at context 128, CUDA graph)")
    print(f"{'llama.cpp':>9} {'tok/s':>8} {'pp512':>8} {'pp2048':>8} | {'edgespec':>8} {'tok/s':>8} {'pp512':>8} "
          f"{'pp2048':>8} {'peak GB':>8} | decode x  pp512 x  pp2048 x")
    for theirs, mine in WHOLE_PAIRS:
        g = d / f"llamacpp_{theirs}.json"
        if not g.exists() or mine not in rows:
            continue
        t, r = llamacpp_figures(g), rows[mine]
        pre = {int(k): v for k, v in r.get("prefill_tok_s", {}).items()}
        cells = [(r["decode_tok_s"], t.get("decode")), (pre.get(512), t.get("pp512")), (pre.get(2048), t.get("pp2048"))]
        ratios = " ".join(ratio(a, b) for a, b in cells)
        print(f"{theirs:>9} {t.get('decode', 0):8.0f} {t.get('pp512', 0):8.0f} {t.get('pp2048', 0):8.0f} | "
              f"{mine:>8} {r['decode_tok_s']:8.0f} {pre.get(512, 0):8.0f} {pre.get(2048, 0):8.0f} "
              f"{r['peak_bytes'] / 1e9:8.2f} | {ratios}")


if __name__ == "__main__":
    sys.exit(main())
