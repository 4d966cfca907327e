// Stage B's plan and its shared-memory window: which CTA attends over which cached positions
// this step, and the ring the copy engine fills with those positions' keys and values.
//
// Two kinds of attention unit:
// - head units (attention.cuh): one query head over one position range that fits the window.
//   Most parallel at short context (heads x ranges CTAs, no GQA sharing needed: the group's
//   re-reads of a short range hit L2), and a range that fits is filled a whole stage ahead.
// - group units (attention_group.cuh): one KV head's whole query group over one range of any
//   length, streamed through the window in ring stages. Each cached key and value is read
//   from HBM once per step, not once per query head, and kv_heads x ranges can cover every
//   SM: what long context needs.
// The plan is a pure function of the position and the launch's parameters, so every CTA
// derives the same one, and the prefetch a stage ahead fills exactly what the unit will read.
#pragma once
#include "flow.cuh"
#include "gemv.cuh"
#include "layout.cuh"

constexpr int kAttnP = MK_ATTN_CHUNK / kAttnStages;  // positions per ring stage
static_assert(MK_ATTN_CHUNK % 32 == 0 && MK_ATTN_CHUNK <= 512 && kAttnP <= kAttnPmax,
              "MK_ATTN_CHUNK must be a multiple of 32, at most 512");
// The window (layout.py WINDOW): K [CHUNK, D] bf16 | V [CHUNK, D] bf16 | RoPE cos, sin of the
// new position [D/2 + D/2] fp32 (a pass build's: of its MK_P positions, [MK_P D/2] each) |
// STAGES mbarriers (u64) | fills waited for per stage (u32; parity = the phase to wait on) |
// fills issued per stage (u32). Ring stage s is rows
// [s*P, (s+1)*P) of K and V.
//
// Head units' ranges at short context (MK_ATTN_RANGE, build.py attn_range): a head's positions
// go to several head units even where one range would fit the window, and stage C's input load
// merges them (load_attn_merged) while they fit its scratch (kMergeNs, layout.py). MK_ATTN_GROUP
// 0 (build.py's build without group units): a plan that needs group units traps.

// Slots of p.attn / p.attn_ml (the host's allocation): NH x the most ranges a head or a KV
// head's group can have; their copies (kFlowCopies) lie that many slots apart.
__device__ __forceinline__ size_t attn_slots(const Params& p) {
  return (size_t)MK_NH * (size_t)max(p.attn_splits, p.attn_group_splits);
}

struct AttnPlan {
  bool group;  // group units (else head units)
  int ns;      // position ranges per head (head units) or per KV head (group units)
  int units;   // CTAs with a unit: blockIdx.x < units; never more than the grid
};

// Head units while every range fits the window and heads x ranges fit the grid
// (p.attn_splits = grid / heads, 0 when heads outnumber CTAs); else group units, ranges of at
// least MK_ATTN_MIN_RANGE positions (build.py attn_min_range) over at most grid / kv_heads
// CTAs per KV head. p.attn_group_from:
// the context length from which group units are used anyway (a knob for tests and tuning).
__device__ __forceinline__ AttnPlan attn_plan(const Params& p, int pos) {
  const int n = pos + 1;
  const int fit = (n + MK_ATTN_CHUNK - 1) / MK_ATTN_CHUNK;
  AttnPlan a;
  a.group = p.attn_splits == 0 || fit > p.attn_splits || n >= p.attn_group_from;
  if (a.group) {
    const int want = (n + MK_ATTN_MIN_RANGE - 1) / MK_ATTN_MIN_RANGE;
    a.ns = want < p.attn_group_splits ? want : p.attn_group_splits;
    a.units = MK_NKV * a.ns;
  } else {
    a.ns = fit;
#if MK_ATTN_RANGE > 0
    const int want = cmin(cmin((n + MK_ATTN_RANGE - 1) / MK_ATTN_RANGE, kMergeNs),
                             p.attn_splits);
    a.ns = cmax(a.ns, want);
#endif
    a.units = MK_NH * a.ns;
  }
  return a;
}

// Whether stage C's input load merges this plan's ranges (else they arrive merged).
__device__ __forceinline__ bool attn_reader_merges(const AttnPlan& a) {
  return !a.group && a.ns > 1 && a.ns <= kMergeNs;
}

