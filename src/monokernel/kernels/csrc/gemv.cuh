// Warp-per-row GEMV on CUDA cores: bf16 weights streamed with 16-byte loads, fp32 input in
// shared memory, fp32 accumulation.
//
// A warp's rows form a software pipeline: the first batch of loads of row r+step is issued
// before row r is reduced, and the first batch of a stage's first row is issued *before* the
// stage waits for its input vector (flow.cuh, decode.cu), so HBM keeps streaming while CTAs
// wait and while that vector is being loaded.
#pragma once
#include "common.cuh"

#ifndef MK_BATCH
#define MK_BATCH 6   // 16-byte loads in flight per lane, one row (8 spills registers)
#endif
#ifndef MK_BATCH2
#define MK_BATCH2 4  // per row when two rows (gate, up) stream together (6: spills, slower)
#endif
// 1: a warp's last row issues its own loads again as the "next" row (the clamped address),
// as before step 57 (docs/perf-notes.md). Those loads most likely hit L2, but the copy into
// the next row's buffer waits for them: a round trip at the end of every stage, on the way
// to the hand-off.
#ifndef MK_LAST_REISSUE
#define MK_LAST_REISSUE 0
#endif

template <int K, int BATCH>
struct RowShape {
  static constexpr int C = K / 8;                    // 16-byte chunks in a row
  static constexpr int N = (C + 31) / 32;            // chunks per lane
  static constexpr int B = N < BATCH ? N : BATCH;    // loads per lane per batch
};

// Issue the first batch of one row's loads into registers; zeros where !live (a pipeline's
// "next row" after a warp's last: no load, so nothing to wait for when the buffer moves).
template <int K, int BATCH>
__device__ __forceinline__ void issue_first(uint4 (&buf)[RowShape<K, BATCH>::B],
                                            const bf16* __restrict__ w, int lane,
                                            bool live = true) {
  using S = RowShape<K, BATCH>;
  const uint4* wp = reinterpret_cast<const uint4*>(w);
  live = live || MK_LAST_REISSUE;
#pragma unroll
  for (int i = 0; i < S::B; ++i) {
    const int c = i * 32 + lane;
    buf[i] = live && c < S::C ? ld_stream(wp + c) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Dot of 8 bf16 weights with the 8 floats (a, b).
__device__ __forceinline__ float dot8x(const uint4 u, const float4 a, const float4 b) {
  float acc = bf_lo(u.x) * a.x;
  acc = fmaf(bf_hi(u.x), a.y, acc);
  acc = fmaf(bf_lo(u.y), a.z, acc);
  acc = fmaf(bf_hi(u.y), a.w, acc);
  acc = fmaf(bf_lo(u.z), b.x, acc);
  acc = fmaf(bf_hi(u.z), b.y, acc);
  acc = fmaf(bf_lo(u.w), b.z, acc);
  acc = fmaf(bf_hi(u.w), b.w, acc);
  return acc;
}

// Dot of 16-byte chunk c of a bf16 row with the same 8 floats of xs (stored swizzled,
// common.cuh). o: 4 where this lane's chunks have their halves swapped, else 0 (lane_half).
__device__ __forceinline__ float dot8(const uint4 u, const float* __restrict__ xs, int c,
                                      int o) {
  const float* q = xs + 8 * c;
  return dot8x(u, *reinterpret_cast<const float4*>(q + o),
               *reinterpret_cast<const float4*>(q + 4 - o));
}

// dot8's o for a lane: its chunks c = i * 32 + lane lie 1 KB apart, so all share the bit of
// the address that decides the swap.
__device__ __forceinline__ int lane_half(const float* xs, int lane) {
  return swz_off(xs + 8 * lane);
}

// Lane-partial dot of row w with xs; the first batch was issued earlier into `first`.
template <int K, int BATCH>
__device__ __forceinline__ float row_partial(const uint4 (&first)[RowShape<K, BATCH>::B],
                                             const bf16* __restrict__ w,
                                             const float* __restrict__ xs, int lane) {
  using S = RowShape<K, BATCH>;
  const uint4* wp = reinterpret_cast<const uint4*>(w);
  const int o = lane_half(xs, lane);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < S::B; ++i) {
    const int c = i * 32 + lane;
    if (c < S::C) acc += dot8(first[i], xs, c, o);
  }
#pragma unroll
  for (int b0 = S::B; b0 < S::N; b0 += S::B) {
    uint4 buf[S::B];
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      const int c = (b0 + i) * 32 + lane;
      if (b0 + i < S::N && c < S::C) buf[i] = ld_stream(wp + c);
    }
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      const int c = (b0 + i) * 32 + lane;
      if (b0 + i < S::N && c < S::C) acc += dot8(buf[i], xs, c, o);
    }
  }
  return acc;
}

