// How fast each SM streams weights while every SM streams at once: the host deals the LM
// head's rows in proportion (kernels/sm_shares.py, decode.cu's lm_head_deal).
// On an H100 the SMs of the smaller GPCs stream ~13% faster than the rest, the same SMs
// every time (docs/perf-notes.md step 38), so equal shares leave the stage waiting for the
// slow ones.
//
// One CTA per SM (the host asks for enough shared memory that no two fit). Each iteration:
// a grid barrier, then every CTA reads its own `per_cta` 16-byte chunks (a region beyond L2
// from the last iteration's), timed with the global timer.
#include <cstdint>

struct SpeedParams {
  const uint4* src;            // [regions, grid, per_cta] chunks
  unsigned long long* ns;      // [iters, grid] each CTA's streaming time
  unsigned* smid;              // [grid]
  unsigned* barrier;           // [1] zeroed by the host
  long long per_cta;           // 16-byte chunks a CTA reads per iteration
  int iters;
  int regions;
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void __launch_bounds__(512, 1) sm_speed(const SpeedParams p) {
  constexpr int BATCH = 6;  // loads in flight per thread, as the decode kernel's GEMV
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  if (threadIdx.x == 0) p.smid[blockIdx.x] = id;
  unsigned acc = 0;
  for (int it = 0; it < p.iters; ++it) {
    __syncthreads();
    if (threadIdx.x == 0) {  // every CTA starts the iteration together
      atomicAdd(p.barrier, 1u);
      const unsigned want = (unsigned)(it + 1) * gridDim.x;
      unsigned v;
      do {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p.barrier));
      } while (v < want);
    }
    __syncthreads();
    const unsigned long long t0 = now_ns();
    const uint4* base = p.src + ((size_t)(it % p.regions) * gridDim.x + blockIdx.x) * p.per_cta;
    for (long long c = threadIdx.x; c < p.per_cta; c += (long long)blockDim.x * BATCH) {
      uint4 b[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const long long cc = c + (long long)i * blockDim.x;
        b[i] = cc < p.per_cta ? ld_stream(base + cc) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) acc ^= b[i].x ^ b[i].y ^ b[i].z ^ b[i].w;
    }
    __syncthreads();
    if (threadIdx.x == 0) p.ns[(size_t)it * gridDim.x + blockIdx.x] = now_ns() - t0;
  }
  if (acc == 0x9e3779b9u) p.smid[0] = acc;  // keeps the loads (never true for zeroed data)
}
