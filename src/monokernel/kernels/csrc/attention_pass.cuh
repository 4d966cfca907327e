// Stage B of a verify pass (MK_P > 1; docs/speculative.md): the attention of the pass's n
// queries at positions pos0 .. pos0 + n - 1, each planned as the step at its position plans
// it, on the same CTAs, so each query's output is the step's to the bit.
#pragma once
#include "attention.cuh"

static_assert(MK_P * MK_D / 2 <= kThreads && 2 * MK_P <= kWarps,
              "a pass's queries: a thread a rotated pair, a warp a normed head vector");

// Pair (i, i + HALF) of a rotated key (x[2], x[3]) and its value (x[4], x[5]) as bf16 into a
// K row and a V row (the window's or the cache's).
__device__ __forceinline__ void own_kv(bf16* k, bf16* v, int i, const float (&x)[6]) {
  constexpr int HALF = MK_D / 2;
  k[i] = __float2bfloat16(x[2]);
  k[i + HALF] = __float2bfloat16(x[3]);
  v[i] = __float2bfloat16(x[4]);
  v[i + HALF] = __float2bfloat16(x[5]);
}

// This CTA's copy of a unit (pass_copies) when the pass's queries keep pos0's plan a and
// their ranges lie in the window the prefetch filled (attention_window.cuh pass_window, with
// the pass's RoPE rows): the queries' q, k and v in one round trip, the pass's own keys and
// values into the window (and, copy 0, the cache) from registers, one barrier, then the
// scores and P·V of queries copy, copy + copies, ... over their ranges by the step's code
// (attend, attention_out). done[q]: query q's completion total (the caller advanced it).
__device__ void attention_queries(const Params& p, const LayerWeights& lw, int layer,
                                  const AttnPlan& a, int pos0, int n, int copy, int copies,
                                  const unsigned (&done)[MK_P], unsigned tag, float* sm,
                                  float* red, float* win) {
  const int t = threadIdx.x;
  constexpr int HALF = MK_D / 2;
  const int unit = (int)blockIdx.x % a.units;
  const int hq = unit / a.ns, split = unit % a.ns, kvh = hq / kGroup;
  const AttnRange w = pass_window(split, a.ns, pos0);
  const int stages = window_stages(w.nc);
  float* qs = sm;                // [MK_P, D] queries, normed, rotated, pre-scaled
  float* kn = qs + MK_P * MK_D;  // [MK_P, D] their keys, normed and rotated
  float* vn = kn + MK_P * MK_D;  // [MK_P, D] their values
  float* sc = vn + MK_P * MK_D;  // [THREADS] probabilities, then attend's partials
  const float* rope = win + MK_ATTN_CHUNK * MK_D;  // the pass's RoPE rows, with the window
  bf16* const kw = reinterpret_cast<bf16*>(win);
  bf16* const vw = kw + MK_ATTN_CHUNK * MK_D;
  // As a step's unit (attention_head), once.
  const bool appends = copy == 0 && hq % kGroup == 0 && split == 0;
  // Thread t < n HALF: query q's pairs (i, i + HALF) of q, k and v, rotated by q's RoPE row.
  const int q = t / HALF, i = t % HALF;
  float* const qq = qs + q * MK_D;
  float* const kq = kn + q * MK_D;
  float* const vq = vn + q * MK_D;
  // The window row the cache would give position pos0 + q, for the later queries that read it
  // (all but the last; < 0: before this unit's ranges).
  const int own = q < n - 1 ? pos0 + q - w.lo : -1;
  const bool own_row = own >= 0 && own < MK_ATTN_CHUNK;
  float c = 0.f, s = 0.f;
  for (int st = 0; st < stages; ++st) window_spin(win, st);
  if (q < n) {
    const float* row = p.qkv + q * kQkv;
    const float* pq = row + hq * MK_D;
    const float* pk = row + MK_Q + kvh * MK_D;
    const float* pv = row + MK_Q + MK_KV + kvh * MK_D;
    // All six words in flight at once, every stale one re-read in the same round.
    const float* src[6] = {pq + i, pq + i + HALF, pk + i, pk + i + HALF, pv + i, pv + i + HALF};
    unsigned u[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) u[j] = ld_flow_word(src[j]);
    c = rope[q * HALF + i];
    s = rope[MK_P * HALF + q * HALF + i];
    const unsigned tags[6] = {tag, tag, tag, tag, tag, tag};
    flow_settle(u, [&](int j) { return src[j]; }, tags);
    float x[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) x[j] = __uint_as_float(u[j] & ~MK_TAG_BITS);
#if !MK_QK_NORM
    const float scale = rsqrtf((float)MK_D);
    qq[i] = (x[0] * c - x[1] * s) * scale;
    qq[i + HALF] = (x[1] * c + x[0] * s) * scale;
    const float2 k = rope_pair(x[2], x[3], c, s);
    x[2] = k.x;
    x[3] = k.y;
    // The pass's own key and value, rounded to bf16 as the cache holds them: into the window
    // and the cache from registers, so the scores wait on one barrier, as a step's do.
    if (own_row) own_kv(kw + own * MK_D, vw + own * MK_D, i, x);
    if (appends) {
      const size_t at = kv_row(p, layer, kvh, pos0 + q);
      own_kv(p.k_cache + at, p.v_cache + at, i, x);
    }
#else
    qq[i] = x[0];
    qq[i + HALF] = x[1];
#endif
    kq[i] = x[2];
    kq[i + HALF] = x[3];
    vq[i] = x[4];
    vq[i + HALF] = x[5];
  }
  __syncthreads();
#if MK_QK_NORM
  {
    const int lane = t & 31, warp = t >> 5, h = warp >> 1;
    if (warp < 2 * n) {
      if (warp & 1) {
        head_rms(kn + h * MK_D, lw.k_norm, p.eps, lane);
      } else {
        head_rms(qs + h * MK_D, lw.q_norm, p.eps, lane);
      }
    }
  }
  __syncthreads();
  if (q < n) {
    const float2 k = rope_normed(qq, kq, i, c, s);
    const float x[6] = {0.f, 0.f, k.x, k.y, vq[i], vq[i + HALF]};
    if (own_row) own_kv(kw + own * MK_D, vw + own * MK_D, i, x);
    if (appends) {
      const size_t at = kv_row(p, layer, kvh, pos0 + q);
      own_kv(p.k_cache + at, p.v_cache + at, i, x);
    }
  }
  __syncthreads();
#endif
  skew(p, pos0 - p.start_pos, layer, kSkewAttentionQkvIn);
  if (t == 0)
    for (int st = 0; st < stages; ++st) window_done(win, st);
  const bool reader = attn_reader_merges(a);
  for (int j = copy; j < n; j += copies) {
    const int qp = pos0 + j;
    const AttnRange r = attn_range(split, a.ns, qp);
    const AttnStats st = attend(p, layer, qp, r.lo - w.lo, r.nc, r.hi - r.lo, reader,
                                qs + j * MK_D, kn + j * MK_D, vn + j * MK_D, sc, win);
    unsigned dj = done[0];  // done[j] by constant indices: the array stays in registers
#pragma unroll
    for (int k = 1; k < MK_P; ++k)
      if (j == k) dj = done[k];
    attention_out(p, a, hq, split, j, st, dj, tag, red, sc);
  }
}

