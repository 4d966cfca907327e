// Timing probes of the profiled step (Params::timing, timing_step; host side:
// MonokernelBackend.profile_step and scripts/stage_skew.py). Off unless the host asks.
#pragma once
#include "params.cuh"

// The CTA whose stage marks the profile records (-1: the last one, which has no attention
// unit at short context).
#ifndef MK_PROF_CTA
#define MK_PROF_CTA 0
#endif

// 1: the CTA and thread are read where a mark is (common.cuh read_*): a flag computed once
// a step and held across the layer loop took a register there, and spilled where registers
// ran short, a local-memory load after every stage's barrier (docs/perf-notes.md step 59).
// 0: the flag as before.
#ifndef MK_PROF_FRESH
#define MK_PROF_FRESH 1
#endif

__device__ __forceinline__ bool profiling(const Params& p, int step) {
  if (!MK_PROF_FRESH) {
    const int cta = MK_PROF_CTA < 0 ? (int)gridDim.x + MK_PROF_CTA : MK_PROF_CTA;
    return p.timing && step == p.timing_step && (int)blockIdx.x == cta && threadIdx.x == 0;
  }
  const unsigned cta = read_ctaid(), tid = read_tid(), n = read_nctaid();
  const int want = MK_PROF_CTA < 0 ? (int)n + MK_PROF_CTA : MK_PROF_CTA;
  return p.timing && step == p.timing_step && (int)cta == want && tid == 0;
}

__device__ __forceinline__ void mark(const Params& p, int step, int idx) {
  if (profiling(p, step)) p.timing[idx] = clock64();
}

// Stage skew (scripts/stage_skew.py, built with -DMK_SKEW=1): every CTA records the global
// time at the points k < MK_SKEW_POINTS of the middle layer of the profiled step, into
// timing[10L + 8 + MK_SKEW_POINTS * cta + k] (the host sizes the buffer for it). The marks
// above show one CTA; this shows who is late.
#define MK_SKEW_POINTS 12  // scripts/stage_skew.py's SLOTS
// -DMK_SKEW_B=1 gives slots 3-8 (stages C to E) to points inside a head unit instead
// (skew_b), to see where an attention unit's time goes.
__device__ __forceinline__ void skew_record(const Params& p, int step, int layer, int k) {
  if (p.timing && step == p.timing_step && layer == MK_L / 2 && threadIdx.x == 0) {
    p.timing[10 * MK_L + 8 + MK_SKEW_POINTS * blockIdx.x + k] = (long long)globaltimer();
  }
}

__device__ __forceinline__ void skew(const Params& p, int step, int layer, int k) {
#ifdef MK_SKEW
#ifdef MK_SKEW_B
  if (k >= 3 && k <= 8) return;
#endif
  skew_record(p, step, layer, k);
#endif
}

__device__ __forceinline__ void skew_b(const Params& p, int step, int layer, int k) {
#if defined(MK_SKEW) && defined(MK_SKEW_B)
  skew_record(p, step, layer, k);
#endif
}
