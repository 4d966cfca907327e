// Timing probes of the profiled step (Params::timing, timing_step), off unless the host asks.
// The slots are named in layout.cuh (kernels/layout.py), where the host reads them by name.
#pragma once
#include "layout.cuh"

// The CTA and thread are read where a mark is (common.cuh read_*): a flag computed once a
// step and held across the layer loop would take a register there, and spill where registers
// run short.
__device__ __forceinline__ bool profiling(const Params& p, int step) {
  const unsigned cta = read_ctaid(), tid = read_tid();
  return p.timing && step == p.timing_step && (int)cta == kProfCta && tid == 0;
}

// A clock64 mark of CTA kProfCta into timing slot `slot`.
__device__ __forceinline__ void mark(const Params& p, int step, int slot) {
  if (profiling(p, step)) p.timing[slot] = clock64();
}

// A globaltimer reading (ns), which turns the clock64 marks into time.
__device__ __forceinline__ void mark_ns(const Params& p, int step, int slot) {
  if (profiling(p, step)) p.timing[slot] = (long long)globaltimer();
}

// Stage skew (the -DMK_SKEW=1 probe build, tools/stage_skew.py): every CTA records the global
// time at point k of the middle layer of the profiled step. The marks above show one CTA;
// this shows who is late.
__device__ __forceinline__ void skew(const Params& p, int step, int layer, SkewPoint k) {
#ifdef MK_SKEW
  if (p.timing && step == p.timing_step && layer == MK_L / 2 && threadIdx.x == 0) {
    p.timing[kSkewBase + kSkewPoints * blockIdx.x + k] = (long long)globaltimer();
  }
#endif
}

// Fault injection (MONOKERNEL_DEBUG_STALL): CTA 0 waits at the start of step
// p.debug_stall_step until the host raises the cancel word, or forever with
// p.debug_stall_hard (the other CTAs' waits then trap: a kernel fault). The other CTAs simply
// wait for CTA 0's data, as they would behind a stalled SM.
__device__ __forceinline__ void debug_stall(const Params& p, int step) {
  if (step != p.debug_stall_step || blockIdx.x != 0) return;
  if (threadIdx.x == 0) {
    while (true) {
      const int cancel = *p.host_cancel;  // volatile: a load every turn
      if (cancel != 0 && !p.debug_stall_hard) break;
    }
  }
  __syncthreads();
}

