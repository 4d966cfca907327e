// Stage C: the attention output projection -> delta [H] (the residual is added in D).
#pragma once
#include "cta.cuh"
#include "probes.cuh"
#include "stage_mlp_gate_up.cuh"

// C's first loads, issued by stage B ahead of its hand-off wait.
__device__ __forceinline__ void o_proj_first(const Params&, Cta& c, const LayerWeights& lw) {
  issue_split_first<MK_Q, kSplitO>(c.preC, lw.wo, MK_H, c.warp, c.lane, c.c_cta);
}

__device__ __forceinline__ void o_proj(const Params& p, Cta& c, const Step& s, const Layer& l) {
  // Head units' ranges merged here while they fit (attention_window.cuh), else already merged.
  if (attn_reader_merges(attn_plan(p, s.pos()))) {
    load_attn_merged(p, attn_plan(p, s.pos()).ns, l.tag, c.xs, c.att);
  } else {
    load_vec<MK_Q>(c.xs, flow_copy(p.attn_out, MK_Q), l.tag, false, p.eps, c.red);
  }
  skew(p, s.index, l.index, kSkewOProjInput);
  gemv_split<MK_Q, kSplitO>(
      l.w.wo, MK_H, c.xs, c.part(), c.warp, c.lane, c.preC,
      [&](int r, float d) { Net::o_proj_row(p, l.red, l.tag, r, d); }, c.c_cta,
      Net::o_proj_bias(l.w));
  skew(p, s.index, l.index, kSkewOProjDone);
  hand_off(p, c, s, l, kMarkOProjWork, kMarkOProjWait,
           [&] { mlp_gate_up_first(p, c, l.w); });
}