// Where query q of a pass keeps its ranges' partials in p.attn and p.attn_ml (a step's at 0):
// the regions hold MK_P queries' slots, whichever of the two merges a query's plan takes (the
// reader merge's tagged [slots, 4] statistics, or the last unit's [slots, 2]).
__device__ __forceinline__ size_t attn_query_part(const Params& p, int q) {
  return MK_P == 1 ? 0 : (size_t)q * attn_slots(p) * MK_D;
}
__device__ __forceinline__ size_t attn_query_ml(const Params& p, int q) {
  return MK_P == 1 ? 0 : (size_t)q * attn_slots(p) * 4;
}

// Where head unit (hq, range s) leaves its partial for a reader merge: the unnormalised
// output [D] at p.attn + slot * D and (max, exp-sum, 0, 0) at p.attn_ml + 4 * slot, all
// tagged (flow.cuh); slot = s * NH + hq, so range s of every head is one contiguous vector.
__device__ __forceinline__ int attn_part_slot(int hq, int split) { return split * MK_NH + hq; }

// Stage C's input when head units left their ranges unmerged: xs[0..Q) <- the attention
// output (swizzled, a GEMV input: common.cuh), merged from ns partials (xs[s * Q ..]) and
// their statistics (st[4 * slot ..]), fetched in one round trip and combined in range order
// (deterministic). st: 4 * NH * ns floats of scratch. Each thread combines whole 8-float
// chunks, inside which the swizzle moves values, so the combine runs in place without a
// barrier inside it. Each combining thread also weighs its head's ranges itself (a few exps
// a thread) instead of one thread a head doing it for all behind one more barrier.
// q: the query of a pass (its partials lie q slots-worth into each copy).
__device__ __forceinline__ void load_attn_merged(const Params& p, int ns, unsigned tag,
                                                 float* xs, float* st, int q = 0) {
  const float* part = flow_copy(p.attn, MK_P * attn_slots(p) * MK_D) + attn_query_part(p, q);
  const float* stats = flow_copy(p.attn_ml, MK_P * attn_slots(p) * 4) + attn_query_ml(p, q);
  constexpr int NA = FlowChunks<kMergeNs * MK_Q>::N;
  constexpr int NB = FlowChunks<4 * kMergeNs * MK_NH>::N;
  flow_fetch<NA, NB>(xs, part, tag, ns * MK_Q / 4, st, stats, tag, ns * MK_NH);
  __syncthreads();
  for (int c = threadIdx.x; c < MK_Q / 8; c += kThreads) {
    const int h = 8 * c / MK_D;  // D is a multiple of 8: a chunk lies in one head
    float mx = -INFINITY;
    for (int s = 0; s < ns; ++s) mx = fmaxf(mx, flow_untag(st[4 * attn_part_slot(h, s)]));
    float w[kMergeNs], den = 0.f;
#pragma unroll
    for (int s = 0; s < kMergeNs; ++s) {
      w[s] = 0.f;
      if (s < ns) {
        const float* e = st + 4 * attn_part_slot(h, s);
        const float m = flow_untag(e[0]);
        w[s] = m == -INFINITY ? 0.f : expf(m - mx);  // an empty range weighs nothing
        den = fmaf(w[s], flow_untag(e[1]), den);
      }
    }
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kMergeNs; ++s) {
      if (s < ns) {
        const float ws = w[s] / den;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = fmaf(ws, flow_untag(xs[s * MK_Q + 8 * c + e]), o[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) *swz(xs + 8 * c + e) = o[e];
  }
  __syncthreads();
}

// Range `split` of ns over positions [0, pos]: [lo, hi); its cached positions (all but pos)
// are [lo, lo + nc). A range may be empty (lo == hi == pos + 1) when ns is large for n.
struct AttnRange {
  int lo, hi, nc;
};

__device__ __forceinline__ AttnRange attn_range(int split, int ns, int pos) {
  const int len = (pos + ns) / ns;  // ceil((pos + 1) / ns)
  AttnRange r;
  r.lo = min(split * len, pos + 1);
  r.hi = min(pos + 1, r.lo + len);
  r.nc = max(0, min(r.hi, pos) - r.lo);
  return r;
}

// The ring stages a window fill of `rows` cached positions takes (the first also brings the
// RoPE row, so at least one).
__device__ __forceinline__ int window_stages(int rows) {
  return max(1, min(kAttnStages, (rows + kAttnP - 1) / kAttnP));
}

// What a pass build's window holds for head-unit range `split` of ns at pos0, the pass's
// first position: the cached positions (those before pos0) of the union of that split's
// ranges for MK_P queries from pos0 under ns (attn_range moves lo and hi up with the
// position), at most a window of them. Every query of a pass that keeps pos0's plan reads
// its cached positions in there, so one fill a stage ahead serves all of them
// (attention_pass.cuh). lo: the union's first position; nc: the rows filled.
__device__ __forceinline__ AttnRange pass_window(int split, int ns, int pos0) {
  const AttnRange first = attn_range(split, ns, pos0);
  const AttnRange last = attn_range(split, ns, pos0 + MK_P - 1);
  AttnRange w;
  w.lo = first.lo;
  w.hi = max(first.lo, min(last.hi, pos0));
  w.nc = min(w.hi - w.lo, MK_ATTN_CHUNK);
  return w;
}

// A pass build's copies of each head unit: the plan's CTAs again on the CTAs it leaves idle
// (copy r of unit u is CTA r * units + u), at most one a position. Copy r attends the pass's
// queries r, r + copies, ... (attention_pass.cuh), so a pass's queries run side by side, not
// one after another on the unit. Each copy's window gets the unit's fill; it depends on the
// plan only, not on the pass's length, so the prefetch a stage ahead knows it.
__device__ __forceinline__ int pass_copies(const AttnPlan& a) {
  return MK_P == 1 || a.group ? 1 : cmin(MK_P, (int)gridDim.x / a.units);
}

// The KV head whose cache this CTA's unit reads, and the unit's range index.
__device__ __forceinline__ void attn_unit(const AttnPlan& a, int unit, int& kvh, int& split) {
  split = unit % a.ns;
  kvh = a.group ? unit / a.ns : (unit / a.ns) / kGroup;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned long long* window_mbar(float* win, int stage) {
  return reinterpret_cast<unsigned long long*>(win + MK_ATTN_CHUNK * MK_D + MK_P * MK_D) + stage;
}

__device__ __forceinline__ unsigned* window_waited(float* win) {
  return reinterpret_cast<unsigned*>(window_mbar(win, kAttnStages));
}

__device__ __forceinline__ unsigned* window_issued(float* win) {
  return window_waited(win) + kAttnStages;
}

// Once per launch, before the first fill.
__device__ __forceinline__ void attention_window_init(float* win) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kAttnStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(window_mbar(win, s)))
                   : "memory");
      window_waited(win)[s] = 0u;
      window_issued(win)[s] = 0u;
    }
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

