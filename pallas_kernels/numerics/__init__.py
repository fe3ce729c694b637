"""The ground floor: quantizer math (INT8 ψ, NVFP4 φ, smoothing), tile ranges, online-softmax math and the
tile functions kernels and references share. Plain ``jax.numpy`` written with operations both Pallas lowerings
accept, so one function runs on a kernel's tile and on a reference's whole array. Imports nothing else of the
project."""
