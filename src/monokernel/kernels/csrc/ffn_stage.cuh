// Stage D's first gate/up pair of each warp, copied into shared memory while the chain
// A -> B -> C runs (docs/perf-notes.md step 35).
//
// Between the QKV projection and the O projection's output, HBM is mostly idle: attention at
// short context is a few CTAs' latency chain, and C's matrix is small. Stage D's first pair
// per warp used to be issued into registers only at C's end (registers cannot hold it any
// longer without spills), so D began with a burst nobody had overlapped. Here the copy engine
// fetches that pair into the CTA's attention window as soon as the window is free (after this
// CTA's attention unit, or right after A for a CTA without one); D then computes it from
// shared memory while its second pair streams into registers.
//
// Shared memory: staged pairs [DSTAGE warps][2 rows][H] bf16 at the start of the K/V window
// (free from the end of stage B until the next layer's window fill, which decode.cu issues
// after D's pairs), so nothing is added to the CTA's footprint. One mbarrier (in the sampling
// scratch's spare words) completes when every staged byte of the layer has landed; its phase
// flips once per layer.
#pragma once
#include "attention_window.cuh"

// Warps per CTA whose first pair is staged: 0 (off) .. MK_WARPS.
#ifndef MK_DSTAGE
#define MK_DSTAGE 0
#endif
// Where the copies are issued: 0 after stage B (right after A in a CTA without an attention
// unit), 1 once stage C's input has arrived.
#ifndef MK_DSTAGE_AT
#define MK_DSTAGE_AT 0
#endif
// The window must hold the staged rows (it does for the real shapes; tests that force a
// small window build without staging).
#define MK_DSTAGE_ON (MK_DSTAGE > 0 && MK_DSTAGE * MK_H <= MK_ATTN_CHUNK * MK_D)

__device__ __forceinline__ const bf16* ffn_staged_pair(const float* win, int warp) {
  return reinterpret_cast<const bf16*>(win) + (size_t)warp * 2 * MK_H;
}

// Once per launch.
__device__ __forceinline__ void ffn_stage_init(unsigned long long* mbar) {
  if (MK_DSTAGE_ON && threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(mbar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// Thread 0 copies pair (warp * grid + CTA) of wgu [2 * pairs, H] for warps < DSTAGE. Called
// after a __syncthreads that follows every ordinary read of the window in this layer.
__device__ __forceinline__ void ffn_stage_issue(const bf16* wgu, float* win,
                                                unsigned long long* mbar) {
  if (!MK_DSTAGE_ON || threadIdx.x != 0) return;
  fence_window();
  unsigned bytes = 0;
  for (int w = 0; w < MK_DSTAGE; ++w)
    if (w * (int)gridDim.x + (int)blockIdx.x < MK_I) bytes += 4u * MK_H;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(bytes)
               : "memory");
  for (int w = 0; w < MK_DSTAGE; ++w) {
    const int pr = w * (int)gridDim.x + (int)blockIdx.x;
    if (pr < MK_I)
      bulk_copy(const_cast<bf16*>(ffn_staged_pair(win, w)), wgu + (size_t)pr * 2 * MK_H,
                4u * MK_H, mbar);
  }
}

// Every thread of the CTA waits for the layer's staged pairs (phase `parity`).
__device__ __forceinline__ void ffn_stage_wait(unsigned long long* mbar, unsigned parity) {
  unsigned ok = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(smem_addr(mbar)), "r"(parity)
        : "memory");
  } while (!ok);
}

// Lane-partial dot of a staged row (shared memory) with xs.
__device__ __forceinline__ float ffn_staged_row(const bf16* row, const float* xs, int lane) {
  const uint4* wp = reinterpret_cast<const uint4*>(row);
  float acc = 0.f;
#pragma unroll 4
  for (int c = lane; c < MK_H / 8; c += 32) acc += dot8(wp[c], xs, c);
  return acc;
}
