// Data as flag: the stage hand-offs inside a layer without grid barriers.
//
// Every activation vector a stage hands to the next (qkv, attn_out, delta, act, x) is written
// once per layer, each element with the layer's generation in its low 8 bits: the value is
// rounded to 16 significant bits (relative error <= 2^-16, far below bf16 weights' 2^-9) and
// the freed byte carries the tag. A reader re-reads each element until its tag is the one it
// wants (a whole vector per round trip: load_flow), so the data itself is the signal: no
// fence, no counter, no second round trip to read the vector after the barrier says it is
// there. This is the trick of NCCL's LL protocol with the flag folded into the value, so the
// vectors keep their size (a 16-byte {value, tag} pair would double the L2 traffic of every
// CTA's input load).
//
// Tags. Generation g(step, layer) = 1 + step * (L + 1) + layer + 1, layer in [-1, L): -1 is
// the embedding written into x at the start of a step. A buffer is written every layer, so
// when a reader wants g the buffer holds g or the previous write (g - 1 or g - 2): different
// modulo 256. The host zeroes the buffers before each launch (tag 0; g starts at 1).
//
// Why nothing is overwritten while someone still reads it (no write-after-read race without
// barriers): each CTA reads a stage's input before it writes any of that stage's output, and
// a buffer is next written only after a chain of stages that needs output from every CTA
// (its delta rows in C, act rows in D, x rows in E). flow_possible() checks that every CTA
// owns at least one row of those three; for a grid too large for the model it is false and
// the kernel keeps a grid barrier at every hand-off (the tags are then always ready).
//
// Tensor parallelism (tp.cuh): the two all-reduces per layer are tagged peer data already;
// they replace the hand-offs C -> D and E -> A, and the same chain argument covers their
// receive slots across ranks (every CTA of every rank sends rows of both).
//
// Ordering that does need a fence stays on the grid barrier that ends each step (after the
// LM head): KV-cache rows appended in stage B are read by other CTAs' window copies only after
// it (the LM head or the sampler issues the copies for layer 0 after that barrier).
#pragma once
#include "gemv.cuh"

#define MK_TAG_BITS 0xffu

__device__ __forceinline__ unsigned flow_tag(int step, int layer) {
  return (unsigned)(1 + step * (MK_L + 1) + layer + 1) & MK_TAG_BITS;
}

// v as a hand-off word: rounded to nearest on the magnitude (sign-magnitude: symmetric),
// then tagged.
__device__ __forceinline__ unsigned flow_word(float v, unsigned tag) {
  return ((__float_as_uint(v) + 0x80u) & ~MK_TAG_BITS) | tag;
}

__device__ __forceinline__ void st_flow(float* p, float v, unsigned tag) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(flow_word(v, tag)) : "memory");
}

// Copies of the hand-off vectors that every CTA reads (x, delta, act, attn_out and the reader
// merge's partials; not qkv, which only the attention units read): the producers write each
// element into every copy and CTA c reads copy c % kFlowCopies (tunables.cuh), so the L2
// lines of one vector see that fraction of the grid's polls: a hand-off's last round trip is
// a poll of lines that up to 131 other SMs poll too. The chain argument above holds copy by
// copy. The host allocates the copies back to back (kernels/layout.py handoff_regions).
static_assert(kFlowCopies >= 1, "kFlowCopies: copies of each hand-off vector");

// This CTA's copy of a hand-off vector whose copies lie n floats apart. The CTA index is read
// where it is used (read_ctaid): offsets hoisted out of the layer loop held registers
// across it and spilled (Qwen2.5: 122 bytes instead of 26 at four copies).
__device__ __forceinline__ const float* flow_copy(const float* v, size_t n) {
  if (kFlowCopies == 1) return v;
  return v + (read_ctaid() % kFlowCopies) * n;
}

// st_flow into every copy of a hand-off vector whose copies lie n floats apart.
__device__ __forceinline__ void st_flow_copies(float* p, size_t n, float v, unsigned tag) {
#pragma unroll
  for (int k = 0; k < kFlowCopies; ++k) st_flow(p + k * n, v, tag);
}

