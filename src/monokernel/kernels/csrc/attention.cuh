// Decode attention of one query head over positions [0, pos], with qk-norm, RoPE and the
// KV append of the new position fused in front. One CTA per (query head, position range);
// positions are swept in chunks of MK_THREADS with an online softmax, so any cache length
// fits.
#pragma once
#include "flow.cuh"
#include "gemv.cuh"
#include "params.cuh"

// P·V sweep: thread (g, c) owns 16-byte chunk c of the value rows of positions g, g+GV, ...
#define MK_ATTN_CH (MK_D / 8)
#define MK_ATTN_GV (MK_THREADS / MK_ATTN_CH)
// Shared scratch this stage needs, in floats: q, k, v [3*D] | probs [THREADS] |
// per-group partial outputs [GV * D] (<= 8 * THREADS).
#define MK_ATTN_SMEM (3 * MK_D + MK_THREADS + MK_ATTN_GV * MK_D)
// Positions per range before the head is split further (flash-decoding), and the size of the
// shared-memory window that holds a range's cached keys and values. Ranges are sized to fit
// the window whenever the grid allows, so at short and medium context every cached key and
// value is read from shared memory, copied there a stage ahead (attention_prefetch). build.py
// passes the value it sized smem for.
#ifndef MK_ATTN_CHUNK
#define MK_ATTN_CHUNK ((152 * 1024 / (4 * MK_D)) / 32 * 32 < 512 ? (152 * 1024 / (4 * MK_D)) / 32 * 32 : 512)
#endif
// Window: K [CHUNK, D] bf16 | V [CHUNK, D] bf16 | RoPE cos, sin of the new position
// [D/2 + D/2] fp32 | the mbarrier the copies complete on (8 bytes) | fills waited for (its
// parity is the phase to wait on) | fills issued. In floats:
#define MK_KVWIN_FLOATS (MK_ATTN_CHUNK * MK_D + MK_D + 4)

// Ranges per head for a query at `pos`: ceil((pos + 1) / CHUNK), at most max_splits.
__device__ __forceinline__ int attn_ranges(int pos, int max_splits) {
  const int n = (pos + MK_ATTN_CHUNK) / MK_ATTN_CHUNK;
  return n < max_splits ? n : max_splits;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned long long* window_mbar(float* win) {
  return reinterpret_cast<unsigned long long*>(win + MK_ATTN_CHUNK * MK_D + MK_D);
}

// Once per launch, before the first attention_prefetch.
__device__ __forceinline__ void attention_window_init(float* win) {
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(window_mbar(win)))
                 : "memory");
    reinterpret_cast<unsigned*>(window_mbar(win) + 1)[0] = 0u;  // fills waited for
    reinterpret_cast<unsigned*>(window_mbar(win) + 1)[1] = 0u;  // fills issued
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// One 1-D bulk copy (the copy engine, no per-thread instructions) completing on `mbar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(mbar))
      : "memory");
}

// The unit this CTA runs first in stage B: its range of cached positions that lies in the
// window, [lo, lo + n).
struct AttnUnit {
  int hq, split, lo, hi, n;
};

__device__ __forceinline__ AttnUnit attn_unit(int u, int ns, int pos) {
  AttnUnit a;
  a.hq = u / ns;
  a.split = u % ns;
  const int len = (pos + ns) / ns;  // ceil((pos + 1) / ns)
  a.lo = a.split * len;
  a.hi = min(pos + 1, a.lo + len);
  a.n = max(0, min(min(a.hi, pos), a.lo + MK_ATTN_CHUNK) - a.lo);
  return a;
}

