// Stage E: the MLP's down projection plus the residual -> x [H], the next layer's input.
#pragma once
#include "cta.cuh"
#include "probes.cuh"

// E's first loads, issued by stage D ahead of its hand-off wait.
__device__ __forceinline__ void mlp_down_first(const Params&, Cta& c, const LayerWeights& lw) {
  issue_split_first<MK_I, MK_SPLIT_E>(c.preE, lw.wdown, MK_H, c.warp, c.lane);
}

__device__ __forceinline__ void mlp_down(const Params& p, Cta& c, const Step& s, const Layer& l) {
  load_vec<MK_I>(c.xs, flow_copy(p.act, MK_I), l.tag, false, p.eps, c.red);
  skew(p, s.index, l.index, kSkewMlpDownInput);
  gemv_split<MK_I, MK_SPLIT_E>(l.w.wdown, MK_H, c.xs, c.part(), c.warp, c.lane, c.preE,
                               [&](int r, float d) {
                                 Net::down_row(p, c.xres, l.red, l.tag, r, d);
                               });
  skew(p, s.index, l.index, kSkewMlpDownDone);
  // The next stage's first loads: the next layer's stage A (attn_norm_qkv_first) or, after
  // the last layer, the LM head's, into A's buffer. The row's address is read before the
  // arrival, off the way from the hand-off's barrier to the loads.
  const bool more = l.index + 1 < MK_L;
  const WeightFormat::Elem* next =
      more ? split_first<MK_H, kSplitA>(p.layers[l.index + 1].wqkv, kQkv, c.warp)
           : split_first<MK_H, kSplitF>(p.lm_head, MK_V, c.warp);
  hand_off(p, c, s, l, kMarkMlpDownWork, kMarkMlpDownWait, [&] {
    stage_gain<MK_H>(c.gn, more ? p.layers[l.index + 1].attn_gain : p.norm_gain);
    if (SF::KP == SA::KP || more)
      issue_first<WeightFormat, SA::KP, kBatch>(c.preA, next, c.lane);
    else
      issue_first<WeightFormat, SF::KP, kBatch>(c.preF(), next, c.lane);
  });
}