__device__ __forceinline__ unsigned ld_flow_word(const float* p) {
  unsigned u;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(u) : "l"(p));
  return u;
}

// Spin until the word carries `tag`. A producer that never writes means a bug: trap after
// ~10 s rather than hang.
__device__ __forceinline__ unsigned flow_wait_word(const float* p, unsigned u, unsigned tag) {
  if ((u & MK_TAG_BITS) == tag) return u;
  const long long t0 = clock64();
  do {
    u = ld_flow_word(p);
    if (clock64() - t0 > 20000000000LL) __trap();
  } while ((u & MK_TAG_BITS) != tag);
  return u;
}

// The value of the word at p, first loaded as u (ld_flow_word, so several loads can be in
// flight before any is waited for), re-read until it carries `tag`; tag bits cleared.
__device__ __forceinline__ float flow_wait_value(const float* p, unsigned u, unsigned tag) {
  return __uint_as_float(flow_wait_word(p, u, tag) & ~MK_TAG_BITS);
}

__device__ __forceinline__ float ld_flow(const float* p, unsigned tag) {
  return flow_wait_value(p, ld_flow_word(p), tag);
}

__device__ __forceinline__ uint4 ld_flow_chunk(const float* p) {
  uint4 u;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p));
  return u;
}
__device__ __forceinline__ void ld_flow_item(unsigned& u, const float* p) { u = ld_flow_word(p); }
__device__ __forceinline__ void ld_flow_item(uint4& u, const float* p) { u = ld_flow_chunk(p); }

// Bit w: word w of the item carries tag.
__device__ __forceinline__ unsigned flow_fresh(unsigned u, unsigned tag) {
  return ((u ^ tag) & MK_TAG_BITS) == 0u;
}
__device__ __forceinline__ unsigned flow_fresh(uint4 u, unsigned tag) {
  return flow_fresh(u.x, tag) | flow_fresh(u.y, tag) << 1 | flow_fresh(u.z, tag) << 2 |
         flow_fresh(u.w, tag) << 3;
}
// got <- the words of v that bits m select.
__device__ __forceinline__ void flow_take(unsigned& got, unsigned v, unsigned m) {
  if (m & 1u) got = v;
}
__device__ __forceinline__ void flow_take(uint4& got, uint4 v, unsigned m) {
  if (m & 1u) got.x = v.x;
  if (m & 2u) got.y = v.y;
  if (m & 4u) got.z = v.z;
  if (m & 8u) got.w = v.w;
}

// got[j] (T: a word or a 16-byte chunk, first loaded by the caller, so those loads fly beside
// other work) re-read at addr(j) until every word carries tags[j]. Every stale item is re-read
// in the same round: a round trip a round however many are stale (flow_wait_value one after
// another pays a round trip for each item still stale when its turn comes). Words only go
// from stale to fresh while a reader waits (the chain argument above), so a fresh word is
// kept from whichever round brought it. A producer that never writes means a bug: trap after
// ~10 s rather than hang.
template <int N, typename T, typename Addr>
__device__ __forceinline__ void flow_settle(T (&got)[N], Addr addr, const unsigned (&tags)[N]) {
  constexpr int W = sizeof(T) / 4;
  static_assert(N * W <= 32, "one bit a word");
  constexpr unsigned ALL = (1u << W) - 1u;
  unsigned need = 0;  // bit j * W + w: word w of item j is stale
#pragma unroll
  for (int j = 0; j < N; ++j) need |= (~flow_fresh(got[j], tags[j]) & ALL) << (j * W);
  if (!need) return;
  const long long t0 = clock64();
  T q[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    q[j] = got[j];
    if (need >> (j * W) & ALL) ld_flow_item(q[j], addr(j));
  }
  for (;;) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const unsigned m = need >> (j * W) & ALL & flow_fresh(q[j], tags[j]);
      flow_take(got[j], q[j], m);
      need &= ~(m << (j * W));
    }
    if (!need) return;
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (need >> (j * W) & ALL) ld_flow_item(q[j], addr(j));
    if (clock64() - t0 > 20000000000LL) __trap();
  }
}