// Start copying this CTA's first unit's cached keys and values and the RoPE row of `pos` into
// the window. Nothing here depends on the step's QKV projection, so decode.cu issues it a
// stage ahead (during the previous layer's down projection; for layer 0, after the barrier
// that ends the previous step, which orders that step's KV appends). A range's positions are
// contiguous in the cache, so four bulk copies issued by one thread do it all: per-thread
// 16-byte copies cost the SM ~1.5 µs of issue a layer (docs/perf-notes.md, step 11).
// attention_head waits on the mbarrier.
__device__ __forceinline__ void attention_prefetch(const Params& p, int layer, int ns, int pos,
                                                   float* win) {
  constexpr int GROUP = MK_NH / MK_NKV;
  if ((int)blockIdx.x >= MK_NH * ns || threadIdx.x != 0) return;
  const AttnUnit a = attn_unit(blockIdx.x, ns, pos);
  const size_t head_base = ((size_t)layer * MK_NKV + a.hq / GROUP) * p.max_len * MK_D;
  const size_t first = head_base + (size_t)a.lo * MK_D;
  const unsigned kv_bytes = (unsigned)a.n * MK_D * 2, rope_bytes = MK_D * 2;  // D/2 floats
  unsigned long long* mbar = window_mbar(win);
  float* rope = win + MK_ATTN_CHUNK * MK_D;
  // The window was last read through ordinary loads; order those before the copy engine's
  // writes.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(2 * kv_bytes + 2 * rope_bytes)
               : "memory");
  if (kv_bytes) {
    bulk_copy(win, p.k_cache + first, kv_bytes, mbar);
    bulk_copy(win + MK_ATTN_CHUNK * MK_D / 2, p.v_cache + first, kv_bytes, mbar);
  }
  bulk_copy(rope, p.rope_cos + (size_t)pos * (MK_D / 2), rope_bytes, mbar);
  bulk_copy(rope + MK_D / 2, p.rope_sin + (size_t)pos * (MK_D / 2), rope_bytes, mbar);
  reinterpret_cast<unsigned*>(mbar + 1)[1] += 1u;
}

// Every thread waits for this CTA's window fill (issued by attention_prefetch).
__device__ __forceinline__ void attention_window_wait(float* win) {
  unsigned long long* mbar = window_mbar(win);
  unsigned* fills = reinterpret_cast<unsigned*>(mbar + 1);
  const unsigned parity = *fills & 1u;
  unsigned ok = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(smem_addr(mbar)), "r"(parity)
        : "memory");
  } while (!ok);
  __syncthreads();  // every thread has read `fills` before it moves on
  if (threadIdx.x == 0) *fills += 1u;
}

// Before the CTA exits: a fill issued for a step that never ran (the request stopped early)
// must land first.
__device__ __forceinline__ void attention_window_drain(float* win) {
  const unsigned* words = reinterpret_cast<const unsigned*>(window_mbar(win) + 1);
  __syncthreads();
  if (words[0] != words[1]) attention_window_wait(win);
}

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

