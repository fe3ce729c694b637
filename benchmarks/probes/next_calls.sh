#!/usr/bin/env bash
# The next session's device calls, each one command inside the device's 600 s per command (the last two sessions
# got one call or none, so the most urgent work is in call 1). On the GPU machine, from the repo root:
#   bash benchmarks/probes/next_calls.sh 1   # ~9 min: the FQ(P) scale check; the three Attn-QAT forward probes
#                                            # against the committed kernels; #4's marginal D64 row (7 rounds)
#   bash benchmarks/probes/next_calls.sh 2   # ~8 min: #4's table (qat.py --no-sweep, after landing call 1's
#                                            # winners); the SageBwd MASK_RAW_SCORES probe at the causal shapes
#   bash benchmarks/probes/next_calls.sh 3   # ~9.5 min: #3's table (attention_bwd.py --skip-checks)
# Each step runs under its own timeout and writes its log and JSON to $OUT (at most 8 files come back). Back here:
# copy $OUT/qat.json or attention_bwd.json into benchmarks/results/ and run benchmarks/render_results.py.
# What to do with the numbers: benchmarks/NOTES.md, fifty-eighth session.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT to the folder that comes back}
start=$SECONDS
left() { echo $((570 - (SECONDS - start))); }  # seconds left of the command's 600, less a margin
step() { echo "$1 rc=$2 at $((SECONDS - start)) s"; }
qat=pallas_kernels.qat_fwd_mosaic

case "${1:-}" in
1)
  timeout 80 python benchmarks/nvfp4_scale_check.py --backends mosaic --chunks 1 > "$OUT/scale_check.log" 2>&1
  step "scale check" $?
  timeout $(($(left) - 110)) python benchmarks/variants.py --method qat --variant committed= \
    --variant lop3=$qat.PACKED_LOP3=True --variant gmax=$qat.GROUP_MAX_FROM_S=True \
    --variant lanes=pallas_kernels.lane_groups.E4M3_LANEWISE=True \
    --shape 8,32,32,2048,64,0 --shape 16,10,5,2048,64,1 --shape 4,32,32,4096,128,0 \
    --repeats 2 --check --profile --child-timeout 150 > "$OUT/variants.log" 2>&1
  step "qat variants" $?
  timeout $(left) python benchmarks/qat.py --no-sweep --skip-checks --shapes 8,32,2048,64,0 \
    --methods qat_mosaic_pingpong cudnn_bf16 --rounds 7 --name qat_rows > "$OUT/qat_rows.log" 2>&1
  step "qat rows" $?
  ;;
2)
  timeout 300 python benchmarks/qat.py --no-sweep > "$OUT/qat.log" 2>&1
  step "qat table" $?
  timeout $(left) python benchmarks/variants.py --method sage --variant committed= \
    --variant raw=pallas_kernels.sage_bwd_mosaic.MASK_RAW_SCORES=True \
    --shape 16,10,5,2048,64,1 --shape 4,32,32,4096,128,1 --shape 1,32,32,16384,128,1 \
    --repeats 2 --check --profile --child-timeout 150 > "$OUT/variants.log" 2>&1
  step "sage variants" $?
  ;;
3)
  timeout $(left) python benchmarks/attention_bwd.py --skip-checks > "$OUT/attention_bwd.log" 2>&1
  step "attention_bwd" $?
  ;;
*)
  echo "usage: OUT=DIR bash benchmarks/probes/next_calls.sh 1|2|3" >&2
  exit 2
  ;;
esac
tail -n 5 "$OUT"/*.log