// Split-K GEMV: SPLIT consecutive warps of a CTA share each row, one K/SPLIT slice each,
// so short stages get more loads in flight and rows balance over fewer, larger units.
// Partial sums meet in shared memory (fixed order: deterministic, no atomics).
// Unit u = blockIdx * (WARPS/SPLIT) + warp/SPLIT owns rows u, u + units, ...
template <int K, int SPLIT>
struct Split {
  static constexpr int S = (K % (8 * SPLIT) == 0) ? SPLIT : 1;  // else no split
  static constexpr int KP = K / S;                               // slice length
  static constexpr int GROUPS = MK_WARPS / S;                    // units per CTA
  using Shape = RowShape<KP, MK_BATCH>;
};

// This warp's first row slice of a split GEMV over W [rows, K] (clamped: always valid).
// cta: the CTA's rank in the stage's row order (gemv_split).
template <int K, int SPLIT>
__device__ __forceinline__ const bf16* split_first(const bf16* W, int rows, int warp,
                                                   int cta = (int)blockIdx.x) {
  using P = Split<K, SPLIT>;
  const int unit = cta * P::GROUPS + warp / P::S;
  const int r = unit < rows ? unit : rows - 1;
  return W + (size_t)r * K + (warp % P::S) * P::KP;
}

#define MK_SPLIT_SLOTS 32  // rows per unit combined per round; part[] is WARPS x SLOTS floats

// out(r, value) is called once per row, by one thread. All threads of the CTA must call.
// cta: the CTA's rank in the row order (the units of the first ranks get a row more when the
// rows do not divide evenly). bias (may be null): added to each row's value. The first
// round's values are loaded before the rows are computed: read in the combine, they cost a
// round trip on the stage's way out (Qwen2.5's QKV bias: 9 µs a token on an H100,
// docs/perf-notes.md step 43). scale: multiplies each row's dot product before the bias (a
// deferred norm's 1/rms, flow.cuh norm_scale). PINGPONG: a unit's rows alternate between
// `pre` and a second buffer, so no copy joins them: the compiler otherwise copies the row in
// flight out of its registers at the top of each row (waiting for it) before issuing the
// next, leaving one row in flight a warp (step 58). For the LM head's ~144 rows a unit.
template <int K, int SPLIT, bool PINGPONG = false, class Out>
__device__ __forceinline__ void gemv_split(const bf16* __restrict__ W, int rows,
                                           const float* __restrict__ xs, float* part, int warp,
                                           int lane,
                                           uint4 (&pre)[Split<K, SPLIT>::Shape::B], Out out,
                                           int cta = (int)blockIdx.x,
                                           const float* __restrict__ bias = nullptr,
                                           float scale = 1.f) {
  using P = Split<K, SPLIT>;
  using S = typename P::Shape;
  constexpr bool PIPE = S::N <= S::B;
  const int units = gridDim.x * P::GROUPS;
  const int g = warp / P::S, s = warp % P::S;
  const int u0 = cta * P::GROUPS + g;
  const int iters = (rows - cta * P::GROUPS + units - 1) / units;  // max over groups
  const float* xp = xs + s * P::KP;
  float b0 = 0.f;  // bias of the row this thread combines in the first round
  if (bias && (int)threadIdx.x < P::GROUPS * MK_SPLIT_SLOTS) {
    const int j = threadIdx.x % MK_SPLIT_SLOTS;
    const int r = cta * P::GROUPS + (int)threadIdx.x / MK_SPLIT_SLOTS + j * units;
    if (j < iters && r < rows) b0 = bias[r];
  }
  // Row it of this unit: its first batch is in cur; the next row's goes into nxt.
  auto row = [&](uint4(&cur)[S::B], uint4(&nxt)[S::B], int it, int it0) {
    const int r = u0 + it * units;
    const int rn = r + units;
    const bf16* wn = W + (size_t)(rn < rows ? rn : (r < rows ? r : rows - 1)) * K + s * P::KP;
    if (PIPE) issue_first<P::KP, MK_BATCH>(nxt, wn, lane, rn < rows);
    float d = 0.f;
    if (r < rows)
      d = warp_sum(row_partial<P::KP, MK_BATCH>(cur, W + (size_t)r * K + s * P::KP, xp, lane));
    if (lane == 0) part[warp * MK_SPLIT_SLOTS + (it - it0)] = d;
    if (!PIPE) issue_first<P::KP, MK_BATCH>(nxt, wn, lane, rn < rows);
  };
  for (int it0 = 0; it0 < iters; it0 += MK_SPLIT_SLOTS) {
    const int it1 = min(iters, it0 + MK_SPLIT_SLOTS);
    if (PINGPONG) {
      static_assert(MK_SPLIT_SLOTS % 2 == 0, "a whole round must end with the next row in pre");
      uint4 alt[S::B];
      for (int it = it0; it < it1; it += 2) {
        row(pre, alt, it, it0);
        if (it + 1 < it1) row(alt, pre, it + 1, it0);
      }
    } else {
      for (int it = it0; it < it1; ++it) {
        uint4 nxt[S::B];
        row(pre, nxt, it, it0);
#pragma unroll
        for (int i = 0; i < S::B; ++i) pre[i] = nxt[i];
      }
    }
    __syncthreads();
    // Thread (group gg, slot j) adds the slices of row u(gg) + (it0 + j) * units.
    for (int q = threadIdx.x; q < P::GROUPS * MK_SPLIT_SLOTS; q += MK_THREADS) {
      const int gg = q / MK_SPLIT_SLOTS, j = q % MK_SPLIT_SLOTS;
      const int r = cta * P::GROUPS + gg + (it0 + j) * units;
      if (it0 + j < it1 && r < rows) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < P::S; ++k) v += part[(gg * P::S + k) * MK_SPLIT_SLOTS + j];
        v *= scale;
        if (bias) v += it0 == 0 ? b0 : bias[r];
        out(r, v);
      }
    }
    __syncthreads();
  }
}