// Element offset of position `pos`'s row of KV head `kvh` in `layer` of the cache
// [L, NKV, max_len, D].
__device__ __forceinline__ size_t kv_row(const Params& p, int layer, int kvh, int pos) {
  return (((size_t)layer * MK_NKV + kvh) * p.max_len + pos) * MK_D;
}

// Threads t < D store the new position's rotated key and value (fp32 in shared memory) into
// the cache as bf16.
__device__ __forceinline__ void append_kv(const Params& p, int layer, int kvh, int pos,
                                          const float* kn, const float* vn) {
  const int t = threadIdx.x;
  if (t < MK_D) {
    const size_t at = kv_row(p, layer, kvh, pos) + t;
    p.k_cache[at] = __float2bfloat16(kn[t]);
    p.v_cache[at] = __float2bfloat16(vn[t]);
  }
}

// One thread: copy the keys and values of `cnt` consecutive cached positions from `first`
// into ring stage `stage` (a range's positions are contiguous in the cache), plus the RoPE
// row of `rope_pos` when it is >= 0. The caller has ordered the stage's last ordinary reads
// before this (a __syncthreads, then fence_window).
__device__ __forceinline__ void window_fill(const Params& p, int layer, int kvh, int first,
                                            int cnt, int stage, int rope_pos, float* win) {
  const size_t row0 = kv_row(p, layer, kvh, first);
  // RoPE rows from rope_pos: a pass build's for each of its positions that the cache holds.
  const int rope_rows = rope_pos < 0 ? 0 : MK_P == 1 ? 1 : min(MK_P, p.max_len - rope_pos);
  const unsigned kv_bytes = (unsigned)cnt * MK_D * 2, rope_bytes = (unsigned)rope_rows * MK_D * 2;
  unsigned long long* mbar = window_mbar(win, stage);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(2 * kv_bytes + 2 * rope_bytes)
               : "memory");
  bf16* kw = reinterpret_cast<bf16*>(win) + (size_t)stage * kAttnP * MK_D;
  if (kv_bytes) {
    bulk_copy(kw, p.k_cache + row0, kv_bytes, mbar);
    bulk_copy(kw + MK_ATTN_CHUNK * MK_D, p.v_cache + row0, kv_bytes, mbar);
  }
  if (rope_bytes) {
    float* rope = win + MK_ATTN_CHUNK * MK_D;
    bulk_copy(rope, p.rope_cos + (size_t)rope_pos * (MK_D / 2), rope_bytes, mbar);
    bulk_copy(rope + MK_P * MK_D / 2, p.rope_sin + (size_t)rope_pos * (MK_D / 2), rope_bytes, mbar);
  }
  window_issued(win)[stage] += 1u;
}

