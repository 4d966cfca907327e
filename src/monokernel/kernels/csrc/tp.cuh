// Tensor parallelism inside the decode kernel (MK_TP > 1 only; docs/tensor-parallel.md).
//
// The residual's all-reduces are the single-GPU hand-offs (flow.cuh) spread over the ranks:
// the thread that finishes row r of a partial [H] output (O-proj, down) stores it as a
// tagged flow word straight into slot [my rank][r] of every copy in EVERY rank's receive
// buffer (its own included, where the other CTAs of this rank read it). A CTA fetches every
// rank's slot into shared memory in one round trip (flow_fetch: cp.async, nothing held in
// registers), re-fetching only the chunks still stale, then sums the slots in rank order
// 0..N-1: the same bits on every CTA of every GPU, which the ranks need to stay in lock step
// (a one-ulp difference could pick different tokens). The residual itself stays in each
// CTA's xres from stage A (or the embedding) to stage D, so D waits for nothing else.
//
// Generations are launch-local (reduce_tag: 1, 2, ...; 8 bits in the word), and the host
// zeroes every rank's reduction area before each launch (tp.py), as one GPU's hand-off
// buffers are: a slot holds 0 or the generation two before the one wanted, never the same
// tag. Two parities (generation & 1): a rank writes generation g+2 into a slot only after it
// has read generation g+1 from every rank; each rank sends g+1 only after every one of its
// CTAs finished reading g (each CTA reads g before it writes its rows of the next stage, and
// g+1 needs those rows: flow.cuh), so no slot is overwritten before it is read.
//
// The token exchange uses 32-bit tags that only grow (the host carries them across launches
// and never uses 0, the zeroed buffers' value), one 16-byte unit {score, tag, id*2 + cancel,
// tag} per rank and step: every rank picks the same winner (larger score, ties to the lower
// global id), and rank 0's cancel bit stops every rank at the same step.
//
// Top-k / top-p / min_p and logprobs need the whole distribution: each LM-head row's logit
// also goes, tagged, into every rank's copy of the whole vocabulary's logits (the step's
// parity), and every rank draws from all of them with the same exact rule (sampling.cuh): the
// same token on every GPU, which the token exchange then carries with rank 0's cancel bit.
// With logprobs the raw logits go to rank 0 as well, which alone writes the records.
#pragma once
#include "flow.cuh"
#include "layout.cuh"
#include "sampling.cuh"

// The two ways a layer's partial results become everyone's: Net is SingleGpu or, in a
// -DMK_TP=N build, TensorParallel (picked once, at the end of this file). The stages call Net
// only where the two differ: the residual's all-reduces after the O and down projections, the
// LM head's vocabulary slice, and the token exchange.

