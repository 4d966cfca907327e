// Stage B, head units: decode attention of one query head over one position range that fits
// the shared-memory window (attention_window.cuh), with qk-norm, RoPE and the KV append of
// the new position fused in front. The range's cached keys and values were copied into the
// window a stage ahead, so after the query arrives every read is from shared memory.
#pragma once
#include "attention_group.cuh"
#include "attention_window.cuh"
#include "probes.cuh"

// Query head hq over range `split` of a.ns. One range: writes the normalised output to
// attn_out. Several: writes the unnormalised output sum_i exp(s_i - m) v_i and (m, l =
// sum_i exp(s_i - m)), which stage C's input load merges (attn_reader_merges) or else the
// unit that finishes the head's last range. done: the value the head's completion counter
// reaches with this layer's ranges (every CTA tracks the same running total, so the counter
// is never reset).
// The keys of positions pos0 <= j < pos, a pass's own (q: this query's index in the pass),
// into the window rows the cache would have filled: each rotated (and normed) from its qkv
// vector exactly as the step at j appended it (attention_head), then rounded to bf16 as the
// cache holds it, so the scores are the step's to the bit. kf, vf: 2 D floats of scratch.
__device__ __forceinline__ void window_own_rows(const Params& p, const LayerWeights& lw,
                                                const AttnRange& r, int kvh, int pos0, int pos,
                                                unsigned tag, float* win, float* kf) {
  const int t = threadIdx.x;
  constexpr int HALF = MK_D / 2;
  float* vf = kf + MK_D;
  bf16* kw = reinterpret_cast<bf16*>(win);
  bf16* vw = kw + MK_ATTN_CHUNK * MK_D;
  for (int j = max(pos0, r.lo); j < min(pos, r.lo + r.nc); ++j) {
    const float* row = p.qkv + (j - pos0) * kQkv;
    if (t < MK_D) {
      kf[t] = ld_flow(row + MK_Q + kvh * MK_D + t, tag);
      vf[t] = ld_flow(row + MK_Q + MK_KV + kvh * MK_D + t, tag);
    }
    __syncthreads();
#if MK_QK_NORM
    if (t < 32) head_rms(kf, lw.k_norm, p.eps, t);
    __syncthreads();
#endif
    if (t < HALF) {
      const float c = p.rope_cos[(size_t)j * HALF + t], s = p.rope_sin[(size_t)j * HALF + t];
      const float2 k = rope_pair(kf[t], kf[t + HALF], c, s);
      const size_t at = (size_t)(j - r.lo) * MK_D + t;
      kw[at] = __float2bfloat16(k.x);
      kw[at + HALF] = __float2bfloat16(k.y);
      vw[at] = __float2bfloat16(vf[t]);
      vw[at + HALF] = __float2bfloat16(vf[t + HALF]);
    }
    __syncthreads();
  }
}

struct AttnStats {
  float m, l;  // the range's largest score and its sum of exp(score - m)
};