// The window was last read through ordinary loads; order those before the copy engine's writes.
__device__ __forceinline__ void fence_window() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Start filling the window with the first stages of this CTA's unit in stage B of `layer` at
// `pos`, and the RoPE row of `pos` (with stage 0). Nothing here depends on the step's QKV
// projection, so it goes out a stage ahead (at stage D's hand-off, during the previous
// layer's down projection; for layer 0, after the barrier that ends the previous step, which orders that
// step's KV appends). Head units' ranges fit the window, so this fills all of them (a pass
// build's head units: their pass window, the union of their ranges for the pass's positions,
// and every position's RoPE row); group units stream the rest of their range through the
// ring themselves.
__device__ __forceinline__ void attention_prefetch(const Params& p, int layer, int pos,
                                                   float* win) {
  const AttnPlan a = attn_plan(p, pos);
  if ((int)blockIdx.x >= a.units * pass_copies(a) || threadIdx.x != 0) return;
  int kvh, split;
  attn_unit(a, MK_P == 1 ? (int)blockIdx.x : (int)blockIdx.x % a.units, kvh, split);
  AttnRange r = attn_range(split, a.ns, pos);
  if constexpr (MK_P > 1)
    if (!a.group) r = pass_window(split, a.ns, pos);
  fence_window();
  const int stages = window_stages(r.nc);
  for (int s = 0; s < stages; ++s) {
    const int cnt = max(0, min(kAttnP, r.nc - s * kAttnP));
    window_fill(p, layer, kvh, r.lo + s * kAttnP, cnt, s, s == 0 ? pos : -1, win);
  }
}

// A pass's query at qp > pos0 (the pass's first position) on this CTA's unit of plan a: its
// range's cached positions (those before pos0; the pass's own come from its qkv vectors,
// attention_head) and the RoPE row of qp, filled now and waited for by the unit, in as many
// ring stages as the unit spins on. After a __syncthreads that ends the window's last reads.
__device__ __forceinline__ void attention_fill_query(const Params& p, int layer,
                                                     const AttnPlan& a, int qp, int pos0,
                                                     float* win) {
  if (threadIdx.x != 0) return;
  int kvh, split;
  attn_unit(a, blockIdx.x, kvh, split);
  const AttnRange r = attn_range(split, a.ns, qp);
  const int cached = max(0, min(r.nc, pos0 - r.lo));
  fence_window();
  const int stages = window_stages(r.nc);
  for (int s = 0; s < stages; ++s) {
    const int cnt = max(0, min(kAttnP, cached - s * kAttnP));
    window_fill(p, layer, kvh, r.lo + s * kAttnP, cnt, s, s == 0 ? qp : -1, win);
  }
}

// Every thread spins until ring stage `stage`'s current fill has landed. The caller bumps
// the stage's waited count (window_done) after a __syncthreads that follows every thread's
// spin, so no thread reads a parity that has already moved on.
__device__ __forceinline__ void window_spin(float* win, int stage) {
  const unsigned parity = window_waited(win)[stage] & 1u;
  const unsigned mb = smem_addr(window_mbar(win, stage));
  unsigned ok = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(mb), "r"(parity)
        : "memory");
  } while (!ok);
}

__device__ __forceinline__ void window_done(float* win, int stage) {
  if (threadIdx.x == 0) window_waited(win)[stage] += 1u;
}

// A unit's copy whose prefetched fill (pass_copies) this pass leaves unread: waited for all
// the same, so the ring's parities stay in step with its fills.
__device__ __forceinline__ void window_skip(const AttnPlan& a, int pos0, float* win) {
  const int stages = window_stages(pass_window((int)blockIdx.x % a.units % a.ns, a.ns, pos0).nc);
  for (int s = 0; s < stages; ++s) window_spin(win, s);
  __syncthreads();
  for (int s = 0; s < stages; ++s) window_done(win, s);
}

// Before the CTA exits: fills issued for a step that never ran (the request stopped early)
// must land first.
__device__ __forceinline__ void attention_window_drain(float* win) {
  __syncthreads();
  for (int s = 0; s < kAttnStages; ++s) {
    if (window_waited(win)[s] != window_issued(win)[s]) window_spin(win, s);
  }
  __syncthreads();
}

