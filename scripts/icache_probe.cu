// How fast an SM runs straight-line code as the code grows: where the instruction caches end.
//
//   nvcc -O3 -arch=sm_90a scripts/icache_probe.cu -o /tmp/icache_probe && /tmp/icache_probe
//
// Why: the decode kernel's per-layer loop is ~150 KB of SASS (the build without group units;
// ~220 KB with them), every CTA runs all of it once a layer, and much of it sits on the
// latency-bound chain A -> B -> C. If that is more than an SM's instruction cache holds,
// every layer fetches its code again from L2, behind the weight stream's misses.
//
// One CTA per SM. Warps 0-3 (one per SM sub-partition) each run a body of N independent FFMA
// instructions (8 chains, 16 bytes of SASS each) REPS times and times it with clock64; with
// `loaded`, warps 4-15 of every CTA stream a large buffer meanwhile, as the GEMVs do (6 loads
// of 16 bytes in flight per lane). Printed: SASS bytes of the body, cycles per instruction
// per warp (1.0 is the issue rate of one warp when nothing stalls it). nvcc unrolls the
// repeat loop of the smallest body 4x (its kernel is 32 KB of code, nvcc 13.0); the others
// it leaves rolled.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "../src/monokernel/kernels/csrc/common.cuh"  // ld_stream, as the decode kernel loads
#include "cuda_check.h"

constexpr int REPS = 64;

struct Args {
  const uint4* stream;       // [chunks] streamed by warps 4.. when loaded
  long long chunks;          // 16-byte chunks in it
  unsigned long long* out;   // [grid * 4] cycles per warp, then [grid + 1] sinks (never written)
  int loaded;
};

__device__ volatile int g_stop;

template <int N>
__global__ void __launch_bounds__(512, 1) body(Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= 4) {
    if (!a.loaded) return;
    // Stream until the timed warps are done (each CTA its own slice, wrapping).
    const long long per = a.chunks / gridDim.x;
    const uint4* base = a.stream + blockIdx.x * per;
    unsigned acc = 0;
    long long c = (warp - 4) * 32 + lane;
    while (!g_stop) {
      uint4 b[6];
#pragma unroll
      for (int i = 0; i < 6; ++i) b[i] = ld_stream(base + (c + i * 384) % per);
#pragma unroll
      for (int i = 0; i < 6; ++i) acc ^= b[i].x ^ b[i].w;
      c += 6 * 384;
    }
    if (acc == 0x12345678u) a.out[gridDim.x * 4 + blockIdx.x] = acc;
    return;
  }
  float f0 = lane, f1 = lane + 1, f2 = lane + 2, f3 = lane + 3, f4 = lane + 4, f5 = lane + 5,
        f6 = lane + 6, f7 = lane + 7;
  const float m = 0.999f, k = 0.001f;
  long long t0 = 0;
  for (int r = 0; r <= REPS; ++r) {
    if (r == 1) t0 = clock64();  // round 0 warms the caches
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      asm volatile(
          "fma.rn.f32 %0, %0, %8, %9;\n\tfma.rn.f32 %1, %1, %8, %9;\n\t"
          "fma.rn.f32 %2, %2, %8, %9;\n\tfma.rn.f32 %3, %3, %8, %9;\n\t"
          "fma.rn.f32 %4, %4, %8, %9;\n\tfma.rn.f32 %5, %5, %8, %9;\n\t"
          "fma.rn.f32 %6, %6, %8, %9;\n\tfma.rn.f32 %7, %7, %8, %9;"
          : "+f"(f0), "+f"(f1), "+f"(f2), "+f"(f3), "+f"(f4), "+f"(f5), "+f"(f6), "+f"(f7)
          : "f"(m), "f"(k));
    }
  }
  const long long dt = clock64() - t0;
  if (lane == 0) a.out[blockIdx.x * 4 + warp] = (unsigned long long)dt;
  if (f0 + f1 + f2 + f3 + f4 + f5 + f6 + f7 == 12345.f) a.out[gridDim.x * 4] = 1;
}

template <int N>
void run(const Args& base, int grid, int loaded, unsigned long long* host) {
  Args a = base;
  a.loaded = loaded;
  int zero = 0;
  CK(cudaMemcpyToSymbol(g_stop, &zero, sizeof zero));
  cudaStream_t s, s2;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaFuncSetAttribute(body<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  body<N><<<grid, 512, 120 * 1024, s>>>(a);
  // The timed warps know when they are done; the streamers are stopped from the host once the
  // kernel's timed part must be over (polling the output from a second stream).
  for (;;) {
    CK(cudaMemcpyAsync(host, a.out, sizeof(unsigned long long) * grid * 4,
                       cudaMemcpyDeviceToHost, s2));
    CK(cudaStreamSynchronize(s2));
    bool all = true;
    for (int i = 0; i < grid * 4; ++i) all &= host[i] != 0;
    if (all) break;
  }
  int one = 1;
  CK(cudaMemcpyToSymbolAsync(g_stop, &one, sizeof one, 0, cudaMemcpyHostToDevice, s2));
  CK(cudaStreamSynchronize(s2));
  CK(cudaStreamSynchronize(s));
  double sum = 0, mx = 0;
  for (int i = 0; i < grid * 4; ++i) {
    const double cpi = (double)host[i] / ((double)REPS * N);
    sum += cpi;
    mx = cpi > mx ? cpi : mx;
  }
  std::printf("%8d %10d %8s %10.2f %10.2f\n", N * 16, N, loaded ? "yes" : "no", sum / (grid * 4),
              mx);
  CK(cudaMemset(a.out, 0, sizeof(unsigned long long) * (grid * 5 + 1)));
  CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(s2));
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Args a{};
  a.chunks = (2LL << 30) / 16;  // 2 GiB, far beyond L2
  uint4* buf;
  CK(cudaMalloc(&buf, a.chunks * 16));
  CK(cudaMemset(buf, 1, a.chunks * 16));
  a.stream = buf;
  CK(cudaMalloc(&a.out, sizeof(unsigned long long) * (sms * 5 + 1)));
  CK(cudaMemset(a.out, 0, sizeof(unsigned long long) * (sms * 5 + 1)));
  unsigned long long* host;
  CK(cudaMallocHost(&host, sizeof(unsigned long long) * sms * 5));
  std::printf("%d SMs, body of N FFMA run %d times per warp (4 timed warps per SM)\n", sms, REPS);
  std::printf("%8s %10s %8s %10s %10s\n", "bytes", "N", "loaded", "cyc/instr", "max");
  for (int loaded = 0; loaded < 2; ++loaded) {
    run<512>(a, sms, loaded, host);
    run<1024>(a, sms, loaded, host);
    run<2048>(a, sms, loaded, host);
    run<4096>(a, sms, loaded, host);
    run<6144>(a, sms, loaded, host);
    run<8192>(a, sms, loaded, host);
    run<10240>(a, sms, loaded, host);
    run<12288>(a, sms, loaded, host);
    run<16384>(a, sms, loaded, host);
  }
  return 0;
}
