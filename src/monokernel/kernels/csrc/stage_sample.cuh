// The token: every CTA reduces the CTAs' best draws itself (no extra barrier), unless top-k /
// top-p needs the whole distribution: then CTA 0 draws and publishes it (under TP, CTA 0 of
// every rank, from the whole vocabulary's logits: tp.cuh). Then the stop check, and the token
// to host-mapped memory, where the host streams it out as it lands.
#pragma once
#include "cta.cuh"
#include "probes.cuh"

struct Sampled {
  int next;   // the token
  bool done;  // the last step: budget spent, a stop id, or the host asked to stop
};

__device__ __forceinline__ Sampled sample(const Params& p, Cta& c, const Step& s, uint32_t key) {
  int next;
  bool cancelled = false;  // the host's cancel word as the token words carried it
  if (c.filtered) {
    if (blockIdx.x == 0) {
      next = Net::draw_filtered(p, key, c.ss, s.index);
      if (c.t == 0) p.flags[kFlagToken] = next;
    }
    grid_barrier(p.barrier, c.bar);
    next = __ldcg(p.flags + kFlagToken);
    cancelled = Net::filtered_cancel(p);
  } else {
    float b = -INFINITY;
    int bi = 0x7fffffff;
    bool cancel_seen = false;
    for (int cta = c.t; cta < (int)gridDim.x; cta += kThreads) {
      float sc;
      int i;
      if (c.words) {
        const unsigned long long w = wait_token_word(token_words(p), cta, s.index);
        sc = token_word_score(w);
        i = token_word_id(w);
        cancel_seen |= token_word_cancel(w);
      } else {
        sc = __ldcg(p.part_score + cta);
        i = __ldcg(p.part_id + cta);
      }
      if (better(sc, i, b, bi)) { b = sc; bi = i; }
    }
    if (c.words) {
      // Every word is in (acquired): this step's KV appends are visible to the copies.
      cancelled = __syncthreads_or(cancel_seen);
      if (s.index + 1 < p.n_steps) attention_prefetch(p, 0, s.pos() + 1, c.kvwin);
    }
    warp_argmax(b, bi);
    __syncthreads();
    if (c.lane == 0) {
      c.red[c.warp] = b;
      c.ss.h32[c.warp] = (unsigned)bi;
    }
    __syncthreads();
    if (c.t == 0) {
      for (int w = 1; w < kWarps; ++w)
        if (better(c.red[w], (int)c.ss.h32[w], b, bi)) { b = c.red[w]; bi = (int)c.ss.h32[w]; }
      Net::exchange(p, s.index, b, bi, c.ss.misc);  // tensor parallelism: the ranks' winner
      c.ss.misc[0] = bi;
    }
    __syncthreads();
    next = c.ss.misc[0];
    cancelled = Net::exchanged_cancel(c.ss.misc, cancelled);
    __syncthreads();
  }
  bool done = s.index + 1 == p.n_steps || Net::stop_asked(p, c.words, cancelled);
  for (int i = 0; i < p.n_stop; ++i) done |= p.stop_ids[i] == next;
  if (c.host_cta && c.t == 0 && Net::speaks(p)) {
    // Nonzero once written: the host polls each token's word (zeroed before the launch) in
    // order, so it needs no order among them; only `done` is fenced after them all.
    p.host_out[kHostOutHead + s.index] = next + 1;
    p.host_out[0] = s.index + 1;  // the count, read once the kernel has exited
    if (done) {
      __threadfence_system();
      p.host_out[1] = 1;
    }
  }
  mark(p, s.index, kMarkSampleWork);
  mark_ns(p, s.index, kMarkStepEndNs);
  return {next, done};
}