// Vectors into shared memory in one round trip. Each thread copies its 16-byte chunks
// i = threadIdx.x + j * THREADS with cp.async (L2 only, so what other SMs wrote; no registers
// held while they fly, so every chunk of the vector is in flight at once), then checks the
// tags of what landed and fetches again just the chunks some producer has not written yet.
// A vector that is already there costs one round trip, whatever its length. (The per-element
// loads this replaced went in batches of 8 a thread, one round trip each: 3 for an
// 8,960-float vector.) Word-sized stores by the producers and a tag in every word make a
// 16-byte copy that mixes old and new words harmless: those words just fail the check.
//
// N: chunks per thread at most (a compile-time bound, so the pending masks stay in
// registers); the vector's real length may be smaller and known only at run time.
template <int K>
struct FlowChunks {
  static_assert(K % 4 == 0, "flow vectors are fetched in 16-byte chunks");
  static constexpr int N = (K / 4 + kThreads - 1) / kThreads;
  static_assert(N <= 32, "a pending mask holds one bit per chunk of a thread");
};

// The chunks are dealt over STRIDE threads (the CTA); `idx` is the thread's index among them.
// Bit j: chunk idx + j * STRIDE is among the first `chunks`.
template <int N, int STRIDE>
__device__ __forceinline__ unsigned flow_mask(int idx, int chunks) {
  unsigned m = 0;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (idx + j * STRIDE < chunks) m |= 1u << j;
  return m;
}

// Issue cp.async for this thread's chunks in `pending` (not yet committed). SW: dst is a
// GEMV input, kept swizzled (common.cuh).
template <int N, int STRIDE, bool SW = false>
__device__ __forceinline__ void flow_issue(int idx, float* dst, const float* src,
                                           unsigned pending) {
  static_assert(STRIDE % 8 == 0, "a thread's chunks must move alike under the swizzle");
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(dst)) +
                        (SW ? 4 * swz_off(dst + 4 * idx) : 0);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = idx + j * STRIDE;
    if (pending >> j & 1u)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16u * i),
                   "l"(src + 4 * i)
                   : "memory");
  }
}

// The chunks of `pending` whose words do not all carry `tag` yet.
template <int N, int STRIDE, bool SW = false>
__device__ __forceinline__ unsigned flow_stale(int idx, const float* dst, unsigned tag,
                                               unsigned pending) {
  unsigned stale = 0;
  const float* d = SW ? swz(dst + 4 * idx) : dst + 4 * idx;  // chunk idx; the others move alike
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = idx + j * STRIDE;
    if (pending >> j & 1u) {
      const uint4 u = *reinterpret_cast<const uint4*>(d + 4 * (i - idx));
      if (((u.x ^ tag) | (u.y ^ tag) | (u.z ^ tag) | (u.w ^ tag)) & MK_TAG_BITS) stale |= 1u << j;
    }
  }
  return stale;
}

__device__ __forceinline__ float flow_untag(float v) {
  return __uint_as_float(__float_as_uint(v) & ~MK_TAG_BITS);
}

// The value st_flow stores for v, tag aside: a producer that also uses a value itself (the
// attention units' running max) rounds it first, so writer and reader agree exactly.
__device__ __forceinline__ float flow_round(float v) {
  return __uint_as_float((__float_as_uint(v) + 0x80u) & ~MK_TAG_BITS);
}

// The chunks of `pa` of a (from src_a, tag_a) and of `pb` of b (src_b, tag_b) copied until
// each carries its tag: every pending chunk in flight at once, a round trip a round. SW: a is
// a GEMV input, stored swizzled. A producer that never writes means a bug: trap after ~10 s
// rather than hang.
template <int NA, int NB, int STRIDE, bool SW>
__device__ __forceinline__ void flow_fetch_pending(int idx, float* a, const float* src_a,
                                                   unsigned tag_a, unsigned pa, float* b,
                                                   const float* src_b, unsigned tag_b,
                                                   unsigned pb) {
  const long long t0 = clock64();
  while (pa | pb) {
    flow_issue<NA, STRIDE, SW>(idx, a, src_a, pa);
    flow_issue<NB, STRIDE>(idx, b, src_b, pb);
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
    pa = flow_stale<NA, STRIDE, SW>(idx, a, tag_a, pa);
    pb = flow_stale<NB, STRIDE>(idx, b, tag_b, pb);
    if ((pa | pb) && clock64() - t0 > 20000000000LL) __trap();
  }
}