// One GPU: every CTA's rows go straight into the tagged hand-off vectors (flow.cuh).
struct SingleGpu {
  // top-k / top-p / min_p draw from the whole distribution (CTA 0, behind a grid barrier), as
  // do the steps whose logprobs are asked for.
  __device__ static __forceinline__ bool filtered(const Params& p, bool greedy) {
    return (!greedy && ((p.top_k > 0 && p.top_k < MK_V) || p.top_p < 1.f || p.min_p > 0.f)) ||
           p.lp_out;
  }
  // LM-head row r's logit where top-k / top-p draw: p.logits holds them all already (and
  // p.raw_logits the raw ones for logprobs).
  __device__ static __forceinline__ void share_logit(const Params&, int, int, float, float) {}
  // Every CTA, after the LM head's barrier: the top-k / top-p / min_p token.
  __device__ static __forceinline__ int draw_filtered(const Params& p, uint32_t key,
                                                      const SampleScratch& s, unsigned& bar,
                                                      int) {
    return sample_filtered(p, key, s, bar, p.logits, MK_V);
  }
  // After a top-k / top-p step's barrier: whether to stop for the host (stop_asked reads the
  // host CTA's flag itself).
  __device__ static __forceinline__ bool filtered_cancel(const Params&) { return false; }
  // The generation of a layer's first all-reduce: none here.
  __device__ static __forceinline__ unsigned reduce_tag(const Params&, int, int) { return 0u; }
  // Layer 0's residual, element i of position q's embedding: CTA 0 publishes it in x
  // (tag_x), where stage D reads it.
  __device__ static __forceinline__ void keep_embedding(const Params& p, float*, int q, int i,
                                                        float v, unsigned tag_x) {
    if (blockIdx.x == 0) st_flow_copies(p.x + q * MK_H + i, MK_P * MK_H, v, tag_x);
  }
  // xs <- the residual x after a down projection (tag_x), RMS-normalised, the 1/rms deferred
  // to the dot products: returns it. The input of stage A (after layer 0) and of the LM head.
  __device__ static __forceinline__ float residual_input(const Params& p, float* xs,
                                                         float*, float*, unsigned,
                                                         unsigned tag_x, float* red,
                                                         const float* gain) {
    return load_vec<MK_H>(xs, flow_copy(p.x, MK_H), tag_x, true, p.eps, red, gain);
  }
  // Row r of the O projection: into delta, with its bias (gemv_split adds o_proj_bias).
  __device__ static __forceinline__ void o_proj_row(const Params& p, unsigned, unsigned tag,
                                                    int r, float d) {
    st_flow_copies(p.delta + r, MK_H, d, tag);
  }
  __device__ static __forceinline__ const float* o_proj_bias(const LayerWeights& lw) {
    return MK_O_BIAS ? lw.bo : nullptr;
  }
  // Stage D's input: x and delta in one round trip (xs is scratch for delta); xres <- x +
  // delta and, the norm deferred, xd <- (x + delta) * gain. Returns this thread's sum of
  // squares.
  __device__ static __forceinline__ float mlp_residual(const Params& p, const LayerWeights&,
                                                       float* xs, float* xres, float* xd,
                                                       const float* gain, unsigned,
                                                       unsigned tag, unsigned tag_x) {
    return load_flow_sum<MK_H>(xres, flow_copy(p.x, MK_H), tag_x, xs, flow_copy(p.delta, MK_H),
                               tag, xd, gain);
  }
  // Stage D's norm: the 1/rms its dot products still need; publishes xd and xres.
  __device__ static __forceinline__ float mlp_norm(const Params& p, float s2, const float*,
                                                   float*, float* red, const float*) {
    return norm_scale<MK_H>(s2, red, p.eps);
  }
  // Row r of the down projection plus the residual: into x.
  __device__ static __forceinline__ void down_row(const Params& p, const float* xres, unsigned,
                                                  unsigned tag, int r, float d) {
    st_flow_copies(p.x + r, MK_H, xres[r] + d, tag);
  }
  // The token id of LM-head row r (it keys the sampling noise and the tie-break).
  __device__ static __forceinline__ int token_id(const Params&, int r) { return r; }
  // Thread 0, with this CTA's reduced best: nothing to exchange.
  __device__ static __forceinline__ void exchange(const Params&, int, float&, int&, int*) {}
  // The cancel bit after the exchange: the one the token words carried.
  __device__ static __forceinline__ bool exchanged_cancel(const int*, bool seen) { return seen; }
  // Whether the host asked to stop: the token words' cancel bit, or the flag the host CTA set
  // before the step's barrier.
  __device__ static __forceinline__ bool stop_asked(const Params& p, bool words, bool seen) {
    return words ? seen : __ldcg(p.flags + kFlagCancel) != 0;
  }
  // Whether this GPU reports tokens to the host.
  __device__ static __forceinline__ bool speaks(const Params&) { return true; }
};

#if MK_TP > 1

// u32 words of a receive buffer (layout.py tp_recv_bytes): the reduction area [2 parities]
// [MK_TP ranks][kFlowCopies][MK_H] flow words (zeroed by the host before each launch), the token
// units, the tagged logits of the whole vocabulary [2 parities][MK_V_ALL] {value, tag}, the
// untagged copy of them [MK_V_ALL] (this rank's own, never written by a peer), then the raw
// logits (before the mask and penalties) tagged as the logits are, which only rank 0's buffer
// receives, for the logprobs it alone writes.
constexpr int kTpRedWords = 2 * MK_TP * kFlowCopies * MK_H;
constexpr size_t kTpLogitWords = kTpRedWords + 2 * 4 * MK_TP;
constexpr size_t kTpDenseWords = kTpLogitWords + 2 * 2 * (size_t)MK_V_ALL;
constexpr size_t kTpRawWords = kTpDenseWords + ((size_t)MK_V_ALL + 1) / 2 * 2;  // 8-byte aligned

__device__ __forceinline__ void tp_st2(unsigned* a, unsigned x, unsigned y) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(a), "r"(x), "r"(y) : "memory");
}

__device__ __forceinline__ uint2 tp_ld2(const unsigned* a) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(a) : "memory");
  return v;
}

__device__ __forceinline__ void tp_st4(unsigned* a, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(a), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 tp_ld4(const unsigned* a) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(a)
               : "memory");
  return v;
}

// A peer that never delivers means a fault on another GPU: fail loudly after ~10 s (as
// grid_wait does) instead of hanging every rank.
__device__ __forceinline__ void tp_check_timeout(long long t0) {
  if (clock64() - t0 > 20000000000LL) __trap();
}