// Query head hq over range `split` of the ns ranges of [0, pos]. One range: writes the
// normalised output to attn_out. Several: writes the unnormalised output
// sum_i exp(s_i - m) v_i and (m, l = sum_i exp(s_i - m)); the unit that finishes the head's
// last range merges them into attn_out. done: the value the head's completion counter
// reaches with this layer's ranges (every CTA tracks the same running total, so the counter
// is never reset).
__device__ void attention_head(const Params& p, const LayerWeights& lw, int layer, int unit, int ns,
                               int pos, unsigned done, unsigned tag, float* sm, float* red,
                               float* win) {
  const int t = threadIdx.x;
  constexpr int HALF = MK_D / 2;
  constexpr int GROUP = MK_NH / MK_NKV;
  constexpr int CH = MK_ATTN_CH, GV = MK_ATTN_GV;
  const AttnUnit a = attn_unit(unit, ns, pos);
  const int hq = a.hq, split = a.split, lo = a.lo, hi = a.hi;
  // Only the CTA's first unit has its window filled (units beyond the grid, when heads
  // outnumber CTAs, read everything from global memory).
  const int nwin = unit == (int)blockIdx.x ? a.n : 0;
  const int kvh = hq / GROUP;
  const uint4* ks = reinterpret_cast<const uint4*>(win);
  const uint4* vs = ks + MK_ATTN_CHUNK * CH;
  const float* rope = win + MK_ATTN_CHUNK * MK_D;
  float* qs = sm;                  // [D] query, normed, rotated, pre-scaled
  float* kn = qs + MK_D;           // [D] the new key (position pos)
  float* vn = kn + MK_D;           // [D] the new value
  float* sc = vn + MK_D;           // [THREADS] probabilities of one chunk
  float* part = sc + MK_THREADS;   // [GV, D] per-group partial outputs

  if (t < MK_D) {
    qs[t] = ld_flow(p.qkv + hq * MK_D + t, tag);
    kn[t] = ld_flow(p.qkv + MK_Q + kvh * MK_D + t, tag);
    vn[t] = ld_flow(p.qkv + MK_Q + MK_KV + kvh * MK_D + t, tag);
  }
  if (unit == (int)blockIdx.x) {
    attention_window_wait(win);  // includes the __syncthreads the q/k/v loads need
  } else {
    __syncthreads();
  }
#if MK_QK_NORM
  const int lane = t & 31, warp = t >> 5;
  if (warp == 0) head_rms(qs, lw.q_norm, p.eps, warp, lane);
  if (warp == 1) head_rms(kn, lw.k_norm, p.eps, warp, lane);
  __syncthreads();
#endif
  if (t < HALF) {
    float c, s;
    if (unit == (int)blockIdx.x) {
      c = rope[t];
      s = rope[HALF + t];
    } else {
      c = p.rope_cos[(size_t)pos * HALF + t];
      s = p.rope_sin[(size_t)pos * HALF + t];
    }
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
  if (hq % GROUP == 0 && split == 0 && t < MK_D) {
    p.k_cache[head_base + (size_t)pos * MK_D + t] = __float2bfloat16(kn[t]);
    p.v_cache[head_base + (size_t)pos * MK_D + t] = __float2bfloat16(vn[t]);
  }

  float m = -INFINITY, l = 0.f;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int c = t % CH, g = t / CH;
  // Keys in the window: a group of CHP lanes reads one key row (contiguous 16-byte chunks, so
  // no bank conflicts) and shuffle-reduces the dot product; positions past the window, the
  // new position and the padding are one thread per position below.
  constexpr int CHP = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
  constexpr int PPP = MK_THREADS / CHP;  // window positions per pass
  for (int c0 = lo; c0 < hi; c0 += MK_THREADS) {
    const int pp = c0 + t;
    const int wcnt = max(0, min(min(MK_THREADS, hi - c0), lo + nwin - c0));
    for (int pass = 0; pass < (wcnt + PPP - 1) / PPP; ++pass) {  // same trip count CTA-wide
      const int jj = pass * PPP + t / CHP, k = t % CHP;
      float d = 0.f;
      if (jj < wcnt && k < CH) d = dot8(ks[(c0 - lo + jj) * CH + k], qs, k);
#pragma unroll
      for (int o = CHP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (k == 0 && jj < wcnt) sc[jj] = d;
    }
    __syncthreads();
    float s = -INFINITY;
    if (t < wcnt) {
      s = sc[t];
    } else if (pp >= hi) {
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
          const uint4 u = q - lo < nwin
                              ? vs[(q - lo) * CH + c]
                              : __ldcg(reinterpret_cast<const uint4*>(vc + (size_t)q * MK_D) + c);
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
  if (ns == 1) {
    if (t < MK_D) {
      float o = 0.f;
      for (int gg = 0; gg < GV; ++gg) o += part[gg * MK_D + t];
      st_flow(p.attn_out + hq * MK_D + t, o / l, tag);
    }
    __syncthreads();
    return;
  }
  const size_t slot = (size_t)hq * ns + split;
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
    red[32] = old + 1 == done ? 1.f : 0.f;
    __threadfence();
  }
  __syncthreads();
  if (red[32] != 0.f) {
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
      st_flow(p.attn_out + hq * MK_D + t, acc2, tag);
    }
  }
  __syncthreads();
}

