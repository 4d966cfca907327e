// Stage E: the MLP's down projection plus the residual -> x [H], the next layer's input.
#pragma once
#include "cta.cuh"
#include "probes.cuh"

// E's first loads, issued by stage D ahead of its hand-off wait.
__device__ __forceinline__ void mlp_down_first(const Params&, Cta& c, const LayerWeights& lw) {
  issue_split_first<MK_I, MK_SPLIT_E>(c.preE, lw.wdown, MK_H, c.warp, c.lane);
}

// The hand-off to the next layer's stage A or, after the last layer, the LM head, issuing
// that stage's first loads (a template so that only the branch of this build's formats is
// compiled).
template <class WF, class HF>
__device__ __forceinline__ void mlp_down_hand_off(const Params& p, Cta& c, const Step& s,
                                                  const Layer& l) {
  const bool more = l.index + 1 < MK_L;
  // Where the head's rows are as long as A's slices in the same format, one path issues both.
  constexpr bool kOnePath = std::is_same_v<WF, HF> && SF::KP == SA::KP;
  if constexpr (std::is_same_v<typename WF::Load, typename HF::Load>) {
    using WE = const typename WF::Elem*;
    using HE = const typename HF::Elem*;
    const Matrix<WF> wa = p.layers[more ? l.index + 1 : l.index].wqkv;
    const Matrix<HF> wf = p.lm_head;
    const void* next = more ? (const void*)split_first<MK_H, kSplitQkv>(wa, kQkv, c.warp)
                            : (const void*)split_first<MK_H, kSplitF>(wf, MK_V, c.warp);
    hand_off(p, c, s, l, kMarkMlpDownWork, kMarkMlpDownWait, [&] {
      stage_gain<MK_H>(c.gn, more ? p.layers[l.index + 1].attn_gain : p.norm_gain);
      if (kOnePath || more)
        issue_slice_first<MK_H, kSplitQkv, WF>(c.preA(), static_cast<WE>(next), c.warp, c.lane);
      else
        issue_first<HF, SF::KP, kBatch>(c.preF(), static_cast<HE>(next), c.lane);
    });
  } else {
    // The formats' positions differ in type (int4.cuh): the next layer's rows, or the head's.
    const auto next_a =
        split_first<MK_H, kSplitQkv>(p.layers[more ? l.index + 1 : l.index].wqkv, kQkv, c.warp);
    const auto next_f = split_first<MK_H, kSplitF>(p.lm_head, MK_V, c.warp);
    hand_off(p, c, s, l, kMarkMlpDownWork, kMarkMlpDownWait, [&] {
      stage_gain<MK_H>(c.gn, more ? p.layers[l.index + 1].attn_gain : p.norm_gain);
      if (more) {
        issue_slice_first<MK_H, kSplitQkv, WF>(c.preA(), next_a, c.warp, c.lane);
      } else {
        // Into A's buffer's weight words (cta.cuh kSharedPreAF): no buffer of its own.
        typename HF::Load f[SF::Shape::B];
        issue_first<HF, SF::KP, kBatch>(f, next_f, c.lane);
#pragma unroll
        for (int i = 0; i < SF::Shape::B; ++i) weight_words(c.preAF[i]) = f[i];
      }
    });
  }
}

// A pass's stage E: each position's down projection plus its residual into its x.
__device__ __forceinline__ void mlp_down_pass(const Params& p, Cta& c, const Step& s,
                                              const Layer& l) {
  const int n = s.count;
  float one[MK_P];
  load_vec_pass<MK_I>(c.xs, flow_copy(p.act, MK_P * MK_I), l.tag, n, false, p.eps, c.red, one);
  skew(p, s.index, l.index, kSkewMlpDownInput);
  gemv_split_pass<MK_I, MK_SPLIT_E, MK_H>(
      l.w.wdown, MK_H, c.xs, MK_I, n, c.part(), c.warp, c.lane, c.preE,
      [&](int q, int r, float d) {
        st_flow_copies(p.x + q * MK_H + r, MK_P * MK_H, c.xres[q * MK_H + r] + d, l.tag);
      },
      (int)blockIdx.x, nullptr, one);
  skew(p, s.index, l.index, kSkewMlpDownDone);
  mlp_down_hand_off<QkvFormat, HeadFormat>(p, c, s, l);
}

// Stage E's GEMV with its input streamed warp by warp (cta.cuh kEStream): each warp fetches
// its own slice of act inside the GEMV, the late columns last (the probe's input point is
// then where the GEMV starts); else after the whole vector is in. A template, so that only a
// build where the stream applies compiles it.
template <bool kStreamed = kEStream>
__device__ __forceinline__ void mlp_down_gemv(const Params& p, Cta& c, const Step& s,
                                              const Layer& l) {
  const auto row = [&](int r, float d) { Net::down_row(p, c.xres, l.red, l.tag, r, d); };
  if constexpr (kStreamed) {
    skew(p, s.index, l.index, kSkewMlpDownInput);
    const auto act = [&] { return flow_copy(p.act, MK_I); };
    gemv_split<MK_I, MK_SPLIT_E>(l.w.wdown, MK_H, c.xs, c.part(), c.warp, c.lane, c.preE, row,
                                 (int)blockIdx.x, nullptr, 1.f,
                                 EInput<decltype(act)>{act, l.tag});
  } else {
    load_vec<MK_I>(c.xs, flow_copy(p.act, MK_I), l.tag, false, p.eps, c.red);
    skew(p, s.index, l.index, kSkewMlpDownInput);
    gemv_split<MK_I, MK_SPLIT_E>(l.w.wdown, MK_H, c.xs, c.part(), c.warp, c.lane, c.preE, row);
  }
}

__device__ __forceinline__ void mlp_down(const Params& p, Cta& c, const Step& s, const Layer& l) {
  if constexpr (MK_P > 1) {
    mlp_down_pass(p, c, s, l);
    return;
  }
  mlp_down_gemv(p, c, s, l);
  skew(p, s.index, l.index, kSkewMlpDownDone);
  // The next stage's first loads: the next layer's stage A (attn_norm_qkv_first) or, after
  // the last layer, the LM head's, into A's buffer. The row's address is read before the
  // arrival, off the way from the hand-off's barrier to the loads.
  mlp_down_hand_off<QkvFormat, HeadFormat>(p, c, s, l);
}