__device__ __forceinline__ void tp_st1(unsigned* a, unsigned x) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(a), "r"(x) : "memory");
}

// This rank's partial of element r of all-reduce `gen`, a flow word into every copy of slot
// [gen's parity][my rank] of every rank's buffer.
__device__ __forceinline__ void tp_send(const Params& p, unsigned gen, int r, float d) {
  const size_t off = (size_t)(((gen & 1u) * MK_TP + p.tp_rank) * kFlowCopies) * MK_H + r;
  const unsigned u = flow_word(d, gen & MK_TAG_BITS);
#pragma unroll
  for (int k = 0; k < MK_TP; ++k) {
#pragma unroll
    for (int c = 0; c < kFlowCopies; ++c) tp_st1(p.tp_recv[k] + off + (size_t)c * MK_H, u);
  }
}

// This CTA's copy of rank k's slot of all-reduce `gen` in this rank's buffer.
__device__ __forceinline__ const float* tp_slot(const Params& p, unsigned gen, int k) {
  const unsigned* w = p.tp_mine + (size_t)(((gen & 1u) * MK_TP + k) * kFlowCopies +
                                           read_ctaid() % kFlowCopies) * MK_H;
  return reinterpret_cast<const float*>(w);
}

// f(i) for the first float i of each of this thread's 4-float chunks of [0, MK_H): flow_fetch's
// deal (chunk threadIdx.x + j * kThreads), so a thread reads back only what it fetched.
template <class F>
__device__ __forceinline__ void tp_each_chunk(F f) {
  constexpr int N = FlowChunks<MK_H>::N;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = 4 * ((int)threadIdx.x + j * kThreads);
    if (i < MK_H) f(i);
  }
}

// a <- all-reduce `gen`, untagged, at this thread's chunks (tp_each_chunk), the ranks summed in
// order 0..N-1; b: scratch [MK_H].
// One round trip at two ranks (both slots fetched together), one more for each further rank.
__device__ __forceinline__ void tp_fetch_sum(const Params& p, unsigned gen, float* a, float* b) {
  constexpr int N = FlowChunks<MK_H>::N;
  constexpr int C = MK_H / 4;
  const unsigned tag = gen & MK_TAG_BITS;
  flow_fetch<N, N>(a, tp_slot(p, gen, 0), tag, C, b, tp_slot(p, gen, 1), tag, C);
#pragma unroll
  for (int k = 1; k < MK_TP; ++k) {
    if (k > 1) flow_fetch<N, 0>(b, tp_slot(p, gen, k), tag, C);
    tp_each_chunk([&](int i) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float acc = k == 1 ? flow_untag(a[i + w]) : a[i + w];
        a[i + w] = acc + flow_untag(b[i + w]);
      }
    });
  }
}

// xres <- xres + sum (+ bias, may be null) at this thread's chunks; returns the sum of squares
// of the new values.
__device__ __forceinline__ float tp_add_residual(float* xres, const float* sum,
                                                 const float* bias) {
  float ss = 0.f;
  tp_each_chunk([&](int i) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float d = bias ? sum[i + w] + bias[i + w] : sum[i + w];
      const float v = xres[i + w] + d;
      xres[i + w] = v;
      ss += v * v;
    }
  });
  return ss;
}

// xs <- xres + all-reduce `gen`, the residual after a down projection, RMS-normalised (times
// `gain` when not folded); xres <- the residual itself, which stage D adds its delta to.
// scratch: [MK_H] of shared memory idle here.
__device__ __forceinline__ void tp_load_residual(const Params& p, float* xs, float* xres,
                                                 float* scratch, unsigned gen, float eps,
                                                 float* red, const float* gain) {
  tp_fetch_sum(p, gen, scratch, xs);
  const float ss = tp_add_residual(xres, scratch, nullptr);
  const float r = rms_scale<MK_H>(ss, red, eps);  // its barriers: xs's scratch reads are done
  const int so = swz_off(xs + threadIdx.x);  // xs is a GEMV input (common.cuh); same for every i
  if (gain) {
    for (int i = threadIdx.x; i < MK_H; i += kThreads) xs[i + so] = xres[i] * (r * gain[i]);
  } else {
    for (int i = threadIdx.x; i < MK_H; i += kThreads) xs[i + so] = xres[i] * r;
  }
  __syncthreads();
}

