// Tensor parallelism inside the decode kernel (MK_TP > 1 only; docs/tensor-parallel.md).
//
// The protocol of allreduce_bench.cu, fused into the GEMV epilogues: the thread that finishes
// row r of a partial [H] output (O-proj, down) stores {value, tag} with one 8-byte volatile
// store straight into slot [my rank][r] of EVERY rank's receive buffer (its own included,
// where the other CTAs of this rank read it). A reader spins per element until the tag of
// this generation is there for all ranks, then sums the slots in rank order 0..N-1: the same
// bits on every CTA of every GPU, which the ranks need to stay in lock step (a one-ulp
// difference could pick different tokens). Tags only grow (the host carries them across
// launches and never uses 0, the zeroed buffers' value), so nothing is ever reset.
//
// Two parities (tag & 1): a rank writes generation g+2 into a slot only after it has read
// generation g+1 from every rank; each rank sends g+1 only after every one of its CTAs
// finished reading g (each CTA reads g before it writes its rows of the next stage, and g+1
// needs those rows: flow.cuh), so no slot is overwritten before it is read.
//
// The token exchange works the same way with one 16-byte unit {score, tag, id*2 + cancel,
// tag} per rank and step: every rank picks the same winner (larger score, ties to the lower
// global id), and rank 0's cancel bit stops every rank at the same step.
#pragma once
#include "flow.cuh"
#include "params.cuh"

#if MK_TP > 1

#define MK_TP_RED_WORDS (2 * 2 * MK_TP * MK_H)  // u32 words of the reduction area

__device__ __forceinline__ void tp_st2(unsigned* a, unsigned x, unsigned y) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(a), "r"(x), "r"(y) : "memory");
}

__device__ __forceinline__ uint2 tp_ld2(const unsigned* a) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(a) : "memory");
  return v;
}

__device__ __forceinline__ void tp_st4(unsigned* a, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(a), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 tp_ld4(const unsigned* a) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(a)
               : "memory");
  return v;
}

// A peer that never delivers means a fault on another GPU: fail loudly after ~10 s (as
// grid_wait does) instead of hanging every rank.
__device__ __forceinline__ void tp_check_timeout(long long t0) {
  if (clock64() - t0 > 20000000000LL) __trap();
}

// This rank's partial of element r of generation `tag`, into every rank's slot [rank][r].
__device__ __forceinline__ void tp_send(const Params& p, unsigned tag, int r, float d) {
  const size_t off = 2 * (((size_t)(tag & 1u) * MK_TP + p.tp_rank) * MK_H + r);
#pragma unroll
  for (int k = 0; k < MK_TP; ++k) tp_st2(p.tp_recv[k] + off, __float_as_uint(d), tag);
}

// The all-reduced element i of generation `tag`: waits for every rank, sums in rank order.
__device__ __forceinline__ float tp_sum(const Params& p, unsigned tag, int i) {
  const unsigned* base = p.tp_mine + 2 * ((size_t)(tag & 1u) * MK_TP * MK_H + i);
  float v[MK_TP];  // indexed by unrolled constants only: registers
  unsigned pending = (1u << MK_TP) - 1u;
  const long long t0 = clock64();
  while (true) {
#pragma unroll
    for (int k = 0; k < MK_TP; ++k) {
      if (pending & (1u << k)) {
        const uint2 w = tp_ld2(base + 2 * (size_t)k * MK_H);
        if (w.y == tag) {
          v[k] = __uint_as_float(w.x);
          pending &= ~(1u << k);
        }
      }
    }
    if (!pending) break;
    tp_check_timeout(t0);
  }
  float acc = v[0];
#pragma unroll
  for (int k = 1; k < MK_TP; ++k) acc += v[k];
  return acc;
}

// xs <- xres + all-reduce(generation tag), the residual after a down projection, then
// RMS-normalised (times `gain` when not folded). CTA 0 also keeps the unnormalised residual
// in p.x, tagged `x_tag` (flow.cuh), where stage D reads it (as with the embedding at layer 0).
__device__ __forceinline__ void tp_load_residual(const Params& p, float* xs, const float* xres,
                                                 unsigned tag, unsigned x_tag, float eps,
                                                 float* red, const float* gain) {
  float ss = 0.f;
  const int so = swz_off(xs + threadIdx.x);  // xs is a GEMV input (common.cuh); same for every i
  for (int i = threadIdx.x; i < MK_H; i += MK_THREADS) {
    const float v = xres[i] + tp_sum(p, tag, i);
    xs[i + so] = v;
    ss += v * v;
    if (blockIdx.x == 0) st_flow_copies(p.x + i, MK_H, v, x_tag);
  }
  const float r = rms_scale<MK_H>(ss, red, eps);
  if (gain) {
    for (int i = threadIdx.x; i < MK_H; i += MK_THREADS) xs[i + so] *= r * gain[i];
  } else {
    for (int i = threadIdx.x; i < MK_H; i += MK_THREADS) xs[i + so] *= r;
  }
  __syncthreads();
}

// Called by one thread of every CTA with this rank's best (b, bi) of the step: CTA 0 sends
// it (with rank 0's cancel word) to every rank; every CTA then waits for all ranks' units
// and leaves the global winner in (b, bi). Returns rank 0's cancel bit.
__device__ __forceinline__ int tp_pick_token(const Params& p, int step, float& b, int& bi) {
  const unsigned tag = p.tp_tag + (unsigned)step;
  const size_t par = (size_t)(tag & 1u) * MK_TP;
  if (blockIdx.x == 0) {
    const unsigned cancel = p.tp_rank == 0 && __ldcg(p.flags) != 0 ? 1u : 0u;
    const uint4 w = make_uint4(__float_as_uint(b), tag, (unsigned)bi * 2u + cancel, tag);
#pragma unroll
    for (int k = 0; k < MK_TP; ++k) tp_st4(p.tp_recv[k] + MK_TP_RED_WORDS + 4 * (par + p.tp_rank), w);
  }
  const unsigned* mine = p.tp_mine + MK_TP_RED_WORDS + 4 * par;
  int cancel = 0;
  const long long t0 = clock64();
#pragma unroll
  for (int k = 0; k < MK_TP; ++k) {  // rank order: the same winner on every rank
    uint4 w;
    while (true) {
      w = tp_ld4(mine + 4 * k);
      if (w.y == tag && w.w == tag) break;
      tp_check_timeout(t0);
    }
    const float s = __uint_as_float(w.x);
    const int id = (int)(w.z >> 1);
    if (k == 0) {
      cancel = (int)(w.z & 1u);
      b = s;
      bi = id;
    } else if (better(s, id, b, bi)) {
      b = s;
      bi = id;
    }
  }
  return cancel;
}

#endif  // MK_TP > 1
