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
  // Where the head's rows are as long as A's slices in the same format, one path issues both.
  constexpr bool kOnePath = std::is_same_v<WeightFormat, HeadFormat> && SF::KP == SA::KP;
  const void* next =
      more ? (const void*)split_first<MK_H, kSplitA>(p.layers[l.index + 1].wqkv, kQkv, c.warp)
           : (const void*)split_first<MK_H, kSplitF>(p.lm_head, MK_V, c.warp);
  hand_off(p, c, s, l, kMarkMlpDownWork, kMarkMlpDownWait, [&] {
    stage_gain<MK_H>(c.gn, more ? p.layers[l.index + 1].attn_gain : p.norm_gain);
    if (kOnePath || more)
      issue_first<WeightFormat, SA::KP, kBatch>(
          c.preA(), static_cast<const WeightFormat::Elem*>(next), c.lane);
    else
      issue_first<HeadFormat, SF::KP, kBatch>(
          c.preF(), static_cast<const HeadFormat::Elem*>(next), c.lane);
  });
}