// a[0 .. 4 ca) <- src_a (tag_a) and b[0 .. 4 cb) <- src_b (tag_b), in one round trip when
// both are there; tags left in place. NA / NB bound the chunks per thread (0: no b). SW: a is
// a GEMV input, stored swizzled.
template <int NA, int NB, int STRIDE = kThreads, bool SW = false>
__device__ __forceinline__ void flow_fetch(float* a, const float* src_a, unsigned tag_a, int ca,
                                           float* b = nullptr, const float* src_b = nullptr,
                                           unsigned tag_b = 0u, int cb = 0,
                                           int idx = (int)threadIdx.x) {
  flow_fetch_pending<NA, NB, STRIDE, SW>(idx, a, src_a, tag_a, flow_mask<NA, STRIDE>(idx, ca), b,
                                         src_b, tag_b, flow_mask<NB, STRIDE>(idx, cb));
}

// k-tiles [kt0, kt1) of xs rewritten as tile_inputs does, by one warp (kt0 even), the tags of
// the hand-off words cleared as they are read.
template <class F>
__device__ __forceinline__ void tile_inputs_warp(float* xs, float* sums, int kt0, int kt1,
                                                 int lane) {
  for (int base = kt0; base < kt1; base += 32)
    tile_block<F>(xs, sums, base + lane, kt1, [](float x) { return flow_untag(x); });
}

// The down projection's input (MK_E_STREAM) where each warp owns one K-slice [c0, c0 + KP)
// of every tile: the warp fetches its own slice of act (hand-off words of `tag`) into xs,
// with no CTA barrier. begin() brings the whole slice in one round trip and waits only for
// its columns before LATE (all but the tiles' last batch of loads); rest(), called before
// the first tile's last batch, for the others, which D's last rounds write (its tiles in
// TilesTailsLast's order). So E streams its first batches while D's last rows land.
template <class F, int KP, int LATE, class Src>
struct TileInputsStreamed {
  static constexpr bool kStreamed = true;
  static constexpr int N = (KP / 4 + 31) / 32;  // 16-byte chunks a lane
  static_assert(N <= 32 && KP % 32 == 0 && LATE % 32 == 0 && LATE <= KP,
                "a slice's chunks and its late part in whole 32-column blocks");
  Src src;  // () -> the hand-off vector (recomputed where used: no register held for it)
  unsigned tag;

  // The slice's columns before LATE, waited for and rewritten as tile_inputs does. Not
  // inlined, nor is rest_of: inlined, their registers joined the batch loop's and every
  // stage spilled more.
  __device__ __noinline__ static void begin_of(float* xs, float* sums, const float* src,
                                               unsigned tag, int c0, int lane) {
    float* d = xs + c0;
    const float* s = src + c0;
    flow_issue<N, 32, true>(lane, d, s, flow_mask<N, 32>(lane, KP / 4));
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
    take(xs, sums, s, tag, c0, lane, flow_mask<N, 32>(lane, LATE / 4), 0, LATE);
  }
  // The late columns, whose tags are read again here (most landed with begin's copies): no
  // mask is held across the batches in between.
  __device__ __noinline__ static void rest_of(float* xs, float* sums, const float* src,
                                              unsigned tag, int c0, int lane) {
    const unsigned late = flow_mask<N, 32>(lane, KP / 4) & ~flow_mask<N, 32>(lane, LATE / 4);
    take(xs, sums, src + c0, tag, c0, lane, late, LATE, KP);
  }
  // Columns [c0 + from, c0 + to) of the slice, whose chunks `pending` copied, waited for
  // (again where stale) and rewritten.
  __device__ __forceinline__ static void take(float* xs, float* sums, const float* s,
                                              unsigned tag, int c0, int lane, unsigned pending,
                                              int from, int to) {
    float* d = xs + c0;
    const unsigned stale = flow_stale<N, 32, true>(lane, d, tag, pending);
    flow_fetch_pending<N, 0, 32, true>(lane, d, s, tag, stale, nullptr, nullptr, 0u, 0u);
    __syncwarp();
    tile_inputs_warp<F>(xs, sums, (c0 + from) / 16, (c0 + to) / 16, lane);
    __syncwarp();
  }
  __device__ __forceinline__ void begin(float* xs, float* sums, int c0, int lane) const {
    begin_of(xs, sums, src(), tag, c0, lane);
  }
  __device__ __forceinline__ void rest(float* xs, float* sums, int c0, int lane) const {
    rest_of(xs, sums, src(), tag, c0, lane);
  }
};

