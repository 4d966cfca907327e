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
// gate_up_rows_before_input). None in a tile format (its first batch: mlp_gate_up_first).
// (Templates over the layers' format WF so that only this build's branch is compiled.)
template <class WF = WeightFormat>
__device__ __forceinline__ void issue_pair_rows(Cta& c, const LayerWeights& lw, int from,
                                                int to) {
  if constexpr (!WF::kTiles) {
    const Matrix<WF>& wgu = lw.wgu;  // the same object: WF is WeightFormat
    if (from <= 0 && 0 < to)
      issue_row<MK_H, MK_BATCH2>(c.preG, wgu, 2 * clamp_row(c.gw, MK_I), c.lane);
    if (from <= 1 && 1 < to)
      issue_row<MK_H, MK_BATCH2>(c.preU, wgu, 2 * clamp_row(c.gw, MK_I) + 1, c.lane);
  }
}

// D's first loads, issued by stage C ahead of its hand-off wait: the norm's gain staged and
// the first MK_D_PRE rows of this warp's first pair (a tile format: its first tile's first
// batch; gemv_tiles.cuh).
template <class WF = WeightFormat>
__device__ __forceinline__ void mlp_gate_up_first(const Params&, Cta& c, const LayerWeights& lw) {
  stage_gain<MK_H>(c.gn, lw.ffn_gain);
  if constexpr (WF::kTiles) {
    const Matrix<WF>& wgu = lw.wgu;
    issue_split_first<MK_H, kSplitD, GateUpOrder>(c.preG, wgu, 2 * MK_I, c.warp, c.lane);
  } else {
    issue_pair_rows(c, lw, 0, MK_D_PRE);
  }
}

// The gate/up GEMV: silu(gate) * up into act, each times rd (the norm's deferred 1/rms). q:
// the position of a pass (its input at xd + q H, its output at act + q I).
template <class WF = WeightFormat>
__device__ __forceinline__ void gate_up_gemv(const Params& p, Cta& c, const Layer& l, float rd,
                                             int q = 0) {
  const Matrix<WF>& wgu = l.w.wgu;
  float* act = p.act + q * MK_I;
  if constexpr (WF::kTiles) {
    // A tile of 16 rows is 8 gate/up pairs (rows 2i, 2i + 1): one combining thread a pair.
    gemv_tiles<MK_H, kSplitD, GateUpOrder>(
        wgu, 2 * MK_I, c.xd + q * MK_H, c.att + kAttSums, c.part(), c.warp, c.lane, c.preG,
        [&](int tile, int i, float g, float u) {
          g *= rd;
          u *= rd;
          st_flow_copies(act + 8 * tile + i, MK_P * MK_I, g / (1.f + expf(-g)) * u, l.tag);
        },
        (int)blockIdx.x);
  } else {
    gemv_pairs<MK_H>(wgu, MK_I, c.gw, c.tw, c.xd + q * MK_H, c.lane, c.preG, c.preU,
                     [&](int r, float g, float u) {
                       g *= rd;
                       u *= rd;
                       if (c.lane == 0)
                         st_flow_copies(act + r, MK_P * MK_I, g / (1.f + expf(-g)) * u, l.tag);
                     });
  }
}

// The gate/up GEMV of a pass in a row format: each pair's rows streamed once for its n
// positions (gemv_pass.cuh).
template <class WF = WeightFormat>
__device__ __forceinline__ void gate_up_pass(const Params& p, Cta& c, const Layer& l,
                                             const float (&rd)[MK_P], int n) {
  const Matrix<WF>& wgu = l.w.wgu;
  gemv_pairs_pass<MK_H, MK_I>(wgu, MK_I, c.gw, c.tw, c.xd, MK_H, n, c.lane, c.preG, c.preU,
                        [&](int q, int r, float g, float u) {
                          const float s = pick(rd, q);
                          g *= s;
                          u *= s;
                          if (c.lane == 0)
                            st_flow_copies(p.act + q * MK_I + r, MK_P * MK_I,
                                           g / (1.f + expf(-g)) * u, l.tag);
                        });
}

// A tile format's later position: the first loads of D's tiles again (from L2).
template <class WF = WeightFormat>
__device__ __forceinline__ void gate_up_again(Cta& c, const LayerWeights& lw) {
  if constexpr (WF::kTiles) {
    const Matrix<WF>& wgu = lw.wgu;
    issue_split_first<MK_H, kSplitD, GateUpOrder>(c.preG, wgu, 2 * MK_I, c.warp, c.lane);
  }
}

// A pass's stage D: each position's residual and norm as a step's, then its gate/up GEMV.
__device__ __forceinline__ void mlp_gate_up_pass(const Params& p, Cta& c, const Step& s,
                                                 const Layer& l) {
  const int n = s.count;
  float ss[MK_P], rd[MK_P];
  load_flow_sum_pass<MK_H>(c.xres, flow_copy(p.x, MK_P * MK_H), l.tag_x, c.xs,
                           flow_copy(p.delta, MK_P * MK_H), l.tag, c.xd,
                           staged_gain(c.gn, l.w.ffn_gain), n, ss);
  norm_scales<MK_H>(ss, n, c.red, p.eps, rd);
  skew(p, s.index, l.index, kSkewMlpGateUpInput);
  issue_pair_rows(c, l.w, MK_D_PRE, 2);
  if constexpr (WeightFormat::kTiles) {
    for (int q = 0; q < n; ++q) {
      if (q) gate_up_again(c, l.w);
      gate_up_gemv(p, c, l, pick(rd, q), q);
    }
  } else {
    gate_up_pass(p, c, l, rd, n);
  }
  skew(p, s.index, l.index, kSkewMlpGateUpDone);
  hand_off(p, c, s, l, kMarkMlpGateUpWork, kMarkMlpGateUpWait, [&] {
    mlp_down_first(p, c, l.w);
    if (l.index + 1 < MK_L) attention_prefetch(p, l.index + 1, s.pos(), c.kvwin);
  });
}

__device__ __forceinline__ void mlp_gate_up(const Params& p, Cta& c, const Step& s,
                                            const Layer& l) {
  if constexpr (MK_P > 1) {
    mlp_gate_up_pass(p, c, s, l);
    return;
  }
  const float s2 = Net::mlp_residual(p, l.w, c.xs, c.xres, c.xd,
                                     staged_gain(c.gn, l.w.ffn_gain), l.red, l.tag, l.tag_x);
  issue_pair_rows(c, l.w, MK_D_PRE, 2);
  // The norm's 1/rms where it is deferred to the dot products.
  const float rd = Net::mlp_norm(p, s2, c.xres, c.xd, c.red, staged_gain(c.gn, l.w.ffn_gain));
  skew(p, s.index, l.index, kSkewMlpGateUpInput);
  gate_up_gemv(p, c, l, rd);
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
