// Decode attention of one query head over positions [0, pos], with qk-norm, RoPE and the
// KV append of the new position fused in front. One CTA per query head; positions are
// swept in chunks of MK_THREADS with an online softmax, so any cache length fits.
#pragma once
#include "params.cuh"

// P·V sweep: thread (g, c) owns 16-byte chunk c of the value rows of positions g, g+GV, ...
#define MK_ATTN_CH (MK_D / 8)
#define MK_ATTN_GV (MK_THREADS / MK_ATTN_CH)
// Shared scratch this stage needs, in floats: q, k, v [3*D] | probs [THREADS] |
// per-group partial outputs [GV * D] (<= 8 * THREADS).
#define MK_ATTN_SMEM (3 * MK_D + MK_THREADS + MK_ATTN_GV * MK_D)

__device__ __forceinline__ void head_rms(float* v, const float* gain, float eps, int warp_id,
                                         int lane) {
  // One warp normalises one head vector in place (fp32 throughout).
  float ss = 0.f;
  for (int j = lane; j < MK_D; j += 32) ss += v[j] * v[j];
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / MK_D + eps);
  for (int j = lane; j < MK_D; j += 32) v[j] = v[j] * r * gain[j];
  (void)warp_id;
}

// Query head hq over positions [lo, hi) of [0, pos]: writes the unnormalised output
// sum_i exp(s_i - m) v_i and (m, l = sum_i exp(s_i - m)) for stage C to merge across ranges.
// gen: how many times this head's ranges have completed before, plus one (step * L + layer
// + 1); the unit that finishes a head's last range merges them into attn_out.
__device__ void attention_head(const Params& p, const LayerWeights& lw, int layer, int hq,
                               int split, int pos, unsigned gen, float* sm, float* red) {
  const int t = threadIdx.x;
  constexpr int HALF = MK_D / 2;
  constexpr int GROUP = MK_NH / MK_NKV;
  constexpr int CH = MK_ATTN_CH, GV = MK_ATTN_GV;
  const int kvh = hq / GROUP;
  float* qs = sm;                  // [D] query, normed, rotated, pre-scaled
  float* kn = qs + MK_D;           // [D] the new key (position pos)
  float* vn = kn + MK_D;           // [D] the new value
  float* sc = vn + MK_D;           // [THREADS] probabilities of one chunk
  float* part = sc + MK_THREADS;   // [GV, D] per-group partial outputs

  if (t < MK_D) {
    qs[t] = ld_act(p.qkv + hq * MK_D + t);
    kn[t] = ld_act(p.qkv + MK_Q + kvh * MK_D + t);
    vn[t] = ld_act(p.qkv + MK_Q + MK_KV + kvh * MK_D + t);
  }
  __syncthreads();
#if MK_QK_NORM
  const int lane = t & 31, warp = t >> 5;
  if (warp == 0) head_rms(qs, lw.q_norm, p.eps, warp, lane);
  if (warp == 1) head_rms(kn, lw.k_norm, p.eps, warp, lane);
  __syncthreads();
#endif
  if (t < HALF) {
    const float c = p.rope_cos[(size_t)pos * HALF + t], s = p.rope_sin[(size_t)pos * HALF + t];
    const float scale = rsqrtf((float)MK_D);
    const float q1 = qs[t], q2 = qs[t + HALF];
    qs[t] = (q1 * c - q2 * s) * scale;
    qs[t + HALF] = (q2 * c + q1 * s) * scale;
    const float k1 = kn[t], k2 = kn[t + HALF];
    kn[t] = k1 * c - k2 * s;
    kn[t + HALF] = k2 * c + k1 * s;
  }
  __syncthreads();
  const size_t head_base = ((size_t)layer * MK_NKV + kvh) * p.max_len * MK_D;
  const bf16* kc = p.k_cache + head_base;
  const bf16* vc = p.v_cache + head_base;
  // The first query head of each group appends the new key/value; the others use the
  // shared-memory copies for this position, so no CTA waits on another's write.
  const int len = (pos + p.attn_splits) / p.attn_splits;  // ceil((pos + 1) / splits)
  const int lo = split * len, hi = min(pos + 1, lo + len);
  if (hq % GROUP == 0 && split == 0 && t < MK_D) {
    p.k_cache[head_base + (size_t)pos * MK_D + t] = __float2bfloat16(kn[t]);
    p.v_cache[head_base + (size_t)pos * MK_D + t] = __float2bfloat16(vn[t]);
  }

  float m = -INFINITY, l = 0.f;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int c = t % CH, g = t / CH;
  for (int c0 = lo; c0 < hi; c0 += MK_THREADS) {
    const int pp = c0 + t;
    float s = -INFINITY;
    if (pp >= hi) {
    } else if (pp < pos) {
      const uint4* kr = reinterpret_cast<const uint4*>(kc + (size_t)pp * MK_D);
      float d = 0.f;
#pragma unroll 8
      for (int k = 0; k < CH; ++k) {
        const uint4 u = __ldcg(kr + k);
        const float* q8 = qs + 8 * k;
        d = fmaf(bf_lo(u.x), q8[0], d); d = fmaf(bf_hi(u.x), q8[1], d);
        d = fmaf(bf_lo(u.y), q8[2], d); d = fmaf(bf_hi(u.y), q8[3], d);
        d = fmaf(bf_lo(u.z), q8[4], d); d = fmaf(bf_hi(u.z), q8[5], d);
        d = fmaf(bf_lo(u.w), q8[6], d); d = fmaf(bf_hi(u.w), q8[7], d);
      }
      s = d;
    } else if (pp == pos) {
      float d = 0.f;
      for (int k = 0; k < MK_D; ++k) d = fmaf(kn[k], qs[k], d);
      s = d;
    }
    const float cm = block_max(s, red);
    const float nm = fmaxf(m, cm);
    const float alpha = (m == -INFINITY) ? 0.f : expf(m - nm);
    const float pr = (s == -INFINITY) ? 0.f : expf(s - nm);
    sc[t] = pr;
    const float ps = block_sum(pr, red);  // also orders sc[] writes before the reads below
    l = l * alpha + ps;
    m = nm;
    if (g < GV) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= alpha;
      const int last = min(hi - 1 - c0, MK_THREADS - 1);
#pragma unroll 4
      for (int i = g; i <= last; i += GV) {
        const int q = c0 + i;
        const float w = sc[i];
        if (q == pos) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = fmaf(w, vn[8 * c + e], acc[e]);
        } else {
          const uint4 u = __ldcg(reinterpret_cast<const uint4*>(vc + (size_t)q * MK_D) + c);
          acc[0] = fmaf(w, bf_lo(u.x), acc[0]); acc[1] = fmaf(w, bf_hi(u.x), acc[1]);
          acc[2] = fmaf(w, bf_lo(u.y), acc[2]); acc[3] = fmaf(w, bf_hi(u.y), acc[3]);
          acc[4] = fmaf(w, bf_lo(u.z), acc[4]); acc[5] = fmaf(w, bf_hi(u.z), acc[5]);
          acc[6] = fmaf(w, bf_lo(u.w), acc[6]); acc[7] = fmaf(w, bf_hi(u.w), acc[7]);
        }
      }
    }
    __syncthreads();
  }
  if (g < GV) {
#pragma unroll
    for (int e = 0; e < 8; ++e) part[g * MK_D + 8 * c + e] = acc[e];
  }
  __syncthreads();
  const size_t slot = (size_t)hq * p.attn_splits + split;
  if (t < MK_D) {
    float o = 0.f;
    for (int gg = 0; gg < GV; ++gg) o += part[gg * MK_D + t];
    p.attn[slot * MK_D + t] = o;
  }
  if (t == 0) {
    p.attn_ml[2 * slot] = m;
    p.attn_ml[2 * slot + 1] = l;
  }
  // The last range of this head to finish merges all of them (flash-decoding), in range
  // order whoever it is: deterministic. The counter only grows, so no reset can race.
  __syncthreads();
  if (t == 0) {
    __threadfence();
    const unsigned old = atomicAdd(p.attn_count + hq, 1u);
    red[32] = old + 1 == gen * (unsigned)p.attn_splits ? 1.f : 0.f;
    __threadfence();
  }
  __syncthreads();
  if (red[32] != 0.f) {
    const int ns = p.attn_splits;
    const float* ml = p.attn_ml + (size_t)hq * ns * 2;
    float* mls = sc;            // [2 * ns] (m, l) of every range, loaded in parallel
    float* coef = sc + 2 * ns;  // [ns]     (3 * ns <= THREADS: ns <= grid / heads)
    for (int q = t; q < 2 * ns; q += MK_THREADS) mls[q] = __ldcg(ml + q);
    __syncthreads();
    if (t == 0) {
      float mx = -INFINITY;
      for (int s2 = 0; s2 < ns; ++s2) mx = fmaxf(mx, mls[2 * s2]);
      float den = 0.f;
      for (int s2 = 0; s2 < ns; ++s2) {
        const float ms = mls[2 * s2];
        const float w = ms == -INFINITY ? 0.f : expf(ms - mx);
        coef[s2] = w;
        den = fmaf(w, mls[2 * s2 + 1], den);
      }
      for (int s2 = 0; s2 < ns; ++s2) coef[s2] /= den;
    }
    __syncthreads();
    if (t < MK_D) {
      const float* o = p.attn + (size_t)hq * ns * MK_D + t;
      float acc2 = 0.f;
#pragma unroll 4
      for (int s2 = 0; s2 < ns; ++s2) acc2 = fmaf(coef[s2], __ldcg(o + (size_t)s2 * MK_D), acc2);
      p.attn_out[hq * MK_D + t] = acc2;
    }
  }
  __syncthreads();
}