// A norm's gain (K floats, global; null: folded into the next matrix) copied into shared
// memory `dst` with cp.async, not waited for. Issued before a stage's first weight loads go
// out at the end of the stage before it: read after the hand-off instead, the gain's L2 hits
// queued behind those loads (tools/stage_skew.py shows it at D's input). Each
// thread copies the chunks it later fetches of the norm's input (the same deal as
// flow_fetch's), so the deferred norm's readers wait only for their own copies (the
// cp.async.wait_all in flow_fetch or embed_norm); tensor parallelism's rms_scale waits and
// publishes them to the CTA.
template <int K>
__device__ __forceinline__ void stage_gain(float* dst, const float* gain) {
  if (!gain) return;
  constexpr int N = FlowChunks<K>::N;
  flow_issue<N, kThreads>((int)threadIdx.x, dst, gain,
                            flow_mask<N, kThreads>((int)threadIdx.x, K / 4));
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Where a norm reads its gain: stage_gain's copy in dst, or global memory when not staged.
__device__ __forceinline__ const float* staged_gain(const float* dst, const float* gain) {
  return gain ? dst : gain;
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// An RMS norm's scale, 1/rms of K values of which this thread's squares sum to ss. All
// threads must call. Waits for this thread's staged gain copies first; block_sum's barriers
// then publish them to the CTA.
template <int K>
__device__ __forceinline__ float rms_scale(float ss, float* red, float eps) {
  cp_async_wait_all();
  return rsqrtf(block_sum(ss, red) / K + eps);
}

// A norm's 1/rms applied after the matrix instead of before it: W (g * x / rms(x)) =
// (W (g * x)) / rms(x). The stage's input is then g * x, which each thread writes for the
// elements it fetched itself (the gain chunks it staged are the same ones, stage_gain), and
// the scale multiplies each row's dot product. The norm costs the one barrier that publishes
// the input, instead of block_sum's three, a pass over the vector and another barrier.
// Tensor parallelism's residual (tp.cuh) still normalises in place with rms_scale.
// red[kNormRed ..+ WARPS): the warps' sums of squares. Read right after the barrier that
// follows their writes; the next writes are the next norm's, with the stages' barriers in
// between; no other user of red touches them.
static_assert(kNormRed + kWarps <= 64, "red holds 64 floats (layout.py)");

// 1/rms of K values of which this thread's squares sum to ss; publishes shared memory written
// before it (one barrier). All threads must call.
template <int K>
__device__ __forceinline__ float norm_scale(float ss, float* red, float eps) {
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[kNormRed + (threadIdx.x >> 5)] = ss;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[kNormRed + w];  // one order in every thread
  return rsqrtf(s / K + eps);
}

// The tags cleared from the chunks a thread fetched swizzled (flow_fetch's deal with SW:
// chunk idx + j * STRIDE of v[0..len)), each value times gain (may be null; unswizzled,
// read at the same chunks); returns the sum of squares of the values without the gain. idx
// is unsigned, as threadIdx.x is: load_flow's index arithmetic stays as it was.
template <int N, int STRIDE>
__device__ __forceinline__ float flow_untag_chunks(float* v, unsigned idx, int len,
                                                   const float* gain = nullptr) {
  float ss = 0.f;
  const int so = swz_off(v + 4 * idx);  // the same for every chunk of this thread
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = 4 * (idx + j * STRIDE);
    if (i < len) {
      float4* c = reinterpret_cast<float4*>(v + i + so);  // one 16-byte chunk
      const float4 u = *c;
      const float x[4] = {flow_untag(u.x), flow_untag(u.y), flow_untag(u.z), flow_untag(u.w)};
      float y[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        y[k] = gain ? x[k] * gain[i + k] : x[k];
        ss += x[k] * x[k];
      }
      *c = make_float4(y[0], y[1], y[2], y[3]);
    }
  }
  return ss;
}

// xs[0..K) <- src (written by other CTAs with `tag`), tags cleared, times gain (may be null:
// a deferred norm's, see norm_scale), swizzled (a GEMV's input); returns this thread's sum
// of squares over the elements it fetched. Callers __syncthreads before others read xs.
// Either path has also waited for this thread's staged gain copies (cp.async.wait_all).
template <int K>
__device__ __forceinline__ float load_flow(float* xs, const float* src, unsigned tag,
                                           const float* gain = nullptr) {
  constexpr int N = FlowChunks<K>::N;
  if constexpr (N == 1) {
    // One chunk a thread: through registers (flow_settle), then untagged into xs.
    const int i = 4 * threadIdx.x;
    float ss = 0.f;
    if (i < K) {
      uint4 got[1] = {ld_flow_chunk(src + i)};
      const unsigned tags[1] = {tag};
      flow_settle(got, [&](int) { return src + i; }, tags);
      cp_async_wait_all();  // this thread's staged gain chunk (as flow_fetch waits for it)
      float* c = xs + i + swz_off(xs + i);
      const unsigned w[4] = {got[0].x, got[0].y, got[0].z, got[0].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float x = __uint_as_float(w[k] & ~MK_TAG_BITS);
        c[k] = gain ? x * gain[i + k] : x;
        ss += x * x;
      }
    }
    return ss;
  } else {
    flow_fetch<N, 0, kThreads, true>(xs, src, tag, K / 4);
    return flow_untag_chunks<N, kThreads>(xs, threadIdx.x, K, gain);
  }
}

// Two vectors of K in one round trip: a <- src_a (tag_a), b <- src_b (tag_b) (b is scratch,
// unused when the chunks come through registers). Then a[i] += b[i] for this thread's
// elements; returns their sum of squares (stage D's residual: x + the O-projection's output).
// scaled (may be null): also gets a[i] * gain[i] (gain may be null: a[i]), swizzled: a
// deferred norm's GEMV input (norm_scale).
template <int K>
__device__ __forceinline__ float load_flow_sum(float* a, const float* src_a, unsigned tag_a,
                                               float* b, const float* src_b, unsigned tag_b,
                                               float* scaled = nullptr,
                                               const float* gain = nullptr) {
  constexpr int N = FlowChunks<K>::N;
  if constexpr (N == 1) {
    // One chunk of each a thread: both through registers (flow_settle).
    const int i = 4 * threadIdx.x;
    float ss = 0.f;
    if (i < K) {
      uint4 got[2] = {ld_flow_chunk(src_a + i), ld_flow_chunk(src_b + i)};
      const unsigned tags[2] = {tag_a, tag_b};
      flow_settle(got, [&](int j) { return (j ? src_b : src_a) + i; }, tags);
      cp_async_wait_all();  // this thread's staged gain chunk (as flow_fetch waits for it)
      const int so = scaled ? swz_off(scaled + i) : 0;
      const unsigned wa[4] = {got[0].x, got[0].y, got[0].z, got[0].w};
      const unsigned wb[4] = {got[1].x, got[1].y, got[1].z, got[1].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float v =
            __uint_as_float(wa[k] & ~MK_TAG_BITS) + __uint_as_float(wb[k] & ~MK_TAG_BITS);
        a[i + k] = v;
        if (scaled) scaled[i + so + k] = gain ? v * gain[i + k] : v;
        ss += v * v;
      }
    }
    return ss;
  }
  flow_fetch<N, N>(a, src_a, tag_a, K / 4, b, src_b, tag_b, K / 4);
  float ss = 0.f;
  const int so = scaled ? swz_off(scaled + 4 * threadIdx.x) : 0;  // same for every chunk
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = 4 * (threadIdx.x + j * kThreads);
    if (i < K) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float v = flow_untag(a[i + k]) + flow_untag(b[i + k]);
        a[i + k] = v;
        if (scaled) scaled[i + so + k] = gain ? v * gain[i + k] : v;
        ss += v * v;
      }
    }
  }
  return ss;
}

