// Stage F: the final RMSNorm, the LM head, and this CTA's best (score, id) draw: the logits'
// argmax, or with a temperature their Gumbel-max (sampling.cuh), published for every CTA.
#pragma once
#include "cta.cuh"
#include "drawn_rows.cuh"
#include "probes.cuh"
#include "stage_attn_norm_qkv.cuh"

// The head's first batch: A's buffer itself where the loads are one type, else `own` (the
// weight words copied out of it).
template <bool kShared>
__device__ __forceinline__ HeadLoad (&head_first(Cta& c,
                                                 HeadLoad (&own)[SF::Shape::B]))[SF::Shape::B] {
  if constexpr (kShared)
    return c.preF();
  else
    return own;
}

// A pass's stage F: each position's final norm and LM head as a step's (the rows streamed once
// for all of them: gemv_pass.cuh), and this CTA's best draw of each, published as token word
// q * grid + cta (greedy or Gumbel-max only: the host keeps top-k / top-p, grammars,
// penalties and logprobs to steps).
__device__ __forceinline__ void lm_head_pass(const Params& p, Cta& c, const Step& s) {
  const int n = s.count;
  const bool cancel_early = c.host_cta && c.t == 0 && *p.host_cancel != 0;
  if (!c.words) __trap();
  float rf[MK_P];
  load_vec_pass<MK_H>(c.xs, flow_copy(p.x, MK_P * MK_H), flow_tag(s.index, MK_L - 1), n, true,
                      p.eps, c.red, rf, staged_gain(c.gn, p.norm_gain));
  uint32_t key[MK_P];
  float best[MK_P];
  int best_id[MK_P];
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    key[q] = draw_key(p.seed_lo, p.seed_hi, s.pos() + q + 1);  // position q's new token's
    best[q] = -INFINITY;
    best_id[q] = 0x7fffffff;
  }
  const int f_static = static_rows(MK_V, SF::GROUPS);
  const unsigned f_got = MK_F_DRAWN && c.lane == 0 ? draw_ticket(ticket_counter(p.barrier)) : 0u;
  auto out = [&](int q, int r, float logit) {
    if (p.debug_logits) p.debug_logits[((size_t)s.index * n + q) * MK_V + r] = logit;
    const int id = Net::token_id(p, r);
#pragma unroll
    for (int j = 0; j < MK_P; ++j) {
      if (j == q) {
        const float sc = c.greedy ? logit : logit / p.temperature + gumbel(key[j], id);
        if (better(sc, id, best[j], best_id[j])) { best[j] = sc; best_id[j] = id; }
      }
    }
  };
  HeadLoad own[SF::Shape::B];  // dead where kSharedPreAF
#pragma unroll
  for (int i = 0; i < SF::Shape::B; ++i) own[i] = weight_words(c.preAF[i]);
  gemv_split_pass<MK_H, kSplitF, 0, true>(p.lm_head, f_static, c.xs, MK_H, n, c.part(), c.warp,
                                       c.lane, head_first<kSharedPreAF>(c, own), out,
                                       (int)blockIdx.x, nullptr, rf);
  if (MK_F_DRAWN)
    gemv_drawn_pass<MK_H>(p.lm_head, row_tickets(p.barrier, f_static, MK_V, s.index), f_got,
                          c.xs, MK_H, n, c.lane, out, rf);
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    if (q < n) {
      float b = best[q];
      int bi = best_id[q];
      warp_argmax(b, bi);
      if (c.lane == 0) {
        c.red[c.warp] = b;
        c.ss.h32[c.warp] = (unsigned)bi;
      }
      __syncthreads();
      if (c.t == 0) {
        for (int w = 1; w < kWarps; ++w)
          if (better(c.red[w], (int)c.ss.h32[w], b, bi)) { b = c.red[w]; bi = (int)c.ss.h32[w]; }
        publish_token_word(token_words(p) + q * gridDim.x, b, bi, cancel_early, s.index);
      }
      __syncthreads();
    }
  }
  attn_norm_qkv_first(p, c, p.layers[0]);  // the next pass's
  mark(p, s.index, kMarkLmHeadWork);
  mark(p, s.index, kMarkLmHeadWait);
}

