// A pass build's drafts, made by every CTA from the request's own tokens (Params::history:
// position i's token, the prompt's and then each accepted one), so no CTA waits on another
// and no host round trip sits between two passes: the n-gram rule of the host's drafter
// (runtime/speculative.py NgramDrafter). The longest suffix of the tokens up to pos, of
// draft_max tokens at most and draft_min at least, that also ends at an earlier position j;
// of those the latest j; the draft is the tokens after j, up to `most` of them and not past
// pos. Every CTA computes the same draft (one rule on the same tokens).
#pragma once
#include "cta.cuh"

// How many of the draft_max tokens ending at j match those ending at pos (from the end).
__device__ __forceinline__ int suffix_match(const int* h, int j, int pos, int most) {
  int n = 0;
  while (n < most && j - n >= 0 && __ldcg(h + j - n) == __ldcg(h + pos - n)) ++n;
  return n;
}

// in[1 ..] <- the draft after the token at pos (in[0], Params::history[pos]); returns its
// length (0: no suffix of draft_min tokens occurred before). All threads must call; in is
// shared memory of MK_P + 1 ints (the length last), valid for every thread on return.
__device__ __forceinline__ int draft_tokens(const Params& p, const Cta& c, int pos, int most,
                                            int* in) {
  const int* h = p.history;
  const int longest = min(p.draft_max, pos + 1);
  // Key: match length, then the position j (later wins), 0 for none.
  unsigned long long best = 0;
  for (int j = (int)threadIdx.x; j < pos; j += kThreads) {
    const int n = suffix_match(h, j, pos, longest);
    if (n >= p.draft_min) {
      const unsigned long long key = (unsigned long long)n << 32 | (unsigned)(j + 1);
      best = key > best ? key : best;
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  __syncthreads();  // ss.h64's last readers are done
  if (c.lane == 0) c.ss.h64[c.warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long b = 0;
    for (int w = 0; w < kWarps; ++w) b = c.ss.h64[w] > b ? c.ss.h64[w] : b;
    int n = 0;
    if (b) {
      const int j = (int)(b & 0xffffffffu) - 1;
      n = min(most, pos - j);  // the tokens after j, not past pos
      for (int i = 0; i < n; ++i) in[1 + i] = __ldcg(h + j + 1 + i);
    }
    in[MK_P] = n;
  }
  __syncthreads();
  return in[MK_P];
}
