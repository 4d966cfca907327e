// A pass build's loop (MK_P > 1; docs/speculative.md): each step a verify pass over `count`
// positions from pos, then the tokens it keeps.
//
// Teacher-forced (Params::forced): count = pass_len, every position's token is reported, and
// the next pass starts count positions on; n_steps counts passes.
// Drafting (Params::history): every CTA drafts the same tokens after the last one drawn
// (draft.cuh), the pass computes [last, drafts...], and the draws are kept while each equals
// the draft after it, plus the first that differs (or the one after the last draft): the
// tokens decoding step by step would draw, each drawn by the step's own rule at its position.
// n_steps counts tokens; the pass's rows of the KV cache past what it keeps are rewritten by
// the next pass before anything reads them. With Params::draft_exit the launch ends where
// passes stop paying (a pass costs more than a step: docs/speculative.md): before a pass with
// no draft (the first pass always runs, so every launch moves on) and after one that kept none
// of its draft; the host goes on by steps (runtime/backends/monokernel/drafted.py).
#pragma once
#include "draft.cuh"
#include "layers.cuh"
#include "stage_lm_head.cuh"
#include "stage_sample.cuh"

__device__ __forceinline__ void verify_passes(const Params& p, Cta& c) {
  const bool forced = p.forced != nullptr;
  // The pass's inputs (MK_P) and the draft's length after them; shared memory the LM head's
  // reduction does not reach (ss.h32's first kWarps words).
  int* in = reinterpret_cast<int*>(c.ss.h32 + 128);
  int token = p.first_token, pos = p.start_pos, emitted = 0;
  for (int step = 0; forced ? step < p.n_steps : emitted < p.n_steps; ++step) {
    int n = p.pass_len;
    if (!forced) {
      if (c.t == 0) in[0] = token;
      // Drafts only where their positions fit the cache (and a history to draft from).
      const int most = p.history ? max(0, min(MK_P - 1, p.max_len - 1 - pos)) : 0;
      n = 1;
      if (most > 0) n += draft_tokens(p, c, pos, most, in);
      __syncthreads();  // in[0] for every thread
      if (p.draft_exit && n == 1 && step > 0) {  // every CTA drafted the same: all leave
        if (c.host_cta && c.t == 0) {
          __threadfence_system();
          p.host_out[1] = 1;
        }
        break;
      }
    }
    const Step s{step, p.start_pos, token, n, pos, in};
    run_layers(p, c, s);
    lm_head_pass(p, c, s);
    const bool cancelled = sample_pass(p, c, s);
    const int* drawn = c.ss.misc;
    // Kept: every draw when forced; else the draws while each equals the draft after it and
    // the first that does not, within the budget and up to a stop id.
    int keep = n;
    bool done = cancelled;
    if (forced) {
      done |= step + 1 == p.n_steps;
    } else {
      keep = 1;
      while (keep < n && drawn[keep - 1] == in[keep]) ++keep;
      keep = min(keep, p.n_steps - emitted);
      for (int i = 0; i < keep; ++i) {
        if (is_stop(p, drawn[i])) {
          keep = i + 1;
          done = true;
          break;
        }
      }
      done |= emitted + keep >= p.n_steps || (p.draft_exit && keep == 1);
    }
    if (!done) attention_prefetch(p, 0, pos + keep, c.kvwin);
    if (c.t == 0 && p.history) {
      // Every CTA writes the same tokens: its own drafting reads them after its next barrier.
      for (int i = 0; i < keep; ++i) p.history[pos + 1 + i] = drawn[i];
    }
    if (c.host_cta && c.t == 0) {
      for (int i = 0; i < keep; ++i) p.host_out[kHostOutHead + emitted + i] = drawn[i] + 1;
      p.host_out[0] = emitted + keep;
      if (!forced) {
        p.flags[kFlagDrafted] += n - 1;
        p.flags[kFlagAccepted] += keep - 1;
        p.flags[kFlagVerified] += n > 1;
      }
      if (done) {
        __threadfence_system();
        p.host_out[1] = 1;
      }
    }
    mark(p, step, kMarkSampleWork);
    mark_ns(p, step, kMarkStepEndNs);
    token = drawn[keep - 1];
    pos += keep;
    emitted += keep;
    __syncthreads();  // drawn and in are rewritten by the next pass
    if (done) break;
  }
}
