// The LM head's last rows dealt at run time: whichever warp is free takes the next row.
//
// The SMs of one H100 stream at unequal rates, so with the LM head's rows dealt equally the
// step waits for the slowest SMs. The static deal keeps whole rounds of rows; the rest (the
// tail) goes out by tickets. Each warp slot of a CTA has its own counter on its own 128-byte
// line (one counter for the grid makes every draw a round trip to one contended address), a
// ticket is drawn a whole row before it is needed, and the tail is a few rows a warp once a
// token.
#pragma once
#include "gemv.cuh"

// MK_F_DRAWN (build.py lm_head_drawn_rows): rows a warp takes from the tail, on average (0:
// the LM head is dealt statically only).

// The grid's size and this thread's warp, read where they are used (common.cuh read_*), so
// nothing derived from them is held across the layer loop.
__device__ __forceinline__ int fresh_ctas() { return (int)read_nctaid(); }
__device__ __forceinline__ int fresh_warp() { return (int)(read_tid() / 32); }

// Rows of W [rows, ...] dealt statically over `groups` units a CTA: whole rounds, leaving at
// least MK_F_DRAWN rows a warp to the tickets.
__device__ __forceinline__ int static_rows(int rows, int groups) {
  if (MK_F_DRAWN == 0) return rows;
  const int ctas = fresh_ctas(), units = ctas * groups;
  return (rows - min(rows, MK_F_DRAWN * ctas * kWarps)) / units * units;
}

// This warp slot's counter.
__device__ __forceinline__ unsigned* ticket_counter(unsigned* barrier) {
  return barrier + kTicketStride * (1 + fresh_warp());
}

// One warp slot's share of a tail: counter w deals rows first + w, first + w + kWarps, ...
// Every warp that draws from it stops at its first ticket past the end, so a step's draws
// are exactly rows_w + gridDim.x whatever the timing: the counter counts on from step to step
// (zeroed per launch only), and step s's tickets start at s * (rows_w + gridDim.x).
struct RowTickets {
  unsigned* counter;
  int first;       // the tail's first row + w
  unsigned count;  // rows_w: rows this counter deals
  unsigned base;   // counter value at this step's first draw

  // The row of a ticket, or -1 past the tail.
  __device__ __forceinline__ int row(unsigned ticket) const {
    const unsigned t = ticket - base;
    return t < count ? first + (int)t * kWarps : -1;
  }
};

__device__ __forceinline__ RowTickets row_tickets(unsigned* barrier, int first, int rows,
                                                  int step) {
  const int w = fresh_warp();
  const int left = rows - first - w;
  const unsigned count = left > 0 ? (unsigned)((left + kWarps - 1) / kWarps) : 0u;
  return {ticket_counter(barrier), first + w, count, (unsigned)step * (count + fresh_ctas())};
}

// One ticket, for lane 0. asm volatile keeps the atomic where it is written, a row ahead of
// its use, so its round trip hides behind that row.
__device__ __forceinline__ unsigned draw_ticket(unsigned* counter) {
  unsigned v;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// Whole rows of W [rows, K] (one warp a row) from the tickets of tk, the first of which
// (`got`, lane 0's) was drawn earlier. out(r, value) is called by lane 0. A row goes out in
// two batches; each row's first batch goes out before the row ahead of it is reduced, and the
// two buffers take turns, so no copy between them waits for loads in flight (gemv_split's
// PINGPONG).
template <int K, class F, class Out, int BATCH = (RowShape<F, K, 1>::N + 1) / 2>
__device__ __forceinline__ void gemv_drawn(Matrix<F> M, const RowTickets& tk, unsigned got,
                                           const float* __restrict__ xs, int lane, Out out,
                                           float scale) {
  using S = RowShape<F, K, BATCH>;
  using L = typename F::Load;
  L a[S::B], b[S::B];
  int r = tk.row(__shfl_sync(0xffffffffu, got, 0));
  if (r < 0) return;
  issue_first<F, K, BATCH>(a, M.at((size_t)r * K), lane);
  if (lane == 0) got = draw_ticket(tk.counter);
  // Row r from cur; the next row's first batch into nxt. False once the tail is done.
  auto one = [&](L(&cur)[S::B], L(&nxt)[S::B]) {
    const int rn = tk.row(__shfl_sync(0xffffffffu, got, 0));  // drawn a row ago
    if (rn >= 0 && lane == 0) got = draw_ticket(tk.counter);
    issue_first<F, K, BATCH>(nxt, M.at((size_t)(rn >= 0 ? rn : r) * K), lane, rn >= 0);
    const float rs = M.row_scale(r);
    const float d = warp_sum(row_partial<F, K, BATCH>(cur, M.at((size_t)r * K), xs, lane));
    if (lane == 0) out(r, F::kScaled ? d * (scale * rs) : d * scale);
    r = rn;
    return rn >= 0;
  };
  while (one(a, b) && one(b, a)) {
  }
}

// gemv_drawn over a verify pass's n inputs (gemv_pass.cuh): each drawn row dotted with every
// position's, out(q, r, value) by lane 0, each the step's value to the bit.
template <int K, class F, class Out, int BATCH = (RowShape<F, K, 1>::N + 1) / 2>
__device__ __forceinline__ void gemv_drawn_pass(Matrix<F> M, const RowTickets& tk, unsigned got,
                                                const float* __restrict__ xs, int stride, int n,
                                                int lane, Out out, const float (&scale)[MK_P]) {
  using S = RowShape<F, K, BATCH>;
  using L = typename F::Load;
  if (n == 1) {  // a draftless pass: the step's own loop
    gemv_drawn<K, F>(M, tk, got, xs, lane, [&](int r, float v) { out(0, r, v); }, scale[0]);
    return;
  }
  L a[S::B], b[S::B];
  int r = tk.row(__shfl_sync(0xffffffffu, got, 0));
  if (r < 0) return;
  issue_first<F, K, BATCH>(a, M.at((size_t)r * K), lane);
  if (lane == 0) got = draw_ticket(tk.counter);
  auto one = [&](L(&cur)[S::B], L(&nxt)[S::B]) {
    const int rn = tk.row(__shfl_sync(0xffffffffu, got, 0));
    if (rn >= 0 && lane == 0) got = draw_ticket(tk.counter);
    issue_first<F, K, BATCH>(nxt, M.at((size_t)(rn >= 0 ? rn : r) * K), lane, rn >= 0);
    const float rs = M.row_scale(r);
    float d[MK_P];
    row_partials<F, K, BATCH>(cur, M.at((size_t)r * K), xs, stride, n, lane, d);
#pragma unroll
    for (int q = 0; q < MK_P; ++q) {
      if (q < n) {
        const float v = warp_sum(d[q]);
        if (lane == 0) out(q, r, F::kScaled ? v * (scale[q] * rs) : v * scale[q]);
      }
    }
    r = rn;
    return rn >= 0;
  };
  while (one(a, b) && one(b, a)) {
  }
}
