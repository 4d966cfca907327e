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

// sampling.py's penalize for token `id`: logit_bias, then repetition_penalty on ids in the
// prompt or the output, then the frequency and presence penalties on the output's counts
// (seen[id] = in_prompt + 2 * count: the host fills it, the sampler counts each token).
// -inf (outside a grammar) stays -inf. The same float operations in the same order as the
// torch rule, so the host replays a step's token from its raw logits.
__device__ __forceinline__ float penalize(const Params& p, int id, float z) {
  if (p.logit_bias) z += __ldg(p.logit_bias + id);
  const unsigned w = p.seen ? __ldcg(p.seen + id) : 0u;
  if (w) {
    const float r = p.repetition;
    if (r != 1.f) z = z > 0.f ? z / r : z * r;
    // Rounded op by op as torch does them (no fused multiply-add).
    if (w >> 1) z = __fsub_rn(__fsub_rn(z, __fmul_rn(p.frequency, (float)(w >> 1))), p.presence);
  }
  return z;
}

// After a step's token: count it for the penalties (one thread of the grid, or of each TP
// rank). The next step's LM head reads the count behind a fence (lm_head), after a chain of
// hand-offs that this CTA's later stages feed.
__device__ __forceinline__ void count_token(const Params& p, int token) {
  atomicAdd(p.seen + token, 2u);
  __threadfence();
}

#define MK_PFIX 1099511627776.0  // 2^40: probabilities in fixed point, so sums are exact

struct SampleScratch {
  unsigned long long* h64;   // [256] smem: per radix bin, this CTA's count or mass, then the grid's
  unsigned* h32;             // [256] smem: per warp ids (winners)
  int* misc;                 // [16] smem
  float* red;                // [kWarps + 1] smem
  unsigned long long* part;  // global [2, grid, kSamplePart]: every CTA's partials (Params)
  unsigned* barrier;         // Params::barrier
};

// ---- the grid's view: every CTA samples its slice, partials meet behind grid barriers ----
//
// A top-k / top-p / min_p draw or a step's logprobs needs the whole distribution: several
// passes over the vocabulary, each with an exp or a hash per id. One CTA doing them all was
// instruction-bound (~50 µs a pass over 128k ids: top-p made a 1B model's token 2-3x
// slower), so every CTA takes the ids i = blockIdx.x * kThreads + threadIdx.x + j * grid *
// kThreads (about a thousand) and the CTAs' partials meet through `part` behind a grid
// barrier. Each exchange uses the half of `part` that the parity of the grid barriers passed
// so far selects, so a CTA writing the next exchange's slot never overwrites one a slower CTA
// still reads. Every CTA reduces the grid's partials itself, in the same fixed order, so all
// reach the same values (integer sums where a threshold is chosen), with no broadcast.

// f(i) for this CTA's slice of ids i < V (all threads call it); each thread gets the same
// ids every time.
template <class F>
__device__ __forceinline__ void each_id(int V, F f) {
  const int stride = (int)gridDim.x * kThreads;
  for (int i = (int)blockIdx.x * kThreads + (int)threadIdx.x; i < V; i += stride) f(i);
}
// f(i, logits[i]) for this CTA's slice of ids.
template <class F>
__device__ __forceinline__ void each_mine(const float* __restrict__ logits, int V, F f) {
  each_id(V, [&](int i) { f(i, ld_act(logits + i)); });
}

// The half of `part` that the exchange the next grid barrier completes uses: [grid,
// kSamplePart] slots.
__device__ __forceinline__ unsigned long long* exchange_half(const SampleScratch& s,
                                                             unsigned bar) {
  return s.part + (size_t)((bar / gridDim.x) & 1u) * gridDim.x * kSamplePart;
}

// This CTA's slot of the exchange that the next grid barrier completes.
__device__ __forceinline__ unsigned long long* my_part(const SampleScratch& s, unsigned bar) {
  return exchange_half(s, bar) + (size_t)blockIdx.x * kSamplePart;
}

// The grid barrier after every CTA wrote its slot (my_part); returns that exchange's
// [grid, kSamplePart] slots.
__device__ __forceinline__ const unsigned long long* exchange(const SampleScratch& s,
                                                              unsigned& bar) {
  const unsigned long long* half = exchange_half(s, bar);
  grid_barrier(s.barrier, bar);
  return half;
}