// xs[0..K) <- src (fp32, written by other CTAs with `tag`, above), swizzled as every GEMV
// input is (common.cuh); optionally RMS-normalised, the 1/rms deferred to the dot products
// (norm_scale). gain (may be null): the norm's gain when it was not folded into the next
// matrix, in global or (staged) shared memory. Returns the scale the stage's dot products
// still need: the norm's 1/rms, or 1.
template <int K>
__device__ __forceinline__ float load_vec(float* xs, const float* src, unsigned tag, bool norm,
                                          float eps, float* red, const float* gain = nullptr) {
  if (norm) return norm_scale<K>(load_flow<K>(xs, src, tag, gain), red, eps);
  load_flow<K>(xs, src, tag);
  __syncthreads();
  return 1.f;
}

// ---- a verify pass (MK_P > 1): a hand-off region holds one vector a position ----
//
// Position q's vector of K floats lies at q K in a copy (its copies MK_P K floats apart), and
// in shared memory at q K too. Each position's chunks go to the threads a step's one vector
// gives them, and are untagged and summed by the same code, so every position's norm is the
// step's to the bit; all positions' chunks are in flight in one round trip.

// dst[q K ..+ K) <- src[q K ..+ K) for q < n (tag), swizzled where SW; and where dst2 is
// given, dst2 likewise from src2 (tag2, never swizzled) in the same round trips.
template <int K, bool SW>
__device__ __forceinline__ void flow_fetch_pass(float* dst, const float* src, unsigned tag,
                                                int n, float* dst2 = nullptr,
                                                const float* src2 = nullptr, unsigned tag2 = 0u) {
  constexpr int N = FlowChunks<K>::N;
  const int idx = (int)threadIdx.x;
  const long long t0 = clock64();
  const unsigned all = flow_mask<N, kThreads>(idx, K / 4);
  unsigned pend[MK_P], pend2[MK_P];
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    pend[q] = q < n ? all : 0u;
    pend2[q] = q < n && dst2 ? all : 0u;
  }
  for (;;) {
    unsigned any = 0;
#pragma unroll
    for (int q = 0; q < MK_P; ++q) any |= pend[q] | pend2[q];
    if (!any) return;
#pragma unroll
    for (int q = 0; q < MK_P; ++q) {
      flow_issue<N, kThreads, SW>(idx, dst + q * K, src + q * K, pend[q]);
      flow_issue<N, kThreads>(idx, dst2 + q * K, src2 + q * K, pend2[q]);
    }
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
#pragma unroll
    for (int q = 0; q < MK_P; ++q) {
      pend[q] = flow_stale<N, kThreads, SW>(idx, dst + q * K, tag, pend[q]);
      pend2[q] = flow_stale<N, kThreads>(idx, dst2 + q * K, tag2, pend2[q]);
    }
    if (clock64() - t0 > 20000000000LL) __trap();
  }
}