// Query qs (normed, rotated, pre-scaled) over the cnt positions of a range: window rows off ..
// off + nc - 1 (cached, or a pass's own), then, where nc < cnt, the new position's fp32 key kn
// and value vn. Each P·V group's partial output lands in part (sc + THREADS); returns the
// softmax statistics once every group's is in. sc: the head scratch from the probabilities on.
__device__ __forceinline__ AttnStats attend(const Params& p, int layer, int pos, int off,
                                            int nc, int cnt, bool reader, const float* qs,
                                            const float* kn, const float* vn, float* sc,
                                            const float* win) {
  const int t = threadIdx.x;
  constexpr int CH = kAttnCh, GV = kAttnGv;
  const uint4* ks = reinterpret_cast<const uint4*>(win) + off * CH;
  const uint4* vs = reinterpret_cast<const uint4*>(win) + MK_ATTN_CHUNK * CH + off * CH;
  float* part = sc + kThreads;     // [GV, D] per-group partial outputs
  float* smax = part + GV * MK_D;  // [WARPS] each warp's largest score
  float* lsum = smax + kWarps;     // [GV] each P·V group's sum of exp(score - max)
  // Scores: a group of CHP lanes reads one key row of the window (contiguous 16-byte chunks,
  // so no bank conflicts) and shuffle-reduces the dot product, U positions at a time
  // (independent chains: fewer dependent passes); the new position (jj == nc, when the
  // range ends at pos) is dotted the same way with the fp32 key. Lane k's chunk of the query
  // is the same in every pass: held in registers (read per pass, its strided 32-byte rows
  // would make the passes shared-memory bound).
  constexpr int CHP = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
  constexpr int PPP = kThreads / CHP;  // positions per pass and chain
  constexpr int U = kAttnU;           // chains
  {
    const int k = t % CHP;
    float mw = -INFINITY;  // this lane's largest score (every lane of a group holds its sums)
    float4 q0 = make_float4(0.f, 0.f, 0.f, 0.f), q1 = q0;
    if (k < CH) {
      q0 = reinterpret_cast<const float4*>(qs)[2 * k];
      q1 = reinterpret_cast<const float4*>(qs)[2 * k + 1];
    }
    for (int pass = 0; pass < (cnt + U * PPP - 1) / (U * PPP); ++pass) {  // same count CTA-wide
      float d[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jj = (pass * U + u) * PPP + t / CHP;
        d[u] = 0.f;
        if (k < CH) {
          if (jj < nc) {
            d[u] = dot_bf16x8(ks[jj * CH + k], q0, q1);
          } else if (jj < cnt) {
            const float4* kp = reinterpret_cast<const float4*>(kn) + 2 * k;
            const float4 k0 = kp[0], k1 = kp[1];
            d[u] = k0.x * q0.x + k0.y * q0.y + k0.z * q0.z + k0.w * q0.w + k1.x * q1.x +
                   k1.y * q1.y + k1.z * q1.z + k1.w * q1.w;
          }
        }
      }
#pragma unroll
      for (int o = CHP / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int u = 0; u < U; ++u) d[u] += __shfl_xor_sync(0xffffffffu, d[u], o);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jj = (pass * U + u) * PPP + t / CHP;
        if (jj < cnt) {
          if (k == 0) sc[jj] = d[u];
          mw = fmaxf(mw, d[u]);
        }
      }
    }
    for (int o = CHP; o < 32; o <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, o));
    if ((t & 31) == 0) smax[t >> 5] = mw;
  }
  __syncthreads();
  skew(p, pos - p.start_pos, layer, kSkewAttentionScores);
  // Softmax statistics. The max: the warps' maxima from the score passes, combined by every
  // thread in the same order after the barrier the scores need anyway. The exp-sum: each P·V
  // group sums the weights it uses, and the final combine adds the groups' sums with their
  // outputs. So no pass over the scores between the two barriers.
  float m = -INFINITY, l = 0.f;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, smax[w]);
  if (reader) m = flow_round(m);  // a reader merge weighs this range by the max as stored
  skew(p, pos - p.start_pos, layer, kSkewAttentionSoftmax);

  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int c = t % CH, g = t / CH;
  if (g < GV) {
    float lg = 0.f;
#pragma unroll 4
    for (int i = g; i < cnt; i += GV) {
      const float w = expf(sc[i] - m);
      lg += w;
      if (i == nc) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(w, vn[8 * c + e], acc[e]);
      } else {
        const uint4 u = vs[i * CH + c];
        acc[0] = fmaf(w, bf_lo(u.x), acc[0]); acc[1] = fmaf(w, bf_hi(u.x), acc[1]);
        acc[2] = fmaf(w, bf_lo(u.y), acc[2]); acc[3] = fmaf(w, bf_hi(u.y), acc[3]);
        acc[4] = fmaf(w, bf_lo(u.z), acc[4]); acc[5] = fmaf(w, bf_hi(u.z), acc[5]);
        acc[6] = fmaf(w, bf_lo(u.w), acc[6]); acc[7] = fmaf(w, bf_hi(u.w), acc[7]);
      }
    }
    // Two 16-byte stores (eight 4-byte ones at a 32-byte lane stride were 8-way bank conflicts).
    float4* pp = reinterpret_cast<float4*>(part + g * MK_D + 8 * c);
    pp[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    pp[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    if (c == 0) lsum[g] = lg;
  }
  __syncthreads();
  for (int gg = 0; gg < GV; ++gg) l += lsum[gg];
  return {m, l};
}

