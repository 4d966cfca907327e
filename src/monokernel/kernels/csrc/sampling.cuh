// On-device sampling, the exact rule of monokernel/runtime/sampling.py:
// counter-based uniforms u = ((fmix32(key ^ id*0x9E3779B1) >> 8) + 0.5) / 2^24, Gumbel-max,
// top-k and top-p thresholds with ties kept, argmax ties to the lowest id.
#pragma once
#include "layout.cuh"

__device__ __forceinline__ uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// The 32-bit key of one draw: hash(seed_lo, hash(seed_hi, hash(position))).
__device__ __forceinline__ uint32_t draw_key(uint32_t lo, uint32_t hi, int position) {
  uint32_t k = fmix32((uint32_t)position + 0x9E3779B9u);
  k = fmix32(hi ^ k);
  return fmix32(lo ^ k);
}

__device__ __forceinline__ float gumbel(uint32_t key, int id) {
  const uint32_t bits = fmix32(key ^ ((uint32_t)id * 0x9E3779B1u));
  const float u = ((float)(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

// Monotone map float -> uint32 (larger float, larger key).
__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t u = __float_as_uint(z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Constrained decoding: whether the grammar lets token `id` come at step `step`. The host
// writes each step's mask (one 64-bit word per 32 ids: the allowed bits | tag << 32) while
// the kernel runs that step's layers; a row whose word has not landed yet spins until it
// has, or until the host asks the kernel to stop.
__device__ __forceinline__ bool grammar_allows(const Params& p, int step, int id) {
  const unsigned tag = p.mask_tag + (unsigned)step;
  const volatile unsigned long long* w =
      p.mask + (size_t)(step & 1) * ((MK_V_ALL + 31) / 32) + (id >> 5);
  unsigned long long v;
  while ((unsigned)((v = *w) >> 32) != tag) {
    if (*p.host_cancel != 0) return true;  // the step's token is not used
  }
  return (v >> (id & 31)) & 1ull;
}

struct SampleScratch {
  unsigned long long* h64;  // [256] fixed-point probability mass per radix bin
  unsigned* h32;            // [256] counts per radix bin
  int* misc;                // [16]
  float* red;               // [kWarps + 1]
};

#define MK_PFIX 1099511627776.0  // 2^40: probabilities in fixed point, so sums are exact

// One CTA (all its threads) draws a token from logits[V] (V: the whole vocabulary, ids 0..V-1)
// with top-k and/or top-p active. Radix selection finds the thresholds exactly: top-k's k-th
// largest z, top-p's p* (the largest p whose tail mass sum(p' >= p) reaches top_p). Integer
// sums keep it deterministic: the same logits give the same token on every GPU.
__device__ int sample_filtered(const Params& p, uint32_t key, SampleScratch s,
                               const float* __restrict__ logits, int V) {
  const int t = threadIdx.x;
  const float temp = p.temperature;
  // --- top-k: the k-th largest z (ties at the boundary kept) ---
  uint32_t kth = 0;  // keep order_key(z) >= kth
  if (p.top_k > 0 && p.top_k < V) {
    uint32_t prefix = 0, mask = 0;
    int need = p.top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = t; b < 256; b += kThreads) s.h32[b] = 0;
      __syncthreads();
      for (int i = t; i < V; i += kThreads) {
        const uint32_t k = order_key(ld_act(logits + i) / temp);
        if ((k & mask) == prefix) atomicAdd(&s.h32[(k >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (t == 0) {
        int cum = 0, sel = 0;
        for (int b = 255; b >= 0; --b) {
          if (cum + (int)s.h32[b] >= need) { sel = b; break; }
          cum += s.h32[b];
        }
        s.misc[0] = sel;
        s.misc[1] = need - cum;
      }
      __syncthreads();
      prefix |= (uint32_t)s.misc[0] << shift;
      mask |= 255u << shift;
      need = s.misc[1];
      __syncthreads();
    }
    kth = prefix;
  }
  // --- top-p over the kept set ---
  float pstar = 0.f, zmax = 0.f, denom = 1.f;
  const bool use_p = p.top_p < 1.f;
  if (use_p) {
    float lm = -INFINITY;
    for (int i = t; i < V; i += kThreads) {
      const float z = ld_act(logits + i) / temp;
      if (order_key(z) >= kth) lm = fmaxf(lm, z);
    }
    zmax = block_max(lm, s.red);
    float ls = 0.f;
    for (int i = t; i < V; i += kThreads) {
      const float z = ld_act(logits + i) / temp;
      if (order_key(z) >= kth) ls += expf(z - zmax);
    }
    denom = block_sum(ls, s.red);
    const unsigned long long target = (unsigned long long)((double)p.top_p * MK_PFIX);
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      for (int b = t; b < 256; b += kThreads) s.h64[b] = 0;
      __syncthreads();
      for (int i = t; i < V; i += kThreads) {
        const float z = ld_act(logits + i) / temp;
        if (order_key(z) < kth) continue;
        const float pr = expf(z - zmax) / denom;
        const uint32_t k = __float_as_uint(pr);
        if ((k & mask) == prefix)
          atomicAdd(&s.h64[(k >> shift) & 255u],
                    (unsigned long long)((double)pr * MK_PFIX + 0.5));
      }
      __syncthreads();
      if (t == 0) {
        unsigned long long acc = above;
        int sel = -1;
        for (int b = 255; b >= 0; --b) {
          if (acc + s.h64[b] >= target) { sel = b; break; }
          acc += s.h64[b];
        }
        s.misc[0] = sel;
        *reinterpret_cast<unsigned long long*>(s.misc + 2) = acc;
      }
      __syncthreads();
      const int sel = s.misc[0];
      if (sel < 0) {
        found = false;  // rounding left the mass short of top_p: keep the whole set
      } else {
        prefix |= (uint32_t)sel << shift;
        mask |= 255u << shift;
        above = *reinterpret_cast<unsigned long long*>(s.misc + 2);
      }
      __syncthreads();
    }
    pstar = found ? __uint_as_float(prefix) : 0.f;
  }
  // --- Gumbel-max over the kept set ---
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  for (int i = t; i < V; i += kThreads) {
    const float z = ld_act(logits + i) / temp;
    if (order_key(z) < kth) continue;
    if (use_p && expf(z - zmax) / denom < pstar) continue;
    const float sc = z + gumbel(key, i);
    if (better(sc, i, best, best_id)) { best = sc; best_id = i; }
  }
  warp_argmax(best, best_id);
  __syncthreads();
  if ((t & 31) == 0) {
    s.red[t >> 5] = best;
    s.h32[t >> 5] = (unsigned)best_id;
  }
  __syncthreads();
  if (t == 0) {
    float b = s.red[0];
    int bi = (int)s.h32[0];
    for (int w = 1; w < kWarps; ++w)
      if (better(s.red[w], (int)s.h32[w], b, bi)) { b = s.red[w]; bi = (int)s.h32[w]; }
    s.misc[1] = bi;
  }
  __syncthreads();
  const int token = s.misc[1];
  __syncthreads();
  return token;
}
