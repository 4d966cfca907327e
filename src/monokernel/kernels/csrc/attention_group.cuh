// Stage B, group units: one KV head's whole query group (G = heads / kv_heads) over one
// position range of any length, with qk-norm, RoPE and the KV append of the new position
// fused in front. The range streams through the window's ring (attention_window.cuh): its
// first stages were filled a stage ahead; each stage, once read, is refilled by the copy
// engine with the range's next positions while the others are computed on, so HBM streams
// the cache while the SM works. Each cached key and value is read once for all G heads.
//
// Per ring stage of P positions: scores [G, P] (thread per (head, position), the key row read
// in an order rotated by the position, so a quarter-warp touches 8 distinct 16-byte bank
// groups), an online-softmax update per head (one warp a head), then P·V into fp32
// accumulators held across stages: thread (position group, head, 16-byte chunk).
#pragma once
#include "attention_window.cuh"

__device__ void attention_group(const Params& p, const LayerWeights& lw, int layer,
                                const AttnPlan& a, int pos, unsigned done, unsigned tag,
                                float* sm, float* red, float* win) {
  constexpr int G = MK_GROUP, D = MK_D, CH = MK_ATTN_CH, HALF = D / 2;
  constexpr int S = MK_ATTN_STAGES, P = MK_ATTN_P;
  constexpr int NG = MK_THREADS / (CH * G);  // P·V position groups
  static_assert(NG >= 1, "a query group's outputs must fit one pass of the CTA's threads");
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int kvh = blockIdx.x / a.ns, split = blockIdx.x % a.ns;
  const AttnRange r = attn_range(split, a.ns, pos);
  float* st_m = sm;              // [G] running max per head
  float* st_l = st_m + G;        // [G] running exp-sum
  float* st_a = st_l + G;        // [G] this stage's rescale of the accumulators
  float* kn = sm + 4 * G;        // [D] the new key (position pos)
  float* vn = kn + D;            // [D] the new value
  float* qs = vn + D;            // [G, D] queries, normed, rotated, pre-scaled
  float* sc = qs + G * D;        // [G, P] scores, then probabilities
  float* part = qs;              // [NG, G, D] after the last stage (reuses qs and sc)
  const uint4* ks = reinterpret_cast<const uint4*>(win);
  const uint4* vs = ks + MK_ATTN_CHUNK * CH;
  const float* rope = win + MK_ATTN_CHUNK * D;

  for (int i = t; i < (G + 2) * D; i += MK_THREADS) {
    const int h = i / D, d = i % D;
    if (h < G) {
      qs[i] = ld_flow(p.qkv + (kvh * G + h) * D + d, tag);
    } else if (h == G) {
      kn[d] = ld_flow(p.qkv + MK_Q + kvh * D + d, tag);
    } else {
      vn[d] = ld_flow(p.qkv + MK_Q + MK_KV + kvh * D + d, tag);
    }
  }
  if (t < G) {
    st_m[t] = -INFINITY;
    st_l[t] = 0.f;
  }
  window_spin(win, 0);  // RoPE row and the range's first positions
  __syncthreads();
  window_done(win, 0);
#if MK_QK_NORM
  for (int h = warp; h <= G; h += MK_WARPS)
    head_rms(h < G ? qs + h * D : kn, h < G ? lw.q_norm : lw.k_norm, p.eps, lane);
  __syncthreads();
#endif
  const float scale = rsqrtf((float)D);
  for (int i = t; i < (G + 1) * HALF; i += MK_THREADS) {
    const int h = i / HALF, j = i % HALF;
    const float c = rope[j], s = rope[HALF + j];
    float* v = h < G ? qs + h * D : kn;
    const float f = h < G ? scale : 1.f;
    const float v1 = v[j], v2 = v[j + HALF];
    v[j] = (v1 * c - v2 * s) * f;
    v[j + HALF] = (v2 * c + v1 * s) * f;
  }
  __syncthreads();
  const bool has_pos = r.lo <= pos && pos < r.hi;
  if (has_pos && t < D) {  // the one unit whose range ends at pos appends its key/value
    const size_t at = (((size_t)layer * MK_NKV + kvh) * p.max_len + pos) * D + t;
    p.k_cache[at] = __float2bfloat16(kn[t]);
    p.v_cache[at] = __float2bfloat16(vn[t]);
  }

  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int c = t % CH, hg = (t / CH) % G, g = t / (CH * G);
  const int nsub = (r.nc + P - 1) / P;
  for (int j = 0; j < nsub; ++j) {
    const int stage = j % S, row0 = stage * P, np = min(P, r.nc - j * P);
    if (j > 0) window_spin(win, stage);
    for (int i = t; i < G * P; i += MK_THREADS) {
      const int h = i / P, pp = i % P;
      if (pp < np) {
        const uint4* kr = ks + (row0 + pp) * CH;
        const float* qh = qs + h * D;
        float d = 0.f;
        int k = pp % CH;
        for (int n = 0; n < CH; ++n) {
          d += dot8(kr[k], qh, k);
          k = k + 1 == CH ? 0 : k + 1;
        }
        sc[i] = d;
      }
    }
    __syncthreads();
    if (j > 0) window_done(win, stage);
    for (int h = warp; h < G; h += MK_WARPS) {
      float* s = sc + h * P;
      float mx = -INFINITY;
      for (int i = lane; i < np; i += 32) mx = fmaxf(mx, s[i]);
      mx = warp_max(mx);
      const float mo = st_m[h], mn = fmaxf(mo, mx);
      float sum = 0.f;
      for (int i = lane; i < np; i += 32) {
        const float e = expf(s[i] - mn);
        s[i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float al = mo == -INFINITY ? 0.f : expf(mo - mn);
        st_a[h] = al;
        st_l[h] = st_l[h] * al + sum;
        st_m[h] = mn;
      }
    }
    __syncthreads();
    if (g < NG) {
      const float al = st_a[hg];
      const float* w = sc + hg * P;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= al;
#pragma unroll 1
      for (int pp = g; pp < np; pp += NG) {
        const float wp = w[pp];
        const uint4 u = vs[(row0 + pp) * CH + c];
        acc[0] = fmaf(wp, bf_lo(u.x), acc[0]); acc[1] = fmaf(wp, bf_hi(u.x), acc[1]);
        acc[2] = fmaf(wp, bf_lo(u.y), acc[2]); acc[3] = fmaf(wp, bf_hi(u.y), acc[3]);
        acc[4] = fmaf(wp, bf_lo(u.z), acc[4]); acc[5] = fmaf(wp, bf_hi(u.z), acc[5]);
        acc[6] = fmaf(wp, bf_lo(u.w), acc[6]); acc[7] = fmaf(wp, bf_hi(u.w), acc[7]);
      }
    }
    __syncthreads();  // the stage and sc are read: the stage may be refilled
    if (t == 0 && j + S < nsub) {
      fence_window();
      window_fill(p, layer, kvh, r.lo + (j + S) * P, min(P, r.nc - (j + S) * P), stage, -1, win);
    }
  }
  if (has_pos) {  // the new position, from the fp32 key and value
    for (int h = warp; h < G; h += MK_WARPS) {
      float d = 0.f;
      for (int k = lane; k < D; k += 32) d = fmaf(qs[h * D + k], kn[k], d);
      d = warp_sum(d);
      const float mo = st_m[h], mn = fmaxf(mo, d);
      __syncwarp();
      if (lane == 0) {
        const float al = mo == -INFINITY ? 0.f : expf(mo - mn), pr = expf(d - mn);
        st_a[h] = al;
        st_l[h] = st_l[h] * al + pr;
        st_m[h] = mn;
        sc[h] = pr;
      }
    }
    __syncthreads();
    if (g < NG) {
      const float al = st_a[hg], pr = g == 0 ? sc[hg] : 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(pr, vn[8 * c + e], acc[e] * al);
    }
    __syncthreads();
  }
  if (g < NG) {
#pragma unroll
    for (int e = 0; e < 8; ++e) part[(g * G + hg) * D + 8 * c + e] = acc[e];
  }
  __syncthreads();
  const int slot0 = (kvh * a.ns + split) * G;  // head h's partial: slot0 + h
  for (int i = t; i < G * D; i += MK_THREADS) {
    const int h = i / D, d = i % D;
    float o = 0.f;
    for (int gg = 0; gg < NG; ++gg) o += part[(gg * G + h) * D + d];
    if (a.ns == 1) {
      st_flow(p.attn_out + (size_t)(kvh * G + h) * D + d, o / st_l[h], tag);
    } else {
      p.attn[(size_t)(slot0 + h) * D + d] = o;
    }
  }
  if (a.ns > 1) {
    if (t < G) {
      p.attn_ml[2 * (slot0 + t)] = st_m[t];
      p.attn_ml[2 * (slot0 + t) + 1] = st_l[t];
    }
    // Scratch for the merge: part, read above, is free after attn_finish's barrier.
    attn_finish(p, p.attn_count + MK_NH + kvh, done, G, a.ns, kvh * a.ns * G, G, 1, kvh * G,
                tag, red, part);
  }
  __syncthreads();
}
