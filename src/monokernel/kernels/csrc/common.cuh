// Shared helpers of the persistent decode kernel: loads, reductions, the grid barrier. Free
// of the model's dimensions (dims.cuh), so the all-reduce benchmark includes it too.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "tunables.cuh"

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

typedef __nv_bfloat16 bf16;

#ifdef MK_DEBUG
#define MK_ASSERT(c) assert(c)
#include <assert.h>
#else
#define MK_ASSERT(c)
#endif

// Weights are read once per token and never reused by the same SM: keep them out of L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// A GEMV's input vector in shared memory is stored swizzled: in every other 128-byte block
// the two 16-byte halves of each 32-byte chunk trade places. A lane reads its chunk of 8
// floats as two 16-byte loads, the lanes 32 bytes apart (gemv.cuh dot_load); unswizzled, lanes l and l + 4
// hit the same banks and every load takes two passes (ncu on an H100: 41% of the kernel's
// shared-memory wavefronts were these). swz maps a float's (or a 16-byte chunk's) natural
// address to where it is kept; applied twice it is the identity. The swap stays inside one
// 32-byte chunk, so a buffer that starts on a 32-byte boundary keeps all of its data.
// swz_off: the move in floats (-4, 0 or 4). Addresses 128 bytes apart move alike, so a loop
// whose stride is a multiple of 32 floats computes it once.
__device__ __forceinline__ int swz_off(const float* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return (a >> 7 & 1u) ? ((a & 16u) ? -4 : 4) : 0;
}
template <class T>  // float or const float
__device__ __forceinline__ T* swz(T* p) {
  return p + swz_off(p);
}

// Activations are written by other CTAs during the launch: read them from L2, never L1.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }

// Nanoseconds on a clock every SM shares (clock64 is per SM): for times compared across CTAs.
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The CTA index, thread index and grid size, read where they are used (volatile asm): a
// value derived from them once and hoisted out of the step or layer loop holds a register
// across that loop, and where registers run short it spills and is reloaded from local
// memory on the way out of every stage.
#define MK_READ_SREG(fn, reg)                      \
  __device__ __forceinline__ unsigned fn() {       \
    unsigned v;                                    \
    asm volatile("mov.u32 %0, %%" reg ";" : "=r"(v)); \
    return v;                                      \
  }
MK_READ_SREG(read_ctaid, "ctaid.x")
MK_READ_SREG(read_tid, "tid.x")
MK_READ_SREG(read_nctaid, "nctaid.x")
#undef MK_READ_SREG

__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// Dot of 8 bf16 values (one 16-byte load) with the 8 floats (a, b), in order, fp32: the bf16
// weight format's dot (formats/bf16.cuh) and the attention's dot with a cached key.
__device__ __forceinline__ float dot_bf16x8(const uint4 u, const float4 a, const float4 b) {
  float acc = bf_lo(u.x) * a.x;
  acc = fmaf(bf_hi(u.x), a.y, acc);
  acc = fmaf(bf_lo(u.y), a.z, acc);
  acc = fmaf(bf_hi(u.y), a.w, acc);
  acc = fmaf(bf_lo(u.z), b.x, acc);
  acc = fmaf(bf_hi(u.z), b.y, acc);
  acc = fmaf(bf_lo(u.w), b.z, acc);
  acc = fmaf(bf_hi(u.w), b.w, acc);
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum in a fixed order (deterministic). red: >= kWarps + 1 floats of smem.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < kWarps ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[kWarps] = t;
  }
  __syncthreads();
  return red[kWarps];
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < kWarps ? red[lane] : -INFINITY;
    t = warp_max(t);
    if (lane == 0) red[kWarps] = t;
  }
  __syncthreads();
  return red[kWarps];
}

// (score, id) pairs: larger score wins, ties to the lower id (the sampling rule's tie-break).
__device__ __forceinline__ bool better(float s, int i, float bs, int bi) {
  return s > bs || (s == bs && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& s, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float os = __shfl_xor_sync(0xffffffffu, s, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(os, oi, s, i)) { s = os; i = oi; }
  }
}

// Grid barrier on one monotonic counter (zeroed by the host before each launch, never
// during it): the k-th barrier of the launch waits until the counter reaches k * gridDim.x.
// `target` is the CTA's private count of barriers passed, so no reset race exists.
//
// Split in two so that the next stage's weight loads can be issued between arrival and
// wait: the fence of the arrival then does not have to wait for those loads to land.
__device__ __forceinline__ void grid_arrive(unsigned* counter, unsigned& target) {
  __syncthreads();  // every thread's writes of this stage precede thread 0's release
  target += gridDim.x;
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(1u) : "memory");
  }
}

__device__ __forceinline__ void grid_wait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    unsigned seen;
    long long t0 = clock64();
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if ((int)(seen - target) >= 0) break;
      // A CTA that never arrives means a bug: fail loudly after ~10 s instead of hanging.
      if (clock64() - t0 > 20000000000LL) __trap();
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned& target) {
  grid_arrive(counter, target);
  grid_wait(counter, target);
}