// One float from every thread of the grid reduced to one, which every thread gets: block(v,
// red) reduces a CTA's (block_max, block_sum), op(a, b) combines the CTAs' in CTA order.
template <class Block, class Op>
__device__ __forceinline__ float grid_reduce(float v, float init, Block block, Op op,
                                             const SampleScratch& s, unsigned& bar) {
  v = block(v, s.red);
  if (threadIdx.x == 0) my_part(s, bar)[0] = __float_as_uint(v);
  const unsigned long long* all = exchange(s, bar);
  float r = init;
  for (int c = threadIdx.x; c < (int)gridDim.x; c += kThreads)
    r = op(r, __uint_as_float((unsigned)__ldcg(all + (size_t)c * kSamplePart)));
  return block(r, s.red);
}

__device__ __forceinline__ float grid_max(float v, const SampleScratch& s, unsigned& bar) {
  return grid_reduce(v, -INFINITY, block_max, [](float a, float b) { return fmaxf(a, b); }, s,
                     bar);
}

__device__ __forceinline__ float grid_sum(float v, const SampleScratch& s, unsigned& bar) {
  return grid_reduce(v, 0.f, block_sum, [](float a, float b) { return a + b; }, s, bar);
}

// s.h64 (this CTA's 256-bin histogram) <- the grid's.
__device__ __forceinline__ void grid_histogram(const SampleScratch& s, unsigned& bar) {
  __syncthreads();
  unsigned long long* mine = my_part(s, bar);
  for (int b = threadIdx.x; b < 256; b += kThreads) mine[b] = s.h64[b];
  const unsigned long long* all = exchange(s, bar);
  // kThreads / 256 threads a bin, each over every PER-th CTA's slot with 8 loads in flight
  // (one thread a bin, one load at a time, took ~10-20 µs a round over 132 slots). Integer
  // sums: the order does not matter.
  static_assert(kThreads % 256 == 0, "whole threads a bin");
  constexpr int PER = kThreads / 256;
  const int b = threadIdx.x % 256, part = threadIdx.x / 256, g = (int)gridDim.x;
  unsigned long long sum = 0;
  for (int c0 = part; c0 < g; c0 += 8 * PER) {
    unsigned long long v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0 + j * PER;
      v[j] = c < g ? __ldcg(all + (size_t)c * kSamplePart + b) : 0ull;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += v[j];
  }
  if (part == 0) s.h64[b] = 0;
  __syncthreads();
  atomicAdd(s.h64 + b, sum);
  __syncthreads();
}

// Histogram adds from the active lanes of a warp, one shared-memory atomic a distinct bin
// (most of a vocabulary's ids fall into the same few bins). Values below 2^40 (MK_PFIX
// masses, or counts of 1) are summed over the peers in two 20-bit halves, so the 32-bit warp
// reductions cannot overflow.
__device__ __forceinline__ void bin_add(unsigned long long* h, unsigned bin,
                                        unsigned long long v) {
  const unsigned peers = __match_any_sync(__activemask(), bin);
  const unsigned hi = __reduce_add_sync(peers, (unsigned)(v >> 20));
  const unsigned lo = __reduce_add_sync(peers, (unsigned)(v & 0xFFFFFu));
  if ((threadIdx.x & 31) == __ffs(peers) - 1)
    atomicAdd(h + bin, ((unsigned long long)hi << 20) + lo);
}

