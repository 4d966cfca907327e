// Stage C: the attention output projection -> delta [H] (the residual is added in D).
#pragma once
#include "cta.cuh"
#include "probes.cuh"
#include "stage_mlp_gate_up.cuh"

// C's first loads, issued by stage B ahead of its hand-off wait.
__device__ __forceinline__ void o_proj_first(const Params&, Cta& c, const LayerWeights& lw) {
  issue_split_first<MK_Q, kSplitO>(c.preC, lw.wo, MK_H, c.warp, c.lane, c.c_cta);
}

// A pass's stage C: each query's attention output (merged here where its plan's ranges are,
// as a step's), then the O projection of each into its position's delta. A query's input
// takes its own round trip (the first waits; the rest are in by then).
__device__ __forceinline__ void o_proj_pass(const Params& p, Cta& c, const Step& s,
                                            const Layer& l) {
  const int n = s.count;
  for (int q = 0; q < n; ++q) {
    float* xq = c.xs + q * kXsFloats;  // the reader merge needs ns x Q floats of room
    const AttnPlan a = attn_plan(p, s.pos() + q);
    if (attn_reader_merges(a)) {
      load_attn_merged(p, a.ns, l.tag, xq, c.att, q);
    } else {
      load_vec<MK_Q>(xq, flow_copy(p.attn_out, MK_P * MK_Q) + q * MK_Q, l.tag, false, p.eps,
                     c.red);
    }
    __syncthreads();
  }
  skew(p, s.index, l.index, kSkewOProjInput);
  float ones[MK_P];
#pragma unroll
  for (int q = 0; q < MK_P; ++q) ones[q] = 1.f;
  gemv_split_pass<MK_Q, kSplitO, MK_H>(
      l.w.wo, MK_H, c.xs, kXsFloats, n, c.part(), c.warp, c.lane, c.preC,
      [&](int q, int r, float d) {
        st_flow_copies(p.delta + q * MK_H + r, MK_P * MK_H, d, l.tag);
      },
      c.c_cta, Net::o_proj_bias(l.w), ones);
  skew(p, s.index, l.index, kSkewOProjDone);
  hand_off(p, c, s, l, kMarkOProjWork, kMarkOProjWait,
           [&] { mlp_gate_up_first(p, c, l.w); });
}

__device__ __forceinline__ void o_proj(const Params& p, Cta& c, const Step& s, const Layer& l) {
  if constexpr (MK_P > 1) {
    o_proj_pass(p, c, s, l);
    return;
  }
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