// Returns the step's draw key (sampling.cuh), which the sampler uses too.
__device__ __forceinline__ uint32_t lm_head(const Params& p, Cta& c, const Step& s) {
  // The host's cancel word: one PCIe round trip a token, read before the LM head and used
  // after it, so it hides behind the LM head.
  const bool cancel_early = c.host_cta && c.t == 0 && *p.host_cancel != 0;
  // The last layer's residual; the norm's 1/rms where it is deferred to the dot products.
  const float rf = Net::residual_input(p, c.xs, c.xres, c.xd, Net::reduce_tag(p, s.index + 1, 0),
                                       flow_tag(s.index, MK_L - 1), c.red,
                                       staged_gain(c.gn, p.norm_gain));
  // The penalties' counts: the previous token's, counted by a CTA whose later outputs this
  // one has read by now (sampling.cuh count_token), are visible past this fence.
  if (p.seen) __threadfence();
  const uint32_t key = draw_key(p.seed_lo, p.seed_hi, s.pos() + 1);  // the new token's position
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  // Whole rounds of rows dealt statically, the rest by tickets (drawn_rows.cuh); this warp's
  // first ticket is drawn now, so its round trip hides behind the static rows.
  const int f_static = static_rows(MK_V, SF::GROUPS);
  const unsigned f_got = MK_F_DRAWN && c.lane == 0 ? draw_ticket(ticket_counter(p.barrier)) : 0u;
  auto out = [&](int r, float logit) {
    if (p.debug_logits) p.debug_logits[(size_t)s.index * MK_V + r] = logit;
    const int id = Net::token_id(p, r);
    const float raw = logit;  // for logprobs: the model's own
    if (MK_TP == 1 && p.raw_logits) p.raw_logits[r] = raw;  // TP: rank 0 gathers them
    if (p.mask && !grammar_allows(p, s.index, id)) logit = -INFINITY;  // outside the grammar
    if (p.seen || p.logit_bias) logit = penalize(p, id, logit);
    p.logits[r] = logit;
    if (c.filtered) Net::share_logit(p, s.index, r, logit, raw);
    const float sc = c.greedy ? logit : logit / p.temperature + gumbel(key, id);
    if (better(sc, id, best, best_id)) { best = sc; best_id = id; }
  };
  // The rows alternate between two register buffers (PINGPONG): two rows in flight a warp.
  HeadLoad own[SF::Shape::B];  // dead where kSharedPreAF
#pragma unroll
  for (int i = 0; i < SF::Shape::B; ++i) own[i] = weight_words(c.preAF[i]);
  gemv_split<MK_H, kSplitF, true>(p.lm_head, f_static, c.xs, c.part(), c.warp, c.lane,
                                  head_first<kSharedPreAF>(c, own), out, (int)blockIdx.x,
                                  nullptr, rf);
  if (MK_F_DRAWN)
    gemv_drawn<MK_H>(p.lm_head, row_tickets(p.barrier, f_static, MK_V, s.index), f_got, c.xs,
                     c.lane, out, rf);
  warp_argmax(best, best_id);
  if (c.lane == 0) {
    c.red[c.warp] = best;
    c.ss.h32[c.warp] = (unsigned)best_id;
  }
  __syncthreads();
  if (c.t == 0) {
    float b = c.red[0];
    int bi = (int)c.ss.h32[0];
    for (int w = 1; w < kWarps; ++w)
      if (better(c.red[w], (int)c.ss.h32[w], b, bi)) { b = c.red[w]; bi = (int)c.ss.h32[w]; }
    if (c.words) {
      publish_token_word(token_words(p), b, bi, cancel_early, s.index);
    } else {
      p.part_score[blockIdx.x] = b;
      p.part_id[blockIdx.x] = bi;
      if (c.host_cta) p.flags[kFlagCancel] = cancel_early;
    }
  }
  if (!c.words) grid_arrive(p.barrier, c.bar);
  attn_norm_qkv_first(p, c, p.layers[0]);  // the next step's
  mark(p, s.index, kMarkLmHeadWork);
  if (!c.words) {
    grid_wait(p.barrier, c.bar);
    if (s.index + 1 < p.n_steps)  // every KV append of this step is visible now
      attention_prefetch(p, 0, s.pos() + 1, c.kvwin);
  }
  mark(p, s.index, kMarkLmHeadWait);
  return key;
}
