#!/usr/bin/env bash
# Nsight Compute profile of one kernel of one method's fwd+bwd (benchmarks/probes/ncu_run.py), on the GPU machine:
#   benchmarks/probes/ncu_profile.sh TAG KERNEL_REGEX METHOD SHAPE [ASSIGN]
# Writes ncu/TAG.{details.txt,raw.csv,sass.csv} (full section set; by default the second matching launch,
# else SKIP and COUNT matching launches; clocks left alone as the device notes ask) and re-packs $OUT/ncu.tgz.
set -u
tag=$1 regex=$2 method=$3 shape=$4 assign=${5:-}
dir=/tmp/ncu_out/ncu  # packed into $OUT/ncu.tgz (the device returns at most 8 files)
mkdir -p "$dir"
rep=/tmp/ncu_$tag
XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. timeout 300 ncu --clock-control none --kernel-name "regex:$regex" \
  --launch-skip "${SKIP:-1}" --launch-count "${COUNT:-1}" --set full -f -o "$rep" \
  python3 benchmarks/probes/ncu_run.py --method "$method" --shape "$shape" --calls 3 --assign "$assign" \
  > "$dir/$tag.log" 2>&1
echo "$tag: ncu rc=$?"
ncu -i "$rep.ncu-rep" --page details --print-details all > "$dir/$tag.details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page raw --csv > "$dir/$tag.raw.csv" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$dir/$tag.sass.csv" 2>&1
ls -la "$dir" | grep "$tag"
tar czf "${OUT:-/tmp}/ncu.tgz" -C "$dir/.." ncu
