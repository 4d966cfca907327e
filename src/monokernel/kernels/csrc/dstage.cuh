// Stage D's last gate/up pair of each warp, copied into shared memory at a paced rate while the
// chain A -> B -> C leaves HBM idle (docs/perf-notes.md step 40).
//
// Step 35 copied D's first pair of every warp in one burst (96-128 KB a SM, 12.7-17 MB in
// all) and the chain stretched by about what D saved: step 39 measured why, an L2 round trip
// queues behind the bytes in flight (0.16 us with nothing in flight, 0.22 at 24 KB a SM,
// 0.7 at 60 KB), and the chain is made of such round trips. Here the copies go out one pair
// at a time, one every MK_DSTAGE_CYC SM cycles, so a few KB a SM are in flight while the
// chain's hand-offs poll. Thread 0 issues them from the places where the CTA waits anyway:
// once its window is free (after A, or after its attention unit) and at every poll round of
// the hand-offs into C and D; at D's input the rest go out at once (D streams then anyway).
// D computes the staged pair last, from shared memory, so its HBM stream starts as before
// and ends a pair earlier.
//
// Shared memory: pairs [DSTAGE warps][2 rows][H] bf16 at the start of the K/V window, free
// from the end of this CTA's stage B (or A, without a unit) until the next layer's window
// fill, which decode.cu then issues after E's input (not after D's pairs); the state below
// at the window's tail. The mbarrier completes one phase a layer: the flush arrives once,
// after the last copy's expect_tx.
#pragma once
#include "attention_window.cuh"

// Warps per CTA whose last pair is staged: 0 (off) .. MK_WARPS.
#ifndef MK_DSTAGE
#define MK_DSTAGE 0
#endif
// SM cycles between two pairs' copies (0: all at the first chance; < 0: none, a probe of the
// moved window fill alone).
#ifndef MK_DSTAGE_CYC
#define MK_DSTAGE_CYC 600
#endif
// At D's input: 1 issues the copies not yet due (they then race D's own stream); 0 leaves
// those warps' last pairs to HBM.
#ifndef MK_DSTAGE_FLUSH
#define MK_DSTAGE_FLUSH 0
#endif
// The window must hold the pairs (tests that force a small window build without), and the
// TP build keeps its own schedule. (decode.cu also rules out E's teams: the next layer's fill
// moves after E's whole-CTA input load.)
#define MK_DSTAGE_ON \
  (MK_DSTAGE > 0 && MK_DSTAGE <= MK_WARPS && MK_DSTAGE * MK_H <= MK_ATTN_CHUNK * MK_D && MK_TP == 1)

// Its words at the window's tail (MK_DSTAGE_FLOATS, after the ring's mbarriers and counters):
// the mbarrier (u64), thread 0's count of warps issued, its clock when the window became
// free, and each warp's staged pair (-1: none), fixed for the launch.
__device__ __forceinline__ float* dstage_words(float* win) {
  return win + MK_ATTN_CHUNK * MK_D + MK_D + 4 * MK_ATTN_STAGES;
}
__device__ __forceinline__ unsigned long long* dstage_mbar(float* win) {
  return reinterpret_cast<unsigned long long*>(dstage_words(win));
}
__device__ __forceinline__ int* dstage_state(float* win) {  // [0] next, [1] start, [2..] pairs
  return reinterpret_cast<int*>(dstage_words(win) + 2);
}

// The pair a warp computes last in stage D, if it has at least two (first: its first pair,
// tw: warps in the grid); else -1 (a warp with one pair issues it before D's hand-off).
__device__ __forceinline__ int dstage_last(int first, int tw) {
  if (first >= MK_I) return -1;
  const int n = (MK_I - 1 - first) / tw + 1;
  return n >= 2 ? first + (n - 1) * tw : -1;
}

__device__ __forceinline__ const bf16* dstage_pair(const float* win, int warp) {
  return reinterpret_cast<const bf16*>(win) + (size_t)warp * 2 * MK_H;
}

// Once per launch, before attention_window_init (whose __syncthreads follows). last: this
// thread's warp's staged pair (dstage_last), or -1.
__device__ __forceinline__ void dstage_init(float* win, int last) {
  if (!MK_DSTAGE_ON) return;
  const int t = threadIdx.x;
  if (t < MK_DSTAGE * 32 && (t & 31) == 0) dstage_state(win)[2 + t / 32] = last;
  if (t == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(dstage_mbar(win)))
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// Thread 0 issues the copies due by now (all of them with `flush`, then arrives once).
__device__ __forceinline__ void dstage_tick(float* win, const bf16* wgu, bool flush) {
  if (!MK_DSTAGE_ON || threadIdx.x != 0) return;
  int* st = dstage_state(win);
  int next = st[0];
  int due = MK_DSTAGE;
  if (MK_DSTAGE_CYC < 0) due = 0;
  else if (!(flush && MK_DSTAGE_FLUSH) && MK_DSTAGE_CYC > 0)
    due = min(due, (int)(((unsigned)clock() - (unsigned)st[1]) / MK_DSTAGE_CYC) + 1);
  const unsigned mb = smem_addr(dstage_mbar(win));
  for (; next < due; ++next) {  // warps from `next` on keep their last pair in HBM
    const int pr = st[2 + next];
    if (pr < 0) continue;
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(mb),
                 "r"(4u * MK_H)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(smem_addr(dstage_pair(win, next))),
        "l"(wgu + (size_t)pr * 2 * MK_H), "r"(4u * MK_H), "r"(mb)
        : "memory");
  }
  st[0] = next;
  if (flush) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mb) : "memory");
}

// The window is free: every ordinary read of it in this layer is behind a __syncthreads.
__device__ __forceinline__ void dstage_begin(float* win, const bf16* wgu) {
  if (!MK_DSTAGE_ON || threadIdx.x != 0) return;
  fence_window();
  int* st = dstage_state(win);
  st[0] = 0;
  st[1] = (int)clock();
  dstage_tick(win, wgu, false);
}

// This warp's staged pair once thread 0's flush is behind a __syncthreads; else -1.
__device__ __forceinline__ int dstage_mine(float* win, int warp) {
  if (!MK_DSTAGE_ON || warp >= MK_DSTAGE) return -1;
  const int* st = dstage_state(win);
  return warp < st[0] ? st[2 + warp] : -1;
}

// A staged warp waits for this layer's phase (count: layers run so far in this launch).
__device__ __forceinline__ void dstage_wait(float* win, unsigned count) {
  const unsigned mb = smem_addr(dstage_mbar(win)), parity = count & 1u;
  unsigned ok = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(mb), "r"(parity)
        : "memory");
  } while (!ok);
}

// Lane-partial dots of a staged pair (shared memory) with xs: rows 0 and 1.
__device__ __forceinline__ float2 dstage_dots(const bf16* pair, const float* xs, int lane) {
  const uint4* wp = reinterpret_cast<const uint4*>(pair);
  float a = 0.f, b = 0.f;
#pragma unroll 1
  for (int c = lane; c < MK_H / 8; c += 32) {
    a += dot8(wp[c], xs, c);
    b += dot8(wp[MK_H / 8 + c], xs, c);
  }
  return make_float2(a, b);
}