// load_flow for the n positions of a pass: xs[q K ..) <- position q of src, times gain;
// ss[q]: this thread's sum of squares of position q's values.
template <int K>
__device__ __forceinline__ void load_flow_pass(float* xs, const float* src, unsigned tag, int n,
                                               float (&ss)[MK_P], const float* gain = nullptr) {
  constexpr int N = FlowChunks<K>::N;
  flow_fetch_pass<K, true>(xs, src, tag, n);
#pragma unroll
  for (int q = 0; q < MK_P; ++q)
    ss[q] = q < n ? flow_untag_chunks<N, kThreads>(xs + q * K, threadIdx.x, K, gain) : 0.f;
}

// The norms' scales of a pass's n positions (norm_scale each; one barrier between two, so no
// position's sums overwrite the last one's before every thread has read them).
template <int K>
__device__ __forceinline__ void norm_scales(const float (&ss)[MK_P], int n, float* red, float eps,
                                            float (&scale)[MK_P]) {
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    scale[q] = 1.f;
    if (q < n) {
      if (q) __syncthreads();
      scale[q] = norm_scale<K>(ss[q], red, eps);
    }
  }
}

// load_vec for a pass: the vectors of src's n positions into xs, normalised (the scales
// deferred to the dot products) or not (scales 1).
template <int K>
__device__ __forceinline__ void load_vec_pass(float* xs, const float* src, unsigned tag, int n,
                                              bool norm, float eps, float* red,
                                              float (&scale)[MK_P],
                                              const float* gain = nullptr) {
  if (n == 1) {  // a draftless pass: the step's own load
#pragma unroll
    for (int q = 1; q < MK_P; ++q) scale[q] = 1.f;
    scale[0] = load_vec<K>(xs, src, tag, norm, eps, red, norm ? gain : nullptr);
    return;
  }
  float ss[MK_P];
  load_flow_pass<K>(xs, src, tag, n, ss, norm ? gain : nullptr);
  if (norm) {
    norm_scales<K>(ss, n, red, eps, scale);
  } else {
#pragma unroll
    for (int q = 0; q < MK_P; ++q) scale[q] = 1.f;
    __syncthreads();
  }
}

