// Stage D's preload: gate/up row pairs copied into shared memory while stage B runs, by the
// CTAs that have no attention unit this step.
//
// At short context only heads x ranges CTAs attend (Llama-3.2-1B: 32 of 132); the rest wait
// through B and C with HBM nearly idle, then D streams 8,192-8,960 row pairs over 2,112 warps,
// 4-5 a warp. Here each idle CTA's copy engine fetches a contiguous block of pairs into the
// window region it is not using (one bulk copy per 32 KB, completing on the preload's
// mbarrier), and D then streams only the rest: just few enough pairs that every warp gets
// the same whole number m of them. The preloaded pairs cost the idle CTA shared-memory reads
// in D, not HBM time. Steps 8 and 15 of docs/perf-notes.md warmed L2 instead; that did not
// pay. This moves bytes into the SM itself, and nothing on the critical path issues it.
//
// The split is a pure function of the position (through attention's plan), the same in every
// CTA. The pairs [0, pre) go to idle CTAs in blocks of c or c + 1, in CTA order; the pairs
// [pre, I) are streamed, pair pre + gw + k * grid_warps by grid warp gw. Every warp keeps at
// least one streamed pair (m >= 1), so every CTA still writes act rows (flow.cuh's argument).
#pragma once
#include "attention_window.cuh"

#ifndef MK_PRE
#define MK_PRE 1  // 0: no preload (for A/B timing)
#endif
#ifndef MK_PRE_CPASYNC
#define MK_PRE_CPASYNC 1  // 1: every thread issues 16-byte cp.async; 0: bulk copies (slow, below)
#endif
#ifndef MK_PRE_USE
#define MK_PRE_USE 1  // 0: copy the pairs but stream all of D anyway (timing: the copies' cost)
#endif

struct FfnSplit {
  int pre;     // pairs [0, pre) are preloaded, [pre, I) streamed
  int lo, n;   // this CTA's preloaded pairs: [lo, lo + n)
};

__device__ __forceinline__ FfnSplit ffn_split(const Params& p, int pos) {
  FfnSplit f{0, 0, 0};
  const int units = attn_plan(p, pos).units, idle = (int)gridDim.x - units;
  const int tw = (int)gridDim.x * MK_WARPS;
  if (!MK_PRE || MK_PRE_PAIRS == 0 || idle <= 0) return f;
  // The fewest streamed pairs per warp that the idle CTAs' capacity allows.
  const int m = max(1, (MK_I - idle * MK_PRE_PAIRS + tw - 1) / tw);
  const int pre = MK_I - m * tw;
  if (pre <= 0) return f;
  const int c = pre / idle, rem = pre % idle, i = (int)blockIdx.x - units;
  f.pre = MK_PRE_USE ? pre : 0;
  if (i >= 0) {
    f.lo = i * c + min(i, rem);
    f.n = c + (i < rem ? 1 : 0);
  }
  return f;
}

// Thread 0 of an idle CTA starts copying its pairs of `wgu` [2I, H] into the window region.
// The region was last read by ordinary loads (a previous D, or a window) before a
// __syncthreads the caller has passed.
__device__ __forceinline__ void ffn_preload(const FfnSplit& f, const bf16* wgu, float* win) {
#if MK_PRE_CPASYNC
  if (f.n == 0) return;
  const uint4* src = reinterpret_cast<const uint4*>(wgu + (size_t)2 * f.lo * MK_H);
  const unsigned dst = smem_addr(win);
  const int chunks = f.n * (MK_H / 4);  // 16-byte chunks: a pair is 4H bytes
  for (int i = threadIdx.x; i < chunks; i += MK_THREADS)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16u * i), "l"(src + i)
                 : "memory");
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  if (f.n == 0 || threadIdx.x != 0) return;
  fence_window();
  unsigned long long* mbar = window_mbar(win, MK_ATTN_STAGES);
  const unsigned bytes = (unsigned)f.n * 4u * MK_H;  // <= 227 KB: within the tx count's range
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(bytes)
               : "memory");
  const char* src = reinterpret_cast<const char*>(wgu + (size_t)2 * f.lo * MK_H);
  char* dst = reinterpret_cast<char*>(win);
  constexpr unsigned PIECE = 32768;
  for (unsigned off = 0; off < bytes; off += PIECE)
    bulk_copy(dst + off, src + off, min(PIECE, bytes - off), mbar);
  window_issued(win)[MK_ATTN_STAGES] += 1u;
#endif
}

// Wait until this CTA's preloaded pairs have landed.
__device__ __forceinline__ void ffn_preload_wait(const FfnSplit& f, float* win) {
  if (f.n == 0) return;
#if MK_PRE_CPASYNC
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // every thread's copies have landed
#else
  window_spin(win, MK_ATTN_STAGES);
#endif
}

// Stage D's preloaded pairs, after ffn_preload_wait. Warp w takes pairs lo + w, lo + w +
// WARPS, ... all at once: each lane reads its chunk of x from shared memory once for all of
// them (per row, x is 2x the row's bytes: read per row, shared-memory bandwidth made this
// ~3 µs a layer on Qwen's shape). out(pair, gate dot, up dot) on every lane, as gemv_pairs.
template <class Out>
__device__ __forceinline__ void ffn_preloaded(const FfnSplit& f, const float* __restrict__ xs,
                                              float* win, int warp, int lane, Out out) {
  if (f.n == 0) return;
  constexpr int C = MK_H / 8;                                  // 16-byte chunks in a row
  constexpr int PW = (MK_PRE_PAIRS + MK_WARPS - 1) / MK_WARPS;  // pairs per warp at most
  const uint4* rows = reinterpret_cast<const uint4*>(win);
  const float4* xp = reinterpret_cast<const float4*>(xs);
  float acc[PW][2];
#pragma unroll
  for (int k = 0; k < PW; ++k) acc[k][0] = acc[k][1] = 0.f;
#pragma unroll 1
  for (int c = lane; MK_PRE_USE && c < C; c += 32) {
    const float4 a = xp[2 * c], b = xp[2 * c + 1];
#pragma unroll
    for (int k = 0; k < PW; ++k) {
      const int j = warp + k * MK_WARPS;
      if (j < f.n) {
        acc[k][0] += dot8x(rows[(2 * j) * C + c], a, b);
        acc[k][1] += dot8x(rows[(2 * j + 1) * C + c], a, b);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < PW; ++k) {
    const int j = warp + k * MK_WARPS;
    if (MK_PRE_USE && j < f.n) out(f.lo + j, warp_sum(acc[k][0]), warp_sum(acc[k][1]));
  }
  __syncthreads();  // every thread has seen this phase before the count moves on
  if (!MK_PRE_CPASYNC) window_done(win, MK_ATTN_STAGES);
}
