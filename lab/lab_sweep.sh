#!/usr/bin/env bash
# The attention research probes on one GPU (see lab/README.md for what each answers).
# Usage on the GPU machine, from the repository root:  OUT=/some/dir bash lab/lab_sweep.sh [stage ...]
# Stages: attn-probe, attn-ncu, attn-ncu-source, attn-trace (default: attn-probe). Every output lands in $OUT.
set -uo pipefail
OUT=${OUT:-.}
# Nsight Compute on one launch of the attention split kernel (either program) of lab/attn_one_call.py.
NCU_ONE_ATTN_CALL=(--clock-control none --kernel-name regex:"_attn_split_kernel|_fp8_decode_kernel" --launch-skip 3
                   --launch-count 1)
stages=${*:-attn-probe}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in $stages; do
  t0=$(date +%s)
  case $s in
    attn-probe) python3 lab/attn_overhead_probe.py 2>&1 | tee "$OUT/attn_overhead_probe.txt" ;;
    attn-ncu) for kv in fp8 bf16; do ncu "${NCU_ONE_ATTN_CALL[@]}" --section WarpStateStats --section SchedulerStats --section Occupancy \
             --section MemoryWorkloadAnalysis --section SpeedOfLight \
             --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 lab/attn_one_call.py --kv $kv 2>&1 \
             | tee "$OUT/attn_ncu_$kv.txt"; done ;;
    attn-trace) python3 lab/attn_trace.py 2>&1 | tee "$OUT/attn_trace.txt" ;;
    attn-ncu-source) for kv in fp8 bf16; do ncu "${NCU_ONE_ATTN_CALL[@]}" --section SourceCounters -f -o "$OUT/attn_src_$kv" \
             python3 lab/attn_one_call.py --kv $kv 2>&1 | tail -2;
             ncu -i "$OUT/attn_src_$kv.ncu-rep" --page source --csv --print-source sass > "$OUT/attn_src_$kv.csv";
             python3 lab/ncu_source_summary.py "$OUT/attn_src_$kv.csv" | tee "$OUT/attn_ncu_source_$kv.txt"; done ;;
  esac
  echo "[stage $s: $(( $(date +%s) - t0 )) s]"
done