// A head unit's result for query q of a pass (0 in a step) over range `split` of plan a, from
// attend's statistics and partial outputs (sc + THREADS).
__device__ __forceinline__ void attention_out(const Params& p, const AttnPlan& a, int hq,
                                              int split, int q, const AttnStats& st,
                                              unsigned done, unsigned tag, float* red,
                                              float* sc) {
  const int t = threadIdx.x;
  constexpr int GV = kAttnGv;
  const float* part = sc + kThreads;
  const bool reader = attn_reader_merges(a);
  const float m = st.m, l = st.l;
  if (a.ns == 1) {
    if (t < MK_D) {
      float o = 0.f;
      for (int gg = 0; gg < GV; ++gg) o += part[gg * MK_D + t];
      st_flow_copies(p.attn_out + q * MK_Q + hq * MK_D + t, MK_P * MK_Q, o / l, tag);
    }
    __syncthreads();
    return;
  }
  if (reader) {  // stage C merges (load_attn_merged)
    const int slot = attn_part_slot(hq, split);
    if (t < MK_D) {
      float o = 0.f;
      for (int gg = 0; gg < GV; ++gg) o += part[gg * MK_D + t];
      st_flow_copies(p.attn + attn_query_part(p, q) + (size_t)slot * MK_D + t,
                     MK_P * attn_slots(p) * MK_D, o, tag);
    }
    if (t < 4) {
      const float v = t == 0 ? m : t == 1 ? l : 0.f;
      st_flow_copies(p.attn_ml + attn_query_ml(p, q) + 4 * slot + t, MK_P * attn_slots(p) * 4, v,
                     tag);
    }
    __syncthreads();
    return;
  }
  const int slot = hq * a.ns + split;
  float* const part_q = p.attn + attn_query_part(p, q);
  float* const ml_q = p.attn_ml + attn_query_ml(p, q);
  if (t < MK_D) {
    float o = 0.f;
    for (int gg = 0; gg < GV; ++gg) o += part[gg * MK_D + t];
    part_q[(size_t)slot * MK_D + t] = o;
  }
  if (t == 0) {
    ml_q[2 * slot] = m;
    ml_q[2 * slot + 1] = l;
  }
  attn_finish(p, p.attn_count + q * (MK_NH + MK_NKV) + hq, done, 1, a.ns, hq * a.ns, 1, 0, hq,
              tag, red, sc, q);
  __syncthreads();
}

