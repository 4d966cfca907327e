// The token: every CTA reduces the CTAs' best draws itself (no extra barrier), unless top-k /
// top-p / min_p or logprobs need the whole distribution: then every CTA samples its slice of
// it and the CTAs meet behind grid barriers (sampling.cuh; under TP every rank draws from the
// whole vocabulary's logits: tp.cuh), with the step's logprobs where asked. Then the stop
// check, and the token to host-mapped memory, where the host streams it out as it lands.
#pragma once
#include "cta.cuh"
#include "logprobs.cuh"
#include "probes.cuh"

struct Sampled {
  int next;   // the token
  bool done;  // the last step: budget spent, a stop id, or the host asked to stop
};

struct Drawn {
  int token;
  unsigned bar;  // the CTA's grid-barrier count after the draw
};

// Whether `id` is one of the launch's stop ids.
__device__ __forceinline__ bool is_stop(const Params& p, int id) {
  bool stop = false;
  for (int i = 0; i < p.n_stop; ++i) stop |= p.stop_ids[i] == id;
  return stop;
}

// A draw from the whole distribution (top-k / top-p / min_p, or with logprobs), every CTA.
// Not inlined: its passes need registers that the decode loop's own code keeps (inlined, it
// cost the Llama-3.2-1B shape ~9 µs a greedy token in spills; perf-notes).
__device__ __noinline__ Drawn draw_whole(const Params& p, uint32_t key, unsigned bar, int step) {
  extern __shared__ __align__(16) float smem[];
  const SampleScratch ss = sample_scratch(smem, p);
  const int token = Net::draw_filtered(p, key, ss, bar, step);
  const bool logprobs = p.lp_out && Net::speaks(p);  // TP: rank 0 has gathered the raw logits
  if (logprobs) write_logprobs(p, ss, bar, p.raw_logits, MK_V_ALL, step, token);
  // TP: CTA 0's cancel bit from rank 0; logprobs: CTA 0's record, before the token word.
  if (MK_TP > 1 || logprobs) grid_barrier(p.barrier, bar);
  return {token, bar};
}

// A pass's draws: each position's best over the CTAs' words, as a step's, into c.ss.misc[q]
// (every thread may read them on return). Returns whether the host asked to stop. Every word
// is in (acquired) on return: this pass's KV appends are visible to the next window copies.
__device__ __forceinline__ bool sample_pass(const Params& p, Cta& c, const Step& s) {
  const int n = s.count;
  bool cancel_seen = false;
  for (int q = 0; q < n; ++q) {
    float b = -INFINITY;
    int bi = 0x7fffffff;
    for (int cta = c.t; cta < (int)gridDim.x; cta += kThreads) {
      const unsigned long long w = wait_token_word(token_words(p) + q * gridDim.x, cta, s.index);
      const float sc = token_word_score(w);
      const int i = token_word_id(w);
      cancel_seen |= token_word_cancel(w);
      if (better(sc, i, b, bi)) { b = sc; bi = i; }
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
      c.ss.misc[q] = bi;
    }
  }
  return __syncthreads_or(cancel_seen);
}

__device__ __forceinline__ Sampled sample(const Params& p, Cta& c, const Step& s, uint32_t key) {
  int next;
  bool cancelled = false;  // the host's cancel word as the token words carried it
  if (c.filtered) {
    const Drawn d = draw_whole(p, key, c.bar, s.index);
    next = d.token;
    c.bar = d.bar;
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
  if (p.seen && blockIdx.x == 0 && c.t == 0) count_token(p, next);
  bool done = s.index + 1 == p.n_steps || Net::stop_asked(p, c.words, cancelled);
  done |= is_stop(p, next);
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
