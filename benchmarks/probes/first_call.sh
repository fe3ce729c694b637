#!/usr/bin/env bash
# The next session's first device call, in one command (the device may lend only one call: fifty-seventh session).
# On the GPU machine, from the repo root:   bash benchmarks/probes/first_call.sh      (about 9 minutes)
# Three steps, each under its own timeout, all inside the device's 600 s per command; each step's log and JSON go
# to $OUT (at most 8 files come back: scale_check.log, variants.{log,json}, qat_rows.{log,json}):
#   1. the compiled FQ(P) scale check (0 mismatches expected in every kernel key, benchmarks/NOTES.md 57th session);
#   2. the Attn-QAT forward probes against the committed kernels (kernel times, --check, two repeats);
#   3. #4's marginal row (B8 H32 S2048 D64) with the committed code, seven interleaved rounds.
# What to do with the numbers: benchmarks/NOTES.md, fifty-eighth session.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT to the folder that comes back}
start=$SECONDS
left() { echo $((570 - (SECONDS - start))); }  # seconds left of the command's 600, less a margin

timeout 80 python benchmarks/nvfp4_scale_check.py --backends mosaic --chunks 1 > "$OUT/scale_check.log" 2>&1
echo "scale check rc=$? at $((SECONDS - start)) s"

qat=pallas_kernels.qat_fwd_mosaic
timeout $(($(left) - 110)) python benchmarks/variants.py --method qat --variant committed= \
  --variant lop3=$qat.PACKED_LOP3=True --variant gmax=$qat.GROUP_MAX_FROM_S=True \
  --variant lanes=pallas_kernels.lane_groups.E4M3_LANEWISE=True \
  --shape 8,32,32,2048,64,0 --shape 16,10,5,2048,64,1 --shape 4,32,32,4096,128,0 \
  --repeats 2 --check --profile --child-timeout 150 > "$OUT/variants.log" 2>&1
echo "variants rc=$? at $((SECONDS - start)) s"

timeout $(left) python benchmarks/qat.py --no-sweep --skip-checks --shapes 8,32,2048,64,0 \
  --methods qat_mosaic_pingpong cudnn_bf16 --rounds 7 --name qat_rows > "$OUT/qat_rows.log" 2>&1
echo "qat rows rc=$? at $((SECONDS - start)) s"
tail -n 5 "$OUT"/*.log
