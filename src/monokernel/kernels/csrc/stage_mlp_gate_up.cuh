// Stage D: the residual (x + delta, kept in xres for E), the MLP's RMSNorm, the gate and up
// projections and SiLU(gate) * up -> act [I]. One warp a gate/up pair, both rows streaming
// together.
#pragma once
#include "cta.cuh"
#include "probes.cuh"
#include "stage_mlp_down.cuh"

// A valid row for a warp that has none: its early loads stay harmless, and every register
// buffer is written on every path (no values carried around the loops, no spills).
__device__ __forceinline__ size_t clamp_row(int r, int rows) {
  return (size_t)(r < rows ? r : rows - 1);
}

// Rows of this warp's first pair [from, to): 0 the gate row, 1 the up row. MK_D_PRE of them go
// out before the hand-off C -> D, the rest once D's input is in (build.py
// gate_up_rows_before_input).
__device__ __forceinline__ void issue_pair_rows(Cta& c, const LayerWeights& lw, int from,
                                                int to) {
  if (from <= 0 && 0 < to)
    issue_row<MK_H, MK_BATCH2>(c.preG, lw.wgu, 2 * clamp_row(c.gw, MK_I), c.lane);
  if (from <= 1 && 1 < to)
    issue_row<MK_H, MK_BATCH2>(c.preU, lw.wgu, 2 * clamp_row(c.gw, MK_I) + 1, c.lane);
}

// D's first loads, issued by stage C ahead of its hand-off wait: the norm's gain staged and
// the first MK_D_PRE rows of this warp's first pair.
__device__ __forceinline__ void mlp_gate_up_first(const Params&, Cta& c, const LayerWeights& lw) {
  stage_gain<MK_H>(c.gn, lw.ffn_gain);
  issue_pair_rows(c, lw, 0, MK_D_PRE);
}

__device__ __forceinline__ void mlp_gate_up(const Params& p, Cta& c, const Step& s,
                                            const Layer& l) {
  const float s2 = Net::mlp_residual(p, l.w, c.xs, c.xres, c.xd,
                                     staged_gain(c.gn, l.w.ffn_gain), l.red, l.tag, l.tag_x);
  issue_pair_rows(c, l.w, MK_D_PRE, 2);
  // The norm's 1/rms where it is deferred to the dot products.
  const float rd = Net::mlp_norm(p, s2, c.xres, c.xd, c.red, staged_gain(c.gn, l.w.ffn_gain));
  skew(p, s.index, l.index, kSkewMlpGateUpInput);
  gemv_pairs<MK_H>(l.w.wgu, MK_I, c.gw, c.tw, c.xd, c.lane, c.preG, c.preU,
                   [&](int r, float g, float u) {
                     g *= rd;
                     u *= rd;
                     if (c.lane == 0)
                       st_flow_copies(p.act + r, MK_I, g / (1.f + expf(-g)) * u, l.tag);
                   });
  skew(p, s.index, l.index, kSkewMlpGateUpDone);
  hand_off(p, c, s, l, kMarkMlpGateUpWork, kMarkMlpGateUpWait, [&] {
    mlp_down_first(p, c, l.w);
    // The next layer's cached keys and values (positions before pos, appended in earlier
    // steps, so ordered by the barrier that ends every step) are copied into the window now,
    // inside a long bandwidth-bound stage, so the copies' issue and flight stay off the
    // latency-bound A -> B path. Layer 0's copy waits for that barrier (after the LM head).
    if (l.index + 1 < MK_L) attention_prefetch(p, l.index + 1, s.pos(), c.kvwin);
  });
}
