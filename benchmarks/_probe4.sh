export PYTHONPATH=.
python benchmarks/variants.py --part fwd --variant triton= --variant mosaic="config.fwd_backend='mosaic'" \
  --variant mosaic_pp="config.fwd_backend='mosaic',pallas_kernels.sage_fwd_mosaic.PINGPONG=True" \
  --shape 16,10,5,2048,64,1 --shape 8,32,32,2048,64,0 --shape 4,32,32,4096,128,0 \
  --repeats 2 --check 2>&1 | grep -v "^I0000\|^W0000" | tail -8 | tee $OUT/pp.txt
cp benchmarks/results/variants.json $OUT/variants_pp.json