// The order_key of the k-th largest of z(logits[i]), i < V (1 <= k < V), by radix selection
// over the grid; every CTA returns it.
template <class Z>
__device__ __forceinline__ uint32_t kth_largest_key(const float* __restrict__ logits, int V,
                                                    int k, Z z, const SampleScratch& s,
                                                    unsigned& bar) {
  const int t = threadIdx.x;
  uint32_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = t; b < 256; b += kThreads) s.h64[b] = 0;
    __syncthreads();
    each_mine(logits, V, [&](int, float x) {
      const uint32_t key = order_key(z(x));
      if ((key & mask) == prefix) bin_add(s.h64, (key >> shift) & 255u, 1ull);
    });
    grid_histogram(s, bar);
    if (t == 0) {
      int cum = 0, sel = 0;
      for (int b = 255; b >= 0; --b) {
        if (cum + (int)s.h64[b] >= need) { sel = b; break; }
        cum += (int)s.h64[b];
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
  return prefix;
}

// The grid's (score, id) winner of every thread's (b, bi), ties to the lower id: every thread
// of every CTA gets it.
__device__ __forceinline__ int grid_winner(float b, int bi, const SampleScratch& s,
                                           unsigned& bar) {
  const int t = threadIdx.x;
  auto cta_best = [&] {
    warp_argmax(b, bi);
    __syncthreads();
    if ((t & 31) == 0) {
      s.red[t >> 5] = b;
      s.h32[t >> 5] = (unsigned)bi;
    }
    __syncthreads();
    if (t == 0)
      for (int w = 1; w < kWarps; ++w)
        if (better(s.red[w], (int)s.h32[w], b, bi)) { b = s.red[w]; bi = (int)s.h32[w]; }
  };
  cta_best();
  if (t == 0) {
    unsigned long long* mine = my_part(s, bar);
    mine[0] = __float_as_uint(b);
    mine[1] = (unsigned)bi;
  }
  const unsigned long long* all = exchange(s, bar);
  b = -INFINITY;
  bi = 0x7fffffff;
  for (int c = t; c < (int)gridDim.x; c += kThreads) {
    const float sc = __uint_as_float((unsigned)__ldcg(all + (size_t)c * kSamplePart));
    const int id = (int)__ldcg(all + (size_t)c * kSamplePart + 1);
    if (better(sc, id, b, bi)) { b = sc; bi = id; }
  }
  cta_best();
  if (t == 0) s.misc[1] = bi;
  __syncthreads();
  const int token = s.misc[1];
  __syncthreads();
  return token;
}

// Every CTA (all its threads) draws the same token from logits[V] (V: the whole vocabulary,
// ids 0..V-1) with top-k, top-p or min_p active, or greedily where logprobs send a greedy step
// here. Radix selection finds the thresholds exactly: top-k's k-th largest z, top-p's p* (the
// largest p whose tail mass sum(p' >= p) reaches top_p). Integer sums keep it deterministic:
// the same logits give the same token on every GPU.
__device__ __forceinline__ int sample_filtered(const Params& p, uint32_t key,
                                               const SampleScratch& s, unsigned& bar,
                                               const float* __restrict__ logits, int V) {
  const int t = threadIdx.x;
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  if (p.temperature == 0.f) {
    each_mine(logits, V, [&](int i, float z) {
      if (better(z, i, best, best_id)) { best = z; best_id = i; }
    });
    return grid_winner(best, best_id, s, bar);
  }
  const float temp = p.temperature;
  // --- min_p: keep z with exp(z - max z) >= min_p (p >= min_p * p_max); the rest -inf ---
  float zpeak = INFINITY;  // the largest z, where min_p is on
  if (p.min_p > 0.f) {
    float lm = -INFINITY;
    each_mine(logits, V, [&](int, float x) { lm = fmaxf(lm, x / temp); });
    zpeak = grid_max(lm, s, bar);
  }
  auto zof = [&](float x) {
    const float z = x / temp;
    return zpeak != INFINITY && expf(z - zpeak) < p.min_p ? -INFINITY : z;
  };
  // --- top-k: the k-th largest z (ties at the boundary kept) ---
  const uint32_t kth =
      p.top_k > 0 && p.top_k < V ? kth_largest_key(logits, V, p.top_k, zof, s, bar) : 0u;
  // --- top-p over the kept set ---
  float pstar = 0.f, zmax = 0.f, denom = 1.f;
  const bool use_p = p.top_p < 1.f;
  if (use_p) {
    float lm = -INFINITY;
    each_mine(logits, V, [&](int, float x) {
      const float z = zof(x);
      if (order_key(z) >= kth) lm = fmaxf(lm, z);
    });
    zmax = grid_max(lm, s, bar);
    float ls = 0.f;
    each_mine(logits, V, [&](int, float x) {
      const float z = zof(x);
      if (order_key(z) >= kth) ls += expf(z - zmax);
    });
    denom = grid_sum(ls, s, bar);
    const unsigned long long target = (unsigned long long)((double)p.top_p * MK_PFIX);
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      for (int b = t; b < 256; b += kThreads) s.h64[b] = 0;
      __syncthreads();
      each_mine(logits, V, [&](int, float x) {
        const float z = zof(x);
        if (order_key(z) < kth) return;
        const float pr = expf(z - zmax) / denom;
        const uint32_t k = __float_as_uint(pr);
        if ((k & mask) == prefix)
          bin_add(s.h64, (k >> shift) & 255u, (unsigned long long)((double)pr * MK_PFIX + 0.5));
      });
      grid_histogram(s, bar);
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
  each_mine(logits, V, [&](int i, float x) {
    const float z = zof(x);
    if (order_key(z) < kth) return;
    if (use_p && expf(z - zmax) / denom < pstar) return;
    const float sc = z + gumbel(key, i);
    if (better(sc, i, best, best_id)) { best = sc; best_id = i; }
  });
  return grid_winner(best, best_id, s, bar);
}