// load_flow_sum for a pass: a[q K ..) <- x + delta of position q (b: scratch for delta,
// n K floats), scaled[q K ..) <- that times gain, swizzled; ss[q] its sum of squares, summed
// in the order of the step's (multi-chunk) path, which the one-chunk path's equals.
template <int K>
__device__ __forceinline__ void load_flow_sum_pass(float* a, const float* src_a, unsigned tag_a,
                                                   float* b, const float* src_b, unsigned tag_b,
                                                   float* scaled, const float* gain, int n,
                                                   float (&ss)[MK_P]) {
  if (n == 1) {  // a draftless pass: the step's own load
#pragma unroll
    for (int q = 1; q < MK_P; ++q) ss[q] = 0.f;
    ss[0] = load_flow_sum<K>(a, src_a, tag_a, b, src_b, tag_b, scaled, gain);
    return;
  }
  constexpr int N = FlowChunks<K>::N;
  flow_fetch_pass<K, false>(a, src_a, tag_a, n, b, src_b, tag_b);
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    float s = 0.f;
    if (q < n) {
      float* aq = a + q * K;
      const float* bq = b + q * K;
      float* sq = scaled + q * K;
      const int so = swz_off(sq + 4 * threadIdx.x);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int i = 4 * (threadIdx.x + j * kThreads);
        if (i < K) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float v = flow_untag(aq[i + k]) + flow_untag(bq[i + k]);
            aq[i + k] = v;
            sq[i + so + k] = gain ? v * gain[i + k] : v;
            s += v * v;
          }
        }
      }
    }
    ss[q] = s;
  }
}

// Whether every CTA owns a row of the stages whose outputs order the buffers' reuse (see the
// top of this file): C (rows H, split units per CTA), D (I gate/up pairs, a warp each) and
// E (rows H); in a tile format (gemv_tiles.cuh) whole tiles, numbered across CTAs first.
// The same for every CTA.
template <int GROUPS_C, int GROUPS_E, int TILE_ROWS>
__device__ __forceinline__ bool flow_possible() {
  const int last = (int)gridDim.x - 1;
  if constexpr (TILE_ROWS > 1)  // a tile format: tiles of TILE_ROWS rows across CTAs first
    return last < MK_H / TILE_ROWS && last < 2 * MK_I / TILE_ROWS;
  return last * GROUPS_C < MK_H && last * kWarps < MK_I && last * GROUPS_E < MK_H;
}

// A hand-off: a grid barrier unless the data carries its own flag. Split like grid_arrive /
// grid_wait so the next stage's first weight loads go out in between either way.
__device__ __forceinline__ void handoff_arrive(bool flow, unsigned* counter, unsigned& target) {
  if (flow) {
    __syncthreads();  // the next stage's input load overwrites shared memory this one read
  } else {
    grid_arrive(counter, target);
  }
}

__device__ __forceinline__ void handoff_wait(bool flow, const unsigned* counter,
                                             unsigned target) {
  if (!flow) grid_wait(counter, target);
}