// Partial results of ranges merged (flash-decoding) into attn_out, by the CTA that finished
// a head's (or a KV head's group's) last range, in range order whoever it is: deterministic.
// nh heads; the partial of head h, range s is slot base + s * ss + h * sh of p.attn [*, D] and
// p.attn_ml [*, 2] (max, exp-sum); outputs go to heads out0 .. out0 + nh - 1. scratch: nh * ns
// floats of shared memory nobody else uses now.
// q: the query of a pass whose output this is (attn_out + q Q, copies MK_P Q apart).
__device__ __forceinline__ void attn_merge(const Params& p, int nh, int ns, int base, int ss,
                                           int sh, int out0, unsigned tag, float* scratch,
                                           int q = 0) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const float* const part_q = p.attn + attn_query_part(p, q);
  const float* const ml_q = p.attn_ml + attn_query_ml(p, q);
  for (int h = warp; h < nh; h += kWarps) {
    float mx = -INFINITY;
    for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, __ldcg(ml_q + 2 * (base + s * ss + h * sh)));
    mx = warp_max(mx);
    float den = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float* ml = ml_q + 2 * (base + s * ss + h * sh);
      const float m = __ldcg(ml);
      const float w = m == -INFINITY ? 0.f : expf(m - mx);
      scratch[h * ns + s] = w;
      den = fmaf(w, __ldcg(ml + 1), den);
    }
    den = warp_sum(den);
    for (int s = lane; s < ns; s += 32) scratch[h * ns + s] /= den;
  }
  __syncthreads();
  for (int i = t; i < nh * MK_D; i += kThreads) {
    const int h = i / MK_D, d = i % MK_D;
    float acc = 0.f;
#pragma unroll 4
    for (int s = 0; s < ns; ++s)
      acc = fmaf(scratch[h * ns + s], __ldcg(part_q + (size_t)(base + s * ss + h * sh) * MK_D + d), acc);
    st_flow_copies(p.attn_out + q * MK_Q + (size_t)(out0 + h) * MK_D + d, MK_P * MK_Q, acc, tag);
  }
}

// After a unit wrote its partials: count it on `counter` (monotonic; `done` is the value the
// count reaches with this layer's last range) and, if it was the last, merge.
__device__ __forceinline__ void attn_finish(const Params& p, unsigned* counter, unsigned done,
                                            int nh, int ns, int base, int ss, int sh, int out0,
                                            unsigned tag, float* red, float* scratch, int q = 0) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned old = atomicAdd(counter, 1u);
    red[32] = old + 1 == done ? 1.f : 0.f;
    __threadfence();
  }
  __syncthreads();
  if (red[32] != 0.f) attn_merge(p, nh, ns, base, ss, sh, out0, tag, scratch, q);
}

// Floats as ints that order the same way (for shared-memory atomicMax), and back.
__device__ __forceinline__ int ord_key(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}

__device__ __forceinline__ float ord_float(int k) {
  return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff);
}

// RoPE of the pair (x1, x2) by (cos, sin): one expression wherever a key is rotated, so a
// pass's own keys (attention.cuh window_own_rows) are the step's to the bit.
__device__ __forceinline__ float2 rope_pair(float x1, float x2, float c, float s) {
  return make_float2(x1 * c - x2 * s, x2 * c + x1 * s);
}

// Pair (i, i + HALF) of a normed query (then pre-scaled for the scores) and of its key,
// rotated in place by (cos, sin): qk-norm's rotation, a step's and a pass's alike. Returns the
// key's pair.
__device__ __forceinline__ float2 rope_normed(float* q, float* k, int i, float c, float s) {
  constexpr int HALF = MK_D / 2;
  const float scale = rsqrtf((float)MK_D);
  const float q1 = q[i], q2 = q[i + HALF];
  q[i] = (q1 * c - q2 * s) * scale;
  q[i + HALF] = (q2 * c + q1 * s) * scale;
  const float2 r = rope_pair(k[i], k[i + HALF], c, s);
  k[i] = r.x;
  k[i + HALF] = r.y;
  return r;
}

__device__ __forceinline__ void head_rms(float* v, const float* gain, float eps, int lane) {
  // One warp normalises one head vector in place (fp32 throughout).
  float ss = 0.f;
  for (int j = lane; j < MK_D; j += 32) ss += v[j] * v[j];
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / MK_D + eps);
  for (int j = lane; j < MK_D; j += 32) v[j] = v[j] * r * gain[j];
}
