// Stage B, group units: one KV head's whole query group (G = heads / kv_heads) over one
// position range of any length, with qk-norm, RoPE and the KV append of the new position
// fused in front. The range streams through the window's ring (attention_window.cuh): its
// first stages were filled a stage ahead; each stage, once read, is refilled by the copy
// engine with the range's next positions while the others are computed on, so HBM streams
// the cache while the SM works. Each cached key and value is read once for all G heads.
//
// Per ring stage of P positions:
// - scores [G, P]: CHP lanes share one key row, each converts its 16-byte chunk once and dots
//   it with that chunk of all G queries (padded rows in shared memory: conflict-free), then a
//   reduce-scatter butterfly leaves each head's sum in a pair of lanes (G - 1 + a few
//   shuffles instead of G per level); each warp posts its per-head maximum with one shared
//   atomic per head;
// - probabilities exp(s - m) with m the running maximum (every thread its own entries: no
//   per-head warp, no reduction);
// - P·V into fp32 accumulators held across stages, thread (position group, head, 16-byte
//   chunk), which also sums its probabilities: the exp-sum is reduced once, at the end.
#pragma once
#include "attention_window.cuh"


__device__ void attention_group(const Params& p, const LayerWeights& lw, int layer,
                                const AttnPlan& a, int pos, unsigned done, unsigned tag,
                                float* sm, float* red, float* win) {
  constexpr int G = kGroup, D = MK_D, CH = kAttnCh, HALF = D / 2;
  constexpr int S = kAttnStages, P = kAttnP;
  constexpr int NG = kThreads / (CH * G);  // P·V position groups
  static_assert(NG >= 1, "a query group's outputs must fit one pass of the CTA's threads");
  constexpr int CHP = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
  constexpr int PPP = kThreads / CHP;  // positions per score pass
  constexpr int GP = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : G <= 8 ? 8 : 16;  // G, power of 2
  constexpr bool SCATTER = GP <= CHP;
  constexpr int QW = 12;                 // floats per padded query chunk (8 used)
  constexpr int LP = (kThreads / CH + 3) / 4 * 4;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int kvh = blockIdx.x / a.ns, split = blockIdx.x % a.ns;
  const AttnRange r = attn_range(split, a.ns, pos);
  float* st_m = sm;                                    // [2, G] running max (by parity)
  int* cmax = reinterpret_cast<int*>(sm + 2 * G);      // [2, G] stage max, as ordered ints
  float* kn = sm + 4 * G;                              // [D] the new key (position pos)
  float* vn = kn + D;                                  // [D] the new value
  float* lpart = vn + D;                               // [NG, G] exp-sums per position group
  float* qs = lpart + LP;                              // [G, D] queries
  float* qp = qs + G * D;                              // [G, CH, QW] the same, padded rows
  float* sc = qp + G * CH * QW;                        // [G, P] scores, then probabilities
  float* part = qs;                                    // [NG, G, D] at the end
  const uint4* ks = reinterpret_cast<const uint4*>(win);
  const uint4* vs = ks + MK_ATTN_CHUNK * CH;
  const float* rope = win + MK_ATTN_CHUNK * D;

  for (int i = t; i < (G + 2) * D; i += kThreads) {
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
    cmax[t] = ord_key(-INFINITY);
  }
  window_spin(win, 0);  // RoPE row and the range's first positions
  __syncthreads();
  window_done(win, 0);
#if MK_QK_NORM
  for (int h = warp; h <= G; h += kWarps)
    head_rms(h < G ? qs + h * D : kn, h < G ? lw.q_norm : lw.k_norm, p.eps, lane);
  __syncthreads();
#endif
  const float scale = rsqrtf((float)D);
  for (int i = t; i < (G + 1) * HALF; i += kThreads) {
    const int h = i / HALF, j = i % HALF;
    const float c = rope[j], s = rope[MK_P * HALF + j];
    const float f = h < G ? scale : 1.f;
    const float* v = h < G ? qs + h * D : kn;
    const float v1 = v[j], v2 = v[j + HALF];
    const float o1 = (v1 * c - v2 * s) * f, o2 = (v2 * c + v1 * s) * f;
    if (h < G) {
      qp[(h * CH + j / 8) * QW + j % 8] = o1;
      qp[(h * CH + (j + HALF) / 8) * QW + (j + HALF) % 8] = o2;
    } else {
      kn[j] = o1;
      kn[j + HALF] = o2;
    }
  }
  __syncthreads();
  const bool has_pos = r.lo <= pos && pos < r.hi;
  if (has_pos) append_kv(p, layer, kvh, pos, kn, vn);  // the unit whose range ends at pos

  // Score lanes: k = this lane's chunk of a key row; after the butterfly it holds head hk's
  // sum (SCATTER) and, if it is the first lane of its pair, writes it.
  const int k = t % CHP, slot = t / CHP;
  int hk = 0;
#pragma unroll
  for (int lv = 0; (CHP >> (lv + 1)) >= 1; ++lv)
    if (SCATTER && (GP >> lv) > 1 && (k & (CHP >> (lv + 1)))) hk += (GP >> lv) / 2;
  const bool writer = SCATTER ? (k & (CHP / GP - 1)) == 0 && hk < G : k == 0;
  const float* qk = qp + k * QW;
  // Each score lane holds its chunk of every query of the group in registers for the whole
  // unit (8 G floats) instead of re-reading it from shared memory in every pass (most of a
  // ring stage's shared-memory traffic). Only where G <= 4: larger groups would spill.
  constexpr bool QREG = G <= 4;
  float4 qr[QREG ? 2 * G : 1];
#pragma unroll
  for (int h = 0; h < (QREG ? G : 0); ++h) {
    qr[2 * h] = k < CH ? *reinterpret_cast<const float4*>(qk + h * CH * QW) : float4{};
    qr[2 * h + 1] = k < CH ? *reinterpret_cast<const float4*>(qk + h * CH * QW + 4) : float4{};
  }

  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, lsum = 0.f;
  const int c = t % CH, hg = (t / CH) % G, g = t / (CH * G);
  const int nsub = (r.nc + P - 1) / P;
  int cur = 0;  // parity of st_m / cmax holding the running max before this stage
  for (int j = 0; j < nsub; ++j, cur ^= 1) {
    const int stage = j % S, row0 = stage * P, np = min(P, r.nc - j * P);
    if (j > 0) window_spin(win, stage);
    float wm = -INFINITY;  // SCATTER: this lane's head's max over the warp's positions
    float wmh[SCATTER ? 1 : G];
#pragma unroll
    for (int h = 0; h < (SCATTER ? 1 : G); ++h) wmh[h] = -INFINITY;
    for (int p0 = 0; p0 < np; p0 += PPP) {  // same trip count CTA-wide
      const int pp = p0 + slot;
      float d[GP];
#pragma unroll
      for (int h = 0; h < GP; ++h) d[h] = 0.f;
      if (k < CH && pp < np) {
        const uint4 u = ks[(row0 + pp) * CH + k];
        const float kf[8] = {bf_lo(u.x), bf_hi(u.x), bf_lo(u.y), bf_hi(u.y),
                             bf_lo(u.z), bf_hi(u.z), bf_lo(u.w), bf_hi(u.w)};
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float4 q0 = QREG ? qr[QREG ? 2 * h : 0]
                                 : *reinterpret_cast<const float4*>(qk + h * CH * QW);
          const float4 q1 = QREG ? qr[QREG ? 2 * h + 1 : 0]
                                 : *reinterpret_cast<const float4*>(qk + h * CH * QW + 4);
          float x = kf[0] * q0.x;
          x = fmaf(kf[1], q0.y, x);
          x = fmaf(kf[2], q0.z, x);
          x = fmaf(kf[3], q0.w, x);
          x = fmaf(kf[4], q1.x, x);
          x = fmaf(kf[5], q1.y, x);
          x = fmaf(kf[6], q1.z, x);
          d[h] = fmaf(kf[7], q1.w, x);
        }
      }
      if constexpr (SCATTER) {
        // Reduce-scatter: at each level a lane keeps half of its heads and receives its
        // partner's half of those, so the values per lane halve while the sums double.
#pragma unroll
        for (int lv = 0; (CHP >> (lv + 1)) >= 1; ++lv) {
          const int o = CHP >> (lv + 1), n = GP >> lv;
          const bool up = (k & o) != 0;
          if (n > 1) {
#pragma unroll
            for (int i = 0; i < n / 2; ++i) {
              const float send = up ? d[i] : d[i + n / 2];
              const float keep = up ? d[i + n / 2] : d[i];
              d[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
          } else {
            d[0] += __shfl_xor_sync(0xffffffffu, d[0], o);
          }
        }
        if (writer && pp < np) {
          sc[hk * P + pp] = d[0];
          wm = fmaxf(wm, d[0]);
        }
      } else {
#pragma unroll
        for (int o = CHP / 2; o > 0; o >>= 1)
#pragma unroll
          for (int h = 0; h < G; ++h) d[h] += __shfl_xor_sync(0xffffffffu, d[h], o);
        if (writer && pp < np) {
#pragma unroll
          for (int h = 0; h < G; ++h) {
            sc[h * P + pp] = d[h];
            wmh[h] = fmaxf(wmh[h], d[h]);
          }
        }
      }
    }
    // Each warp posts its per-head maxima (lanes of one head differ only in the slot bits).
    int* cm = cmax + cur * G;
    if constexpr (SCATTER) {
#pragma unroll
      for (int o = CHP; o < 32; o <<= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, o));
      if (writer && slot % (32 / CHP) == 0 && wm != -INFINITY) atomicMax(cm + hk, ord_key(wm));
    } else {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float w = wmh[h];
#pragma unroll
        for (int o = CHP; o < 32; o <<= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
        if (lane == 0 && w != -INFINITY) atomicMax(cm + h, ord_key(w));
      }
    }
    __syncthreads();
    if (j > 0) window_done(win, stage);
    // Probabilities against the new running max; G threads publish it for the next stage.
    for (int i = t; i < G * P; i += kThreads) {
      const int h = i / P, pp = i % P;
      const float mn = fmaxf(st_m[cur * G + h], ord_float(cm[h]));
      if (pp < np) sc[i] = expf(sc[i] - mn);
      if (pp == 0) {
        st_m[(cur ^ 1) * G + h] = mn;
        cmax[(cur ^ 1) * G + h] = ord_key(-INFINITY);
      }
    }
    __syncthreads();
    if (g < NG) {
      const float al = expf(st_m[cur * G + hg] - st_m[(cur ^ 1) * G + hg]);
      const float* w = sc + hg * P;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= al;
      lsum *= al;
#pragma unroll 4
      for (int pp = g; pp < np; pp += NG) {
        const float wp = w[pp];
        const uint4 u = vs[(row0 + pp) * CH + c];
        lsum += wp;
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
    for (int h = warp; h < G; h += kWarps) {
      float d = 0.f;
      for (int i = lane; i < D; i += 32) d = fmaf(qp[(h * CH + i / 8) * QW + i % 8], kn[i], d);
      d = warp_sum(d);
      if (lane == 0) {
        const float mn = fmaxf(st_m[cur * G + h], d);
        st_m[(cur ^ 1) * G + h] = mn;
        sc[h] = expf(d - mn);
      }
    }
    __syncthreads();
    if (g < NG) {
      const float al = expf(st_m[cur * G + hg] - st_m[(cur ^ 1) * G + hg]);
      const float pr = g == 0 ? sc[hg] : 0.f;
      lsum = fmaf(lsum, al, pr);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(pr, vn[8 * c + e], acc[e] * al);
    }
    cur ^= 1;
    __syncthreads();
  }
  if (g < NG) {
    float4* pp = reinterpret_cast<float4*>(part + (g * G + hg) * D + 8 * c);  // no conflicts
    pp[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    pp[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    if (c == 0) lpart[g * G + hg] = lsum;
  }
  __syncthreads();
  const int slot0 = (kvh * a.ns + split) * G;  // head h's partial: slot0 + h
  for (int i = t; i < G * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float o = 0.f;
    for (int gg = 0; gg < NG; ++gg) o += part[(gg * G + h) * D + d];
    if (a.ns == 1) {
      float l = 0.f;
      for (int gg = 0; gg < NG; ++gg) l += lpart[gg * G + h];
      st_flow_copies(p.attn_out + (size_t)(kvh * G + h) * D + d, MK_Q, o / l, tag);
    } else {
      p.attn[(size_t)(slot0 + h) * D + d] = o;
    }
  }
  if (a.ns > 1) {
    if (t < G) {
      float l = 0.f;
      for (int gg = 0; gg < NG; ++gg) l += lpart[gg * G + t];
      p.attn_ml[2 * (slot0 + t)] = r.nc > 0 || has_pos ? st_m[cur * G + t] : -INFINITY;
      p.attn_ml[2 * (slot0 + t) + 1] = l;
    }
    // Scratch for the merge: part, read above, is free after attn_finish's barrier.
    attn_finish(p, p.attn_count + MK_NH + kvh, done, G, a.ns, kvh * a.ns * G, G, 1, kvh * G,
                tag, red, part);
  }
  __syncthreads();
}
