// The step's end without a grid barrier: each CTA publishes its best (score, id) as one tagged
// 64-bit word, and every CTA polls the grid's words directly (one L2 round trip where the
// barrier took two: its counter, then the partials). Greedy and Gumbel-max draws only; top-k /
// top-p need every logit and keep the barrier (stage_sample.cuh).
//
// Word: score bits [63:32] | id [31:14] | cancel [13] | tag [12:0]. The tag is the step's
// (1-based, mod 2^13; the buffer is zeroed per launch, so step 0's tag 1 never matches). A
// CTA cannot publish step s + 1 before every CTA has read step s's words: step s + 1's layers
// need rows from every CTA (flow.cuh's chain argument), so one word per CTA suffices.
// Ordering: the publisher's release (after a CTA barrier, as grid_arrive) and the readers'
// acquire (then a CTA barrier, as grid_wait) order this step's KV appends before the next
// step's window copies, as the barrier did.
#pragma once
#include "layout.cuh"

// Where token words apply; elsewhere the step ends on the grid barrier and the partials read
// after it: TP exchanges tokens across ranks (tp.cuh), and a larger vocabulary does not fit
// the id field.
constexpr bool kTokenWords = MK_TP == 1 && MK_V <= (1 << 18);

// The words: one a CTA, in Params::part_score (layout.py token_words).
__device__ __forceinline__ unsigned long long* token_words(const Params& p) {
  return reinterpret_cast<unsigned long long*>(p.part_score);
}

constexpr unsigned kTokenTagMask = 0x1fffu;  // bits [12:0]
constexpr unsigned kTokenIdMask = 0x3ffffu;  // 18 bits from bit 14

__device__ __forceinline__ unsigned token_tag(int step) {
  return (unsigned)(step + 1) & kTokenTagMask;
}

// One thread, after a CTA barrier that follows every write of this step others will read.
__device__ __forceinline__ void publish_token_word(unsigned long long* words, float score,
                                                   int id, bool cancel, int step) {
  const unsigned long long w = (unsigned long long)__float_as_uint(score) << 32 |
                               (unsigned long long)((unsigned)id & kTokenIdMask) << 14 |
                               (cancel ? 1ull << 13 : 0ull) | token_tag(step);
  __threadfence();
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(words + blockIdx.x), "l"(w)
               : "memory");
}

// CTA c's word of this step (acquire). A CTA that never publishes means a bug: trap after
// ~10 s rather than hang.
__device__ __forceinline__ unsigned long long wait_token_word(const unsigned long long* words,
                                                              int c, int step) {
  const unsigned tag = token_tag(step);
  const long long t0 = clock64();
  unsigned long long w;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(words + c) : "memory");
    if (((unsigned)w & kTokenTagMask) == tag) return w;
    if (clock64() - t0 > 20000000000LL) __trap();
  }
}

__device__ __forceinline__ float token_word_score(unsigned long long w) {
  return __uint_as_float((unsigned)(w >> 32));
}
__device__ __forceinline__ int token_word_id(unsigned long long w) {
  return (int)(((unsigned)w >> 14) & kTokenIdMask);
}
__device__ __forceinline__ bool token_word_cancel(unsigned long long w) {
  return ((unsigned)w >> 13) & 1u;
}
