// int32 -> float32 on Hopper: the conversion (I2F) against the magic-number form (IADD, FADD) that would
// replace it in the INT8 kernels (benchmarks/NOTES.md, thirty-ninth session). Each thread runs 8 independent chains; every mode does the same
// xor (to defeat strength reduction) and the same float add; only the conversion differs.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o i2f i2f_throughput.cu && ./i2f
#include <cstdio>
#include <cuda_runtime.h>

template <int MODE>
__global__ void chains(const int* in, float* out, int iters) {
  int v[8];
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) { v[j] = in[(threadIdx.x * 8 + j) & 1023]; acc[j] = 0.f; }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      int x = v[j] ^ it;
      float f;
      if (MODE == 0) f = (float)x;                                          // I2F
      else if (MODE == 1) f = __int_as_float(x + 0x4B400000) - 12582912.f;  // magic: IADD, FADD
      else f = __int_as_float(x & 0x3FFFFF);                                // no conversion (baseline)
      acc[j] += f;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += acc[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const int threads = 256, blocks = prop.multiProcessorCount * 8, iters = 1 << 14;
  int* in; float* out;
  cudaMalloc(&in, 1024 * sizeof(int));
  cudaMalloc(&out, blocks * threads * sizeof(float));
  int host[1024];
  for (int i = 0; i < 1024; ++i) host[i] = (i * 2654435761u) % 2000000 - 1000000;
  cudaMemcpy(in, host, sizeof(host), cudaMemcpyHostToDevice);
  const char* names[3] = {"I2F + FADD", "IADD + FADD + FADD (magic)", "LOP + FADD only"};
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  for (int rep = 0; rep < 2; ++rep) {
    for (int mode = 0; mode < 3; ++mode) {
      for (int warm = 0; warm < 2; ++warm) {
        cudaEventRecord(a);
        if (mode == 0) chains<0><<<blocks, threads>>>(in, out, iters);
        if (mode == 1) chains<1><<<blocks, threads>>>(in, out, iters);
        if (mode == 2) chains<2><<<blocks, threads>>>(in, out, iters);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
      }
      float ms = 0.f;
      cudaEventElapsedTime(&ms, a, b);
      double elems = (double)blocks * threads * iters * 8;
      double per_sm_clk = elems / (ms * 1e-3) / prop.multiProcessorCount / (clock_khz * 1e3);
      printf("%-28s %8.3f ms  %6.1f elements/clk/SM (at the %d MHz max clock)\n", names[mode], ms, per_sm_clk,
             clock_khz / 1000);
    }
  }
  printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  return 0;
}
