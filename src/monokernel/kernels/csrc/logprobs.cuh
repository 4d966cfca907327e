// Log-probabilities of a step's token and of the n_logprobs most likely ids, as
// runtime/logprobs.py computes them: log_softmax of the raw logits (before a grammar's mask
// and the penalties), the alternatives largest first, ties to the lower id. Every CTA (all its
// threads) after the step's draw, over its slice of the vocabulary (sampling.cuh's grid
// view); CTA 0 writes the record to host-mapped memory, fenced before the grid barrier after
// which the host CTA publishes the token word that announces it.
#pragma once
#include "sampling.cuh"

// An entry of a CTA's candidates: the logit's bits above the id.
__device__ __forceinline__ unsigned long long lp_entry(float z, int id) {
  return (unsigned long long)__float_as_uint(z) << 32 | (unsigned)id;
}
__device__ __forceinline__ float lp_value(unsigned long long e) {
  return __uint_as_float((unsigned)(e >> 32));
}
__device__ __forceinline__ int lp_id(unsigned long long e) { return (int)(unsigned)e; }

__device__ __forceinline__ void write_logprobs(const Params& p, const SampleScratch& s,
                                               unsigned& bar, const float* __restrict__ raw,
                                               int V, int step, int token) {
  const int t = threadIdx.x;
  float m = -INFINITY;
  each_mine(raw, V, [&](int, float z) { m = fmaxf(m, z); });
  m = grid_max(m, s, bar);
  float e = 0.f;
  each_mine(raw, V, [&](int, float z) { e += expf(z - m); });
  const float lse = m + logf(grid_sum(e, s, bar));
  volatile float* rec = p.lp_out + (size_t)step * kLogprobWords;
  const int n = min(p.n_logprobs, V - 1);
  if (n > 0) {
    // The n-th largest logit's level. Each CTA publishes its ids above it (fewer than n in
    // all) and its lowest ids at it (ties: at most n, lowest first): slot [0] the count
    // above, [1] the count at, then the entries, those above first.
    const uint32_t level = kth_largest_key(raw, V, n, [](float z) { return z; }, s, bar);
    unsigned long long* mine = my_part(s, bar);
    if (t == 0) s.misc[4] = 0;
    __syncthreads();
    each_mine(raw, V, [&](int i, float z) {
      if (order_key(z) > level) mine[2 + atomicAdd(s.misc + 4, 1)] = lp_entry(z, i);
    });
    __syncthreads();
    const int above = s.misc[4];
    int at = 0, last = -1;  // this CTA's ids at the level taken so far, the latest of them
    for (; above + at < kSamplePart - 2 && at < n; ++at) {
      float b = -INFINITY;  // -(this CTA's lowest id at the level past `last`)
      each_mine(raw, V, [&](int i, float z) {
        if (i > last && order_key(z) == level) b = fmaxf(b, -(float)i);
      });
      b = block_max(b, s.red);
      if (b == -INFINITY) break;
      last = (int)-b;
      if (t == 0) mine[2 + above + at] = lp_entry(ld_act(raw + last), last);
    }
    if (t == 0) {
      mine[0] = (unsigned)above;
      mine[1] = (unsigned)at;
    }
    const unsigned long long* all = exchange(s, bar);
    if (blockIdx.x == 0) {
      // Those above the level, gathered here, then ranked: larger first, then lower id.
      if (t == 0) s.misc[5] = 0;
      __syncthreads();
      if (t < (int)gridDim.x) {
        const unsigned long long* slot = all + (size_t)t * kSamplePart;
        const int na = (int)__ldcg(slot);
        for (int j = 0; j < na; ++j) s.h64[atomicAdd(s.misc + 5, 1)] = __ldcg(slot + 2 + j);
      }
      __syncthreads();
      const int total = s.misc[5];
      if (t < total) {
        const unsigned long long me = s.h64[t];
        int rank = 0;
        for (int j = 0; j < total; ++j)
          rank += better(lp_value(s.h64[j]), lp_id(s.h64[j]), lp_value(me), lp_id(me));
        rec[1 + 2 * rank] = __int_as_float(lp_id(me));
        rec[2 + 2 * rank] = lp_value(me) - lse;
      }
      // Then the lowest ids at the level, merged from the CTAs' ascending lists (thread c
      // holds CTA c's).
      int head = 0;
      for (int r = total; r < n; ++r) {
        float b = -INFINITY;
        if (t < (int)gridDim.x) {
          const unsigned long long* slot = all + (size_t)t * kSamplePart;
          if (head < (int)__ldcg(slot + 1))
            b = -(float)lp_id(__ldcg(slot + 2 + (int)__ldcg(slot) + head));
        }
        const float w = block_max(b, s.red);
        if (w == -INFINITY) break;  // not reached: n ids reach the level
        if (b == w) {               // this thread's CTA holds it (ids are unique)
          const int id = (int)-w;
          ++head;
          rec[1 + 2 * r] = __int_as_float(id);
          rec[2 + 2 * r] = ld_act(raw + id) - lse;
        }
      }
    }
  }
  if (blockIdx.x == 0 && t == 0) rec[0] = ld_act(raw + token) - lse;
  if (blockIdx.x == 0) __threadfence_system();
}