// q, pos0: this query's index in a pass and the pass's first position (0 and pos in a step).
__device__ void attention_head(const Params& p, const LayerWeights& lw, int layer,
                               const AttnPlan& a, int pos, unsigned done, unsigned tag,
                               float* sm, float* red, float* win, int q = 0, int pos0 = 0) {
  if constexpr (MK_P == 1) q = 0;  // a step build: no offsets computed at run time
  const int t = threadIdx.x;
  constexpr int HALF = MK_D / 2;
  const int hq = blockIdx.x / a.ns, split = blockIdx.x % a.ns, kvh = hq / kGroup;
  const bool reader = attn_reader_merges(a);
  const AttnRange r = attn_range(split, a.ns, pos);
  const int cnt = r.hi - r.lo;  // <= CHUNK <= THREADS: one position per thread
  const float* rope = win + MK_ATTN_CHUNK * MK_D;
  float* qs = sm;         // [D] query, normed, rotated, pre-scaled
  float* kn = qs + MK_D;  // [D] the new key (position pos)
  float* vn = kn + MK_D;  // [D] the new value
  float* sc = vn + MK_D;  // [THREADS] probabilities, then attend's partials

  const float* pq = p.qkv + q * kQkv + hq * MK_D;
  const float* pk = p.qkv + q * kQkv + MK_Q + kvh * MK_D;
  const float* pv = p.qkv + q * kQkv + MK_Q + MK_KV + kvh * MK_D;
  // The ring stages filled for this query: by the prefetch (a pass's first query: its window,
  // attention_window.cuh pass_window) or by attention_fill_query.
  const int stages =
      MK_P > 1 && q == 0 ? window_stages(pass_window(split, a.ns, pos).nc) : window_stages(r.nc);
#if !MK_QK_NORM
  // Thread t < HALF fetches the pairs (t, t + HALF) of q, k and v (all six words in flight
  // at once: one round trip; the window, which holds the RoPE row, is in by then, filled a
  // stage ahead) and rotates them itself: one barrier before the scores instead of the two
  // a qk-norm needs.
  for (int s = 0; s < stages; ++s) window_spin(win, s);
  if (t < HALF) {
    // The six words settle together: every stale one re-read in the same round.
    const float* src[6] = {pq + t, pq + t + HALF, pk + t, pk + t + HALF, pv + t, pv + t + HALF};
    unsigned u[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) u[j] = ld_flow_word(src[j]);
    const float c = rope[t], s = rope[MK_P * HALF + t];
    const float scale = rsqrtf((float)MK_D);
    const unsigned tags[6] = {tag, tag, tag, tag, tag, tag};
    flow_settle(u, [&](int j) { return src[j]; }, tags);
    float w[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) w[j] = __uint_as_float(u[j] & ~MK_TAG_BITS);
    qs[t] = (w[0] * c - w[1] * s) * scale;
    qs[t + HALF] = (w[1] * c + w[0] * s) * scale;
    const float2 k = rope_pair(w[2], w[3], c, s);
    kn[t] = k.x;
    kn[t + HALF] = k.y;
    vn[t] = w[4];
    vn[t + HALF] = w[5];
  }
  __syncthreads();
  skew(p, pos - p.start_pos, layer, kSkewAttentionQkvIn);
  if (t == 0)
    for (int s = 0; s < stages; ++s) window_done(win, s);
  if constexpr (MK_P > 1) window_own_rows(p, lw, r, kvh, pos0, pos, tag, win, sc);
#else
  if (t < MK_D) {  // all three loads in flight before waiting for any: one round trip
    const float* src[3] = {pq + t, pk + t, pv + t};
    unsigned u[3] = {ld_flow_word(src[0]), ld_flow_word(src[1]), ld_flow_word(src[2])};
    const unsigned tags[3] = {tag, tag, tag};
    flow_settle(u, [&](int j) { return src[j]; }, tags);
    qs[t] = flow_untag(__uint_as_float(u[0]));
    kn[t] = flow_untag(__uint_as_float(u[1]));
    vn[t] = flow_untag(__uint_as_float(u[2]));
  }
  for (int s = 0; s < stages; ++s) window_spin(win, s);
  __syncthreads();
  skew(p, pos - p.start_pos, layer, kSkewAttentionQkvIn);
  if (t == 0)
    for (int s = 0; s < stages; ++s) window_done(win, s);
#if MK_QK_NORM
  const int lane = t & 31, warp = t >> 5;
  if (warp == 0) head_rms(qs, lw.q_norm, p.eps, lane);
  if (warp == 1) head_rms(kn, lw.k_norm, p.eps, lane);
  __syncthreads();
#endif
  if (t < HALF) rope_normed(qs, kn, t, rope[t], rope[MK_P * HALF + t]);
  __syncthreads();
  if constexpr (MK_P > 1) window_own_rows(p, lw, r, kvh, pos0, pos, tag, win, sc);
#endif
  // The first query head of each group appends the new key/value; the others use the
  // shared-memory copies for this position, so no CTA waits on another's write.
  if (hq % kGroup == 0 && split == 0) append_kv(p, layer, kvh, pos, kn, vn);

  const AttnStats st = attend(p, layer, pos, 0, r.nc, cnt, reader, qs, kn, vn, sc, win);
  attention_out(p, a, hq, split, q, st, done, tag, red, sc);
}

// Stage B for this CTA: its unit of this step's plan, if it has one. done_head / done_group:
// the running totals of the two kinds' completion counters, which every CTA (with a unit or
// not) advances alike by the ranges this layer adds.
__device__ __forceinline__ void attention_stage(const Params& p, const LayerWeights& lw,
                                                int layer, int pos, unsigned& done_head,
                                                unsigned& done_group, unsigned tag, float* sm,
                                                float* red, float* win) {
  const AttnPlan a = attn_plan(p, pos);
  // Only the ranges that count themselves (attn_finish) advance the totals: ranges that
  // stage C merges (attn_reader_merges) never touch the counters, so counting them too left
  // every later unit-merged range waiting for a total its head never reached (the Qwen2.5
  // 1.5B shape hung at position 1,601, where its head units go from 5 ranges to 6).
  if (a.ns > 1 && !attn_reader_merges(a)) (a.group ? done_group : done_head) += (unsigned)a.ns;
  if ((int)blockIdx.x >= a.units) return;
  if (a.group) {
#if MK_ATTN_GROUP
    attention_group(p, lw, layer, a, pos, done_group, tag, sm, red, win);
#else
    __trap();  // the host launched the build without group units for too long a context
#endif
  } else {
    attention_head(p, lw, layer, a, pos, done_head, tag, sm, red, win, 0, pos);
  }
}