// Called by one thread of every CTA with this rank's best (b, bi) of the step: CTA 0 sends
// it (with rank 0's cancel word) to every rank; every CTA then waits for all ranks' units
// and leaves the global winner in (b, bi). Returns rank 0's cancel bit.
__device__ __forceinline__ int tp_pick_token(const Params& p, int step, float& b, int& bi) {
  const unsigned tag = p.tp_tag + (unsigned)step;
  const size_t par = (size_t)(tag & 1u) * MK_TP;
  if (blockIdx.x == 0) {
    const unsigned cancel = p.tp_rank == 0 && __ldcg(p.flags) != 0 ? 1u : 0u;
    const uint4 w = make_uint4(__float_as_uint(b), tag, (unsigned)bi * 2u + cancel, tag);
#pragma unroll
    for (int k = 0; k < MK_TP; ++k)
      tp_st4(p.tp_recv[k] + kTpRedWords + 4 * (par + p.tp_rank), w);
  }
  const unsigned* mine = p.tp_mine + kTpRedWords + 4 * par;
  int cancel = 0;
  const long long t0 = clock64();
#pragma unroll
  for (int k = 0; k < MK_TP; ++k) {  // rank order: the same winner on every rank
    uint4 w;
    while (true) {
      w = tp_ld4(mine + 4 * k);
      if (w.y == tag && w.w == tag) break;
      tp_check_timeout(t0);
    }
    const float s = __uint_as_float(w.x);
    const int id = (int)(w.z >> 1);
    if (k == 0) {
      cancel = (int)(w.z & 1u);
      b = s;
      bi = id;
    } else if (better(s, id, b, bi)) {
      b = s;
      bi = id;
    }
  }
  return cancel;
}

// LM-head row r's logit of step `step` into slot vocab_start + r of every rank's logits, and
// with logprobs its raw logit into rank 0's.
__device__ __forceinline__ void tp_send_logit(const Params& p, int step, int r, float v,
                                              float raw) {
  const unsigned tag = p.tp_tag + (unsigned)step;
  const size_t slot = 2 * ((size_t)(tag & 1u) * MK_V_ALL + p.vocab_start + r);
#pragma unroll
  for (int k = 0; k < MK_TP; ++k)
    tp_st2(p.tp_recv[k] + kTpLogitWords + slot, __float_as_uint(v), tag);
  if (p.lp_out) tp_st2(p.tp_recv[0] + kTpRawWords + slot, __float_as_uint(raw), tag);
}

// Every CTA of every rank: its slice of the step's whole-vocabulary logits (sampling.cuh's
// each_mine ids), once every rank's are in, copied untagged for the sampler's passes (each
// thread reads back only what it copied; rank 0 with logprobs: the raw ones too, into
// p.raw_logits); then the token every rank draws alike, and (CTA 0, thread 0) the exchange
// that brings rank 0's cancel bit, left in flags[kFlagCancel].
__device__ __forceinline__ int tp_draw_filtered(const Params& p, uint32_t key,
                                                const SampleScratch& s, unsigned& bar, int step) {
  const unsigned tag = p.tp_tag + (unsigned)step;
  const size_t parity = 2 * (size_t)(tag & 1u) * MK_V_ALL;
  const unsigned* in = p.tp_mine + kTpLogitWords + parity;
  const unsigned* raw_in = p.tp_mine + kTpRawWords + parity;
  float* all = reinterpret_cast<float*>(p.tp_mine + kTpDenseWords);
  const bool raw = p.lp_out && p.tp_rank == 0;
  const long long t0 = clock64();
  each_id(MK_V_ALL, [&](int i) {
    uint2 w;
    while ((w = tp_ld2(in + 2 * (size_t)i)).y != tag) tp_check_timeout(t0);
    __stcg(all + i, __uint_as_float(w.x));
    if (raw) {
      while ((w = tp_ld2(raw_in + 2 * (size_t)i)).y != tag) tp_check_timeout(t0);
      __stcg(p.raw_logits + i, __uint_as_float(w.x));
    }
  });
  const int token = sample_filtered(p, key, s, bar, all, MK_V_ALL);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    float b = 0.f;
    int bi = token;  // every rank drew it: the exchange's winner is it
    p.flags[kFlagCancel] = tp_pick_token(p, step, b, bi);
  }
  return token;
}

