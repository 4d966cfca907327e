// Stage A: the attention block's RMSNorm and the fused QKV projection -> qkv [Q + 2KV].
// Layer 0's input is the token's embedding; later layers' the residual stage E left in x.
#pragma once
#include "cta.cuh"
#include "probes.cuh"

// A's first loads, issued by the stage before it ahead of the hand-off wait: the norm's gain
// staged into shared memory and this warp's first QKV row slice.
__device__ __forceinline__ void attn_norm_qkv_first(const Params& p, Cta& c,
                                                    const LayerWeights& lw) {
  stage_gain<MK_H>(c.gn, lw.attn_gain);
  issue_split_first<MK_H, kSplitQkv>(c.preA(), lw.wqkv, kQkv, c.warp, c.lane);
}

// Layer 0's input: the token's embedding row times the norm's gain into xs (swizzled, a GEMV
// input) and the row kept as the residual (Net::keep_embedding: x, tag_x, or xres). Each
// thread takes whole 4-float chunks, the ones whose gain it staged (stage_gain), so it reads
// its gain without a barrier. Returns the norm's 1/rms, deferred to the dot products
// (norm_scale).
__device__ __forceinline__ float embed_norm(const Params& p, float* xs, float* xres, int tok,
                                            unsigned tag_x, const float* gain, float* red,
                                            int q = 0) {
  const bf16* row = p.embed + (size_t)tok * MK_H;
  const int so = swz_off(xs + 4 * threadIdx.x);  // the same for every chunk of this thread
  cp_async_wait_all();                           // this thread's staged gain chunks
  float ss = 0.f;
  for (int i = 4 * threadIdx.x; i < MK_H; i += 4 * kThreads) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + i);
    const float v[4] = {bf_lo(u.x), bf_hi(u.x), bf_lo(u.y), bf_hi(u.y)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      xs[i + so + k] = gain ? v[k] * gain[i + k] : v[k];
      ss += v[k] * v[k];
      Net::keep_embedding(p, xres, q, i + k, v[k], tag_x);
    }
  }
  return norm_scale<MK_H>(ss, red, p.eps);
}

// Stage A's marks and its hand-off. Stage B's first loads (the K/V window) went out a stage
// ahead: nothing to issue here.
__device__ __forceinline__ void attn_norm_qkv_end(const Params& p, Cta& c, const Step& s,
                                                  const Layer& l) {
  mark(p, s, l, kMarkAttnNormQkvWork);
  skew(p, s.index, l.index, kSkewAttnNormQkvDone);
  handoff_arrive(c.flow, p.barrier, c.bar);
  handoff_wait(c.flow, p.barrier, c.bar);
  mark(p, s, l, kMarkAttnNormQkvWait);
}

// A pass's stage A: each position's embedding or residual, normed as a step norms it, and
// the QKV projection of each into its position's qkv vector (gemv_pass.cuh).
__device__ __forceinline__ void attn_norm_qkv_pass(const Params& p, Cta& c, const Step& s,
                                                   const Layer& l) {
  const int n = s.count;
  float ra[MK_P];
  if (l.index == 0) {
#pragma unroll
    for (int q = 0; q < MK_P; ++q) {
      ra[q] = 1.f;
      if (q < n) {
        if (q) __syncthreads();  // norm_scale's sums in red, read by every thread
        ra[q] = embed_norm(p, c.xs + q * MK_H, c.xres, s.input(p, q), l.tag_x,
                           staged_gain(c.gn, l.w.attn_gain), c.red, q);
      }
    }
  } else {
    load_vec_pass<MK_H>(c.xs, flow_copy(p.x, MK_P * MK_H), l.tag_x, n, true, p.eps, c.red, ra,
                        staged_gain(c.gn, l.w.attn_gain));
  }
  skew(p, s.index, l.index, kSkewAttnNormQkvInput);
  gemv_split_pass<MK_H, kSplitQkv, kQkv>(
      l.w.wqkv, kQkv, c.xs, MK_H, n, c.part(), c.warp, c.lane, c.preA(),
      [&](int q, int r, float d) { st_flow(p.qkv + q * kQkv + r, d, l.tag); }, (int)blockIdx.x,
      MK_QKV_BIAS ? l.w.bqkv : nullptr, ra);
  attn_norm_qkv_end(p, c, s, l);
}

__device__ __forceinline__ void attn_norm_qkv(const Params& p, Cta& c, const Step& s,
                                              const Layer& l) {
  if constexpr (MK_P > 1) {
    attn_norm_qkv_pass(p, c, s, l);
    return;
  }
  // The norm's 1/rms where it is deferred to the dot products.
  const float ra =
      l.index == 0
          ? embed_norm(p, c.xs, c.xres, s.input(p), l.tag_x, staged_gain(c.gn, l.w.attn_gain),
                       c.red)
          : Net::residual_input(p, c.xs, c.xres, c.xd, l.red, l.tag_x, c.red,
                                staged_gain(c.gn, l.w.attn_gain));
  skew(p, s.index, l.index, kSkewAttnNormQkvInput);
  gemv_split<MK_H, kSplitQkv>(
      l.w.wqkv, kQkv, c.xs, c.part(), c.warp, c.lane, c.preA(),
      [&](int r, float d) { st_flow(p.qkv + r, d, l.tag); }, (int)blockIdx.x,
      MK_QKV_BIAS ? l.w.bqkv : nullptr, ra);
  attn_norm_qkv_end(p, c, s, l);
}
