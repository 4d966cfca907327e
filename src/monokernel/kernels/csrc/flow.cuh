// Data as flag: the stage hand-offs inside a layer without grid barriers.
//
// Every activation vector a stage hands to the next (qkv, attn_out, delta, act, x) is written
// once per layer, each element with the layer's generation in its low 8 bits: the value is
// rounded to 16 significant bits (relative error <= 2^-16, far below bf16 weights' 2^-9) and
// the freed byte carries the tag. A reader spins on each element until its tag is the one it
// wants, so the data itself is the signal: no fence, no counter, no second round trip to read
// the vector after the barrier says it is there. This is the trick of NCCL's LL protocol with
// the flag folded into the value, so the vectors keep their size (a 16-byte {value, tag} pair
// would double the L2 traffic of every CTA's input load).
//
// Tags. Generation g(step, layer) = 1 + step * (L + 1) + layer + 1, layer in [-1, L): -1 is
// the embedding written into x at the start of a step. A buffer is written every layer, so
// when a reader wants g the buffer holds g or the previous write (g - 1 or g - 2): different
// modulo 256. The host zeroes the buffers before each launch (tag 0; g starts at 1).
//
// Why nothing is overwritten while someone still reads it (no write-after-read race without
// barriers): each CTA reads a stage's input before it writes any of that stage's output, and
// a buffer is next written only after a chain of stages that needs output from every CTA
// (its delta rows in C, act rows in D, x rows in E). flow_possible() checks that every CTA
// owns at least one row of those three; for a grid too large for the model it is false and
// the kernel keeps a grid barrier at every hand-off (the tags are then always ready).
//
// Tensor parallelism (tp.cuh): the two all-reduces per layer are tagged peer data already;
// they replace the hand-offs C -> D and E -> A, and the same chain argument covers their
// receive slots across ranks (every CTA of every rank sends rows of both).
//
// Ordering that does need a fence stays on the grid barrier that ends each step (after the
// LM head): KV-cache rows appended in stage B are read by other CTAs' window copies only after
// it (decode.cu issues the copies for layer 0 after that barrier).
#pragma once
#include "gemv.cuh"

#ifndef MK_FLOW
#define MK_FLOW 1  // 0: grid barrier at every hand-off (for A/B timing)
#endif

#define MK_TAG_BITS 0xffu
#ifndef MK_FLOW_G
#define MK_FLOW_G 8  // loads in flight per thread in load_flow
#endif

__device__ __forceinline__ unsigned flow_tag(int step, int layer) {
  return (unsigned)(1 + step * (MK_L + 1) + layer + 1) & MK_TAG_BITS;
}

__device__ __forceinline__ void st_flow(float* p, float v, unsigned tag) {
  // Round to nearest on the magnitude (sign-magnitude: symmetric), then tag.
  const unsigned u = ((__float_as_uint(v) + 0x80u) & ~MK_TAG_BITS) | tag;
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(u) : "memory");
}

__device__ __forceinline__ unsigned ld_flow_word(const float* p) {
  unsigned u;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(u) : "l"(p));
  return u;
}

// Spin until the word carries `tag`. A producer that never writes means a bug: trap after
// ~10 s rather than hang.
__device__ __forceinline__ unsigned flow_wait_word(const float* p, unsigned u, unsigned tag) {
  if ((u & MK_TAG_BITS) == tag) return u;
  const long long t0 = clock64();
  do {
    u = ld_flow_word(p);
    if (clock64() - t0 > 20000000000LL) __trap();
  } while ((u & MK_TAG_BITS) != tag);
  return u;
}

__device__ __forceinline__ float ld_flow(const float* p, unsigned tag) {
  return __uint_as_float(flow_wait_word(p, ld_flow_word(p), tag) & ~MK_TAG_BITS);
}

// xs[i] <- src[i] for this thread's elements i = threadIdx.x + j * THREADS of K, waiting for
// `tag`; returns the thread's sum of squares. Issues G loads before checking any, so a vector
// that is already there costs one round trip, not K / THREADS of them.
template <int K>
__device__ __forceinline__ float load_flow(float* xs, const float* src, unsigned tag) {
  float ss = 0.f;
  constexpr int N = (K + MK_THREADS - 1) / MK_THREADS;
  constexpr int G = N < MK_FLOW_G ? N : MK_FLOW_G;
  // Batches not unrolled: unrolled, the spin loops of every batch held registers across the
  // stage and spilled (ptxas, Llama shape: 202 bytes).
#pragma unroll 1
  for (int j0 = 0; j0 < N; j0 += G) {
    unsigned u[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int i = threadIdx.x + (j0 + j) * MK_THREADS;
      u[j] = (j0 + j < N && i < K) ? ld_flow_word(src + i) : tag;
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int i = threadIdx.x + (j0 + j) * MK_THREADS;
      if (j0 + j < N && i < K) {
        const float v = __uint_as_float(flow_wait_word(src + i, u[j], tag) & ~MK_TAG_BITS);
        xs[i] = v;
        ss += v * v;
      }
    }
  }
  return ss;
}

// Whether every CTA owns a row of the stages whose outputs order the buffers' reuse (see the
// top of this file): C (rows H, split units per CTA), D (I gate/up pairs, a warp each) and
// E (rows H). The same for every CTA.
template <int GROUPS_C, int GROUPS_E>
__device__ __forceinline__ bool flow_possible() {
  const int last = (int)gridDim.x - 1;
  return MK_FLOW && last * GROUPS_C < MK_H && last * MK_WARPS < MK_I &&
         last * GROUPS_E < MK_H;
}

// A hand-off: a grid barrier unless the data carries its own flag. Split like grid_arrive /
// grid_wait so the next stage's first weight loads go out in between either way.
__device__ __forceinline__ void handoff_arrive(bool flow, unsigned* counter, unsigned& target) {
  if (flow) {
    __syncthreads();  // the next stage's input load overwrites shared memory this one read
  } else {
    grid_arrive(counter, target);
  }
}

__device__ __forceinline__ void handoff_wait(bool flow, const unsigned* counter,
                                             unsigned target) {
  if (!flow) grid_wait(counter, target);
}
