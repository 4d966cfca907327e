// The LM head's last rows dealt at run time: whichever warp is free takes the next row.
//
// The SMs of one H100 stream at rates up to 13% apart (docs/perf-notes.md step 38), so with
// the LM head's rows dealt equally the step waits for the slowest SMs (CTA 0 waited ~7.5 µs
// on Qwen2.5-1.5B after step 58). The static deal keeps whole rounds of rows; the rest (the
// tail) goes out by tickets (tickets.cuh), each drawn a whole row before it is needed
// (step 59).
#pragma once
#include "gemv.cuh"
#include "tickets.cuh"

// Rows a warp takes from the tail, on average (0: the LM head is dealt statically only);
// build.py picks it per shape (lm_head_drawn_rows).
#ifndef MK_F_DRAWN
#define MK_F_DRAWN 8
#endif
// Loads a lane issues per batch of a drawn row (0: half a row, so two batches a row).
#ifndef MK_F_DRAWN_BATCH
#define MK_F_DRAWN_BATCH 0
#endif

// Rows of W [rows, ...] dealt statically over `groups` units a CTA: whole rounds, leaving at
// least MK_F_DRAWN rows a warp to the tickets.
__device__ __forceinline__ int static_rows(int rows, int groups) {
  if (MK_F_DRAWN == 0) return rows;
  const int ctas = fresh_ctas(), units = ctas * groups;
  return (rows - min(rows, MK_F_DRAWN * ctas * MK_WARPS)) / units * units;
}

// Whole rows of W [rows, K] (one warp a row) from the tickets of tk, the first of which
// (`got`, lane 0's) was drawn earlier. out(r, value) is called by lane 0. Each row's first
// batch goes out before the row ahead of it is reduced; the two buffers take turns, so no
// copy between them waits for loads in flight (gemv_split's PINGPONG, step 58).
template <int K, int BATCH, class Out>
__device__ __forceinline__ void gemv_drawn(const bf16* __restrict__ W, const RowTickets& tk,
                                           unsigned got, const float* __restrict__ xs, int lane,
                                           Out out, float scale) {
  using S = RowShape<K, BATCH>;
  uint4 a[S::B], b[S::B];
  int r = tk.row(__shfl_sync(0xffffffffu, got, 0));
  if (r < 0) return;
  issue_first<K, BATCH>(a, W + (size_t)r * K, lane);
  if (lane == 0) got = draw_ticket(tk.counter);
  // Row r from cur; the next row's first batch into nxt. False once the tail is done.
  auto one = [&](uint4(&cur)[S::B], uint4(&nxt)[S::B]) {
    const int rn = tk.row(__shfl_sync(0xffffffffu, got, 0));  // drawn a row ago
    if (rn >= 0 && lane == 0) got = draw_ticket(tk.counter);
    issue_first<K, BATCH>(nxt, W + (size_t)(rn >= 0 ? rn : r) * K, lane, rn >= 0);
    const float d = warp_sum(row_partial<K, BATCH>(cur, W + (size_t)r * K, xs, lane));
    if (lane == 0) out(r, d * scale);
    r = rn;
    return rn >= 0;
  };
  while (one(a, b) && one(b, a)) {
  }
}