// Several GPUs: each rank holds a slice of every matrix (heads, intermediate, vocabulary);
// the residual's partial sums are all-reduced over the peers, and the ranks agree on a token.
struct TensorParallel {
  // top-k / top-p / min_p, and logprobs: every rank draws from the whole vocabulary
  // (tp_draw_filtered), and rank 0 writes the logprobs.
  __device__ static __forceinline__ bool filtered(const Params& p, bool greedy) {
    return (!greedy && ((p.top_k > 0 && p.top_k < MK_V_ALL) || p.top_p < 1.f || p.min_p > 0.f)) ||
           p.lp_out;
  }
  __device__ static __forceinline__ void share_logit(const Params& p, int step, int r, float v,
                                                     float raw) {
    tp_send_logit(p, step, r, v, raw);
  }
  __device__ static __forceinline__ int draw_filtered(const Params& p, uint32_t key,
                                                      const SampleScratch& s, unsigned& bar,
                                                      int step) {
    return tp_draw_filtered(p, key, s, bar, step);
  }
  // Rank 0's cancel bit, which CTA 0 left in flags[kFlagCancel] before the step's barrier.
  __device__ static __forceinline__ bool filtered_cancel(const Params& p) {
    return __ldcg(p.flags + kFlagCancel) != 0;
  }
  // Generations of a layer's two all-reduces (after O-proj, after down), counted from 1 in
  // each launch: gen and gen + 1.
  __device__ static __forceinline__ unsigned reduce_tag(const Params&, int step, int layer) {
    return 1u + 2u * (unsigned)(step * MK_L + layer);
  }
  // Layer 0's residual: every CTA keeps the embedding in its own xres for stage D.
  __device__ static __forceinline__ void keep_embedding(const Params&, float* xres, int, int i,
                                                        float v, unsigned) {
    xres[i] = v;
  }
  // The residual after the previous down projection's all-reduce (generation red - 1), kept in
  // xres and normalised in place into xs: no scale left for the dot products.
  __device__ static __forceinline__ float residual_input(const Params& p, float* xs, float* xres,
                                                         float* scratch, unsigned red, unsigned,
                                                         float* red_smem, const float* gain) {
    tp_load_residual(p, xs, xres, scratch, red - 1u, p.eps, red_smem, gain);
    return 1.f;
  }
  // Partial and bias-free: the o-bias is added once after the sum (mlp_residual).
  __device__ static __forceinline__ void o_proj_row(const Params& p, unsigned red, unsigned,
                                                    int r, float d) {
    tp_send(p, red, r, d);
  }
  __device__ static __forceinline__ const float* o_proj_bias(const LayerWeights&) {
    return nullptr;
  }
  // xres <- x (kept there since stage A) + the O projection's all-reduce (+ its bias); xs
  // and xd are scratch until mlp_norm writes xd.
  __device__ static __forceinline__ float mlp_residual(const Params& p, const LayerWeights& lw,
                                                       float* xs, float* xres, float* xd,
                                                       const float*, unsigned red, unsigned,
                                                       unsigned) {
    tp_fetch_sum(p, red, xs, xd);
    return tp_add_residual(xres, xs, MK_O_BIAS ? lw.bo : nullptr);
  }
  // Normalised in place (times the gain): no scale left for the dot products. rms_scale's
  // barriers come before xd is written: mlp_residual's scratch reads of it are done.
  __device__ static __forceinline__ float mlp_norm(const Params& p, float s2, const float* xres,
                                                   float* xd, float* red, const float* g) {
    const float r = rms_scale<MK_H>(s2, red, p.eps);
    const int t = threadIdx.x;
    const int so = swz_off(xd + t);  // xd is a GEMV input (common.cuh)
    for (int i = t; i < MK_H; i += kThreads) xd[i + so] = xres[i] * (g ? r * g[i] : r);
    __syncthreads();
    return 1.f;
  }
  // Summed at the next stage A or the LM head.
  __device__ static __forceinline__ void down_row(const Params& p, const float*, unsigned red,
                                                  unsigned, int r, float d) {
    tp_send(p, red + 1u, r, d);
  }
  // Noise and tie-break keyed by the global id.
  __device__ static __forceinline__ int token_id(const Params& p, int r) {
    return p.vocab_start + r;
  }
  // Every rank's best: misc[1] <- rank 0's cancel bit, (b, bi) <- the winner over all ranks.
  __device__ static __forceinline__ void exchange(const Params& p, int step, float& b, int& bi,
                                                  int* misc) {
    misc[1] = tp_pick_token(p, step, b, bi);
  }
  // Rank 0's cancel word, as exchanged with the token: every rank stops at the same step.
  __device__ static __forceinline__ bool exchanged_cancel(const int* misc, bool) {
    return misc[1] != 0;
  }
  __device__ static __forceinline__ bool stop_asked(const Params&, bool, bool seen) {
    return seen;
  }
  // One rank speaks to the host.
  __device__ static __forceinline__ bool speaks(const Params& p) { return p.tp_rank == 0; }
};

using Net = TensorParallel;
#else
using Net = SingleGpu;
#endif  // MK_TP > 1