// A pass's stage B. A draftless pass (one position) is the step's stage B. Where every query
// keeps pos0's plan and this unit's ranges for them fit the window, attention_queries on each
// copy of the unit that has a query; else (a pass across a plan's edge, or ranges that outgrow
// the window) each query as a step's unit, one after another, each later one filling its own
// window. Copies without a query wait out their fill (window_skip). Group units (long
// context) have no pass: the host keeps passes to head units.
__device__ __forceinline__ void attention_stage_pass(const Params& p, const LayerWeights& lw,
                                                     int layer, int pos0, int n,
                                                     unsigned (&done)[MK_P], unsigned tag,
                                                     float* sm, float* red, float* win) {
  const AttnPlan a = attn_plan(p, pos0);
  const int copies = pass_copies(a), copy = (int)blockIdx.x / a.units;
  if (n == 1) {  // a draftless pass: the step's own unit
    if (copy > 0 && copy < copies) window_skip(a, pos0, win);
    unsigned no_group = 0;  // never advanced: a pass has head units only
    attention_stage(p, lw, layer, pos0, done[0], no_group, tag, sm, red, win);
    return;
  }
  // q a constant in each unrolled iteration: done[] stays in registers (indexed at run time,
  // it and the CTA's state around it would live in local memory, and every shared-memory
  // pointer read back from there turns generic).
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    if (q >= n) break;
    const AttnPlan aq = attn_plan(p, pos0 + q);
    if (aq.group) __trap();  // the host keeps a pass to contexts head units cover
    if (aq.ns > 1 && !attn_reader_merges(aq)) done[q] += (unsigned)aq.ns;
  }
  if (attn_plan(p, pos0 + n - 1).ns == a.ns) {  // ns only grows with the position
    if (copy >= copies) return;
    const int split = (int)blockIdx.x % a.units % a.ns;
    const AttnRange first = attn_range(split, a.ns, pos0);
    const AttnRange last = attn_range(split, a.ns, pos0 + n - 1);
    // Every CTA of a unit decides alike: ranges depend on the split, not on the copy.
    if (last.lo + last.nc - first.lo <= MK_ATTN_CHUNK) {
      if (copy < n)
        attention_queries(p, lw, layer, a, pos0, n, copy, copies, done, tag, sm, red, win);
      else
        window_skip(a, pos0, win);
      return;
    }
  }
  if (copy > 0 && copy < copies) window_skip(a, pos0, win);
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    if (q >= n) break;
    const int qp = pos0 + q;
    const AttnPlan aq = attn_plan(p, qp);
    if ((int)blockIdx.x >= aq.units) continue;
    if (q) {
      __syncthreads();  // the last query's reads of the window are done
      attention_fill_query(p, layer, aq, qp, pos0, win);
    }
    attention_head(p, lw, layer, aq, qp, done[q], tag, sm, red, win, q, pos0);
  }
}
