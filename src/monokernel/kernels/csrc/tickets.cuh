// Tickets: work dealt at run time to whichever warp asks first (drawn_rows.cuh for the LM
// head, gemv.cuh gemv_pairs for stage D's last rounds).
//
// Each warp slot w of a CTA has its own counter per use, on its own 128-byte line of the
// barrier buffer (params.cuh), so the ~132 warps of a slot share one address, not the whole
// grid (step 49 lost with one counter for all: thousands of atomics a layer on one address).
// Counter w of a use deals items first + w, first + w + MK_WARPS, ...; every warp that draws
// from it stops at its first ticket past the end, so one use's draws are exactly count +
// gridDim.x whatever the timing, and the counters, zeroed per launch, count on from one use
// to the next: the gen-th use's tickets start at gen * (count + gridDim.x).
#pragma once
#include "common.cuh"

// Words of `barrier` (params.cuh) before the first counter, and between two counters.
#define MK_TICKET_STRIDE 32

// The grid's size and this thread's warp, read where they are used (volatile asm), so the
// values derived from them are not hoisted out of the step loop to hold registers across
// the layer loop (the kind of spill that probes.cuh's profiling flag caused, step 59).
__device__ __forceinline__ int fresh_ctas() {
  unsigned n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return (int)n;
}
__device__ __forceinline__ int fresh_warp() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return (int)(t / 32);
}

// Counter sets: the LM head's, stage D's.
#define MK_TICKETS_F 0
#define MK_TICKETS_D 1

// This warp slot's counter of a set.
__device__ __forceinline__ unsigned* ticket_counter(unsigned* barrier, int set) {
  return barrier + MK_TICKET_STRIDE * (1 + set * MK_WARPS + fresh_warp());
}

// One warp slot's share of one use of its counter.
struct RowTickets {
  unsigned* counter;
  int first;       // the first item + w
  unsigned count;  // items this counter deals
  unsigned base;   // counter value at this use's first draw

  // The item of a ticket, or -1 past the end.
  __device__ __forceinline__ int row(unsigned ticket) const {
    const unsigned t = ticket - base;
    return t < count ? first + (int)t * MK_WARPS : -1;
  }
};

// Items [first, items) of the gen-th use of a set's counters.
__device__ __forceinline__ RowTickets row_tickets(unsigned* barrier, int set, int first,
                                                  int items, unsigned gen) {
  const int w = fresh_warp();
  const int left = items - first - w;
  const unsigned count = left > 0 ? (unsigned)((left + MK_WARPS - 1) / MK_WARPS) : 0u;
  return {ticket_counter(barrier, set), first + w, count, gen * (count + (unsigned)fresh_ctas())};
}

// One ticket, for lane 0. asm volatile keeps the atomic where it is written, a row (or pair)
// ahead of its use, so its round trip hides behind that work.
__device__ __forceinline__ unsigned draw_ticket(unsigned* counter) {
  unsigned v;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