// Row pairs (2p, 2p+1) of W [2*pairs, K] (gate/up interleaved): out(p, dot0, dot1).
template <int K, class Out>
__device__ __forceinline__ void gemv_pairs(const bf16* __restrict__ W, int pairs, int p0, int step,
                                           const float* __restrict__ xs, int lane,
                                           uint4 (&pre0)[RowShape<K, MK_BATCH2>::B],
                                           uint4 (&pre1)[RowShape<K, MK_BATCH2>::B], Out out) {
  using S = RowShape<K, MK_BATCH2>;
  // Two rows already stream together; a second pair in flight would need 128 registers.
  constexpr bool PIPE = false;
  for (int p = p0; p < pairs; p += step) {
    uint4 n0[S::B], n1[S::B];
    const int pn = p + step;
    const size_t q = (size_t)(pn < pairs ? pn : p);
    if (PIPE) {
      issue_first<K, MK_BATCH2>(n0, W + (2 * q) * K, lane, pn < pairs);
      issue_first<K, MK_BATCH2>(n1, W + (2 * q + 1) * K, lane, pn < pairs);
    }
    // While row 2p is reduced, row 2p+1's first batch is already in flight.
    const float a = row_partial<K, MK_BATCH2>(pre0, W + (size_t)(2 * p) * K, xs, lane);
    const float b = row_partial<K, MK_BATCH2>(pre1, W + (size_t)(2 * p + 1) * K, xs, lane);
    out(p, warp_sum(a), warp_sum(b));
    if (!PIPE) {
      issue_first<K, MK_BATCH2>(n0, W + (2 * q) * K, lane, pn < pairs);
      issue_first<K, MK_BATCH2>(n1, W + (2 * q + 1) * K, lane, pn < pairs);
    }
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      pre0[i] = n0[i];
      pre1[i] = n1[i];
    }
  }
}

// Warm L2 with the rows a warp will read after its first pair in gemv_pairs (its first pair
// is issued into registers before the stage's barrier anyway). Issued a stage or two ahead,
// while latency-bound stages leave HBM idle, so the bandwidth-bound stage then reads part of
// its bytes from L2. One bulk prefetch per row pair (2 rows of K bf16, contiguous).
#ifndef MK_PF_PAIRS
#define MK_PF_PAIRS 0  // measured: slower (docs/perf-notes.md, step 8)
#endif
template <int K>
__device__ __forceinline__ void prefetch_pairs_l2(const bf16* W, int pairs, int p0, int step,
                                                  int lane) {
  if (lane != 0) return;
#pragma unroll
  for (int i = 1; i <= MK_PF_PAIRS; ++i) {
    const int pp = p0 + i * step;
    if (pp >= pairs) break;
    const bf16* a = W + (size_t)(2 * pp) * K;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(4 * K) : "memory");
  }
}
