// The GEMV of a tile format (formats/int4_tiles.cuh, formats/fp8_tiles.cuh) on the tensor
// cores: a unit is a tile of 16 rows, not a row; a warp streams a tile's K-slice with one
// 16-byte load a lane per F::kLoadCols columns and multiplies it by the input with
// mma.m16n8k16 (perf-notes step 76 measured this at ~85% of the copy bandwidth for int4
// where the CUDA cores got ~55%).
//
// The input: x is rounded to bf16 (f16 for fp8) hi + lo, so the products carry ~16 mantissa
// bits of x (the fp32 input nearly). B's columns hold hi (columns 0, 1, 4, 5) and lo (2, 3,
// 6, 7), so one mma a k-tile makes both products: a lane keeps one row (c[0], row g, for
// t < 2; c[2], row g + 8, for t >= 2) times hi (even t) or lo (odd t), and a shuffle adds
// the two at the end of a tile slice. (Both halves in one column each took two mma a k-tile:
// perf-notes step 86.) A single-position GEMV pays nothing for the columns it repeats.
//
// Split K as gemv_split: SPLIT warps share a tile, one slice each; their partials meet in
// shared memory in rounds of kTileRound tiles a warp and are summed in a fixed order
// (deterministic). out2(tile, i, v0, v1) gets rows 2i and 2i + 1 of a tile (i < 8), so a
// gate/up matrix interleaved by rows hands one thread both halves of a pair.
// Included by gemv.cuh after RowShape, Split and tile_unit.
#pragma once
#include "mma.cuh"

// Tiles a warp's partials hold per round: part is [kWarps][kTileRound][16] floats.
constexpr int kTileRound = kPartFloats / 16;

// hi + lo of an input pair (split_pair's), summed in the order int4's offsets always used.
template <bool F16>
__device__ __forceinline__ float pair_sum(uint32_t hi, uint32_t lo) {
  if constexpr (F16) {
    const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    const float2 l = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    return (h.x + l.x) + (h.y + l.y);
  } else {
    return (bf_lo(hi) + bf_lo(lo)) + (bf_hi(hi) + bf_hi(lo));
  }
}

// k-tile kt of xs (16 inputs, fp32 and swizzled, each read through `read`) rewritten in place
// as tile_inputs says, and its sum into sums where F's groups want one; kt >= end: nothing
// but the shuffle (the whole warp calls, kt = a run of 32 from an even start).
template <class F, class Read>
__device__ __forceinline__ void tile_block(float* xs, float* sums, int kt, int end, Read read) {
  float s = 0.f;
  if (kt < end) {
    float* blk = xs + 16 * kt;
    float v[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(swz(blk + 4 * q));
      v[4 * q] = read(f.x), v[4 * q + 1] = read(f.y), v[4 * q + 2] = read(f.z);
      v[4 * q + 3] = read(f.w);
    }
    uint32_t hi[8], lo[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      split_pair<F::kF16>(make_float2(v[2 * w], v[2 * w + 1]), hi[w], lo[w]);
      if constexpr (F::kSumCols) s += pair_sum<F::kF16>(hi[w], lo[w]);
    }
#pragma unroll
    for (int t = 0; t < 4; ++t)
      *reinterpret_cast<uint4*>(blk + 4 * t) = make_uint4(hi[t], hi[t + 4], lo[t], lo[t + 4]);
  }
  if constexpr (F::kSumCols == 32) {
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (kt < end && !(kt & 1)) sums[kt / 2] = s;
  } else if constexpr (F::kSumCols == 16) {
    if (kt < end) sums[kt] = s;
  }
}

// xs [K], fp32 and swizzled (common.cuh), rewritten in place as the tile GEMV's input: each
// k-tile of 16 inputs (64 bytes) holds its 8 pairs (2w, 2w + 1) as 16-bit pairs (F::kF16:
// f16, else bf16), 16 bytes for each t: hi of pairs t and t + 4, then their lo, so a lane's B
// fragments (hi or lo of pairs t and t + 4) are one 8-byte load; in a group format,
// sums[k / n] <- the sum of hi + lo over
// inputs k .. k + n - 1, n = F::kSumCols (a group's offset term). A thread rewrites only the
// 64 bytes it read: no barrier between reads and writes.
template <int K, class F>
__device__ __forceinline__ void tile_inputs(float* xs, float* sums) {
  static_assert(K % 64 == 0, "a tile GEMV's input is whole 64-column loads (build.py checks)");
  constexpr int kKt = K / 16;
  for (int base = (int)threadIdx.x & ~31; base < kKt; base += kThreads)  // warp-uniform
    tile_block<F>(xs, sums, base + ((int)threadIdx.x & 31), kKt, [](float x) { return x; });
  __syncthreads();
}

// A tile GEMV's input as every stage but E takes it: the whole vector is in xs (fp32,
// swizzled); tile_inputs rewrites it, then a barrier.
struct TileInputsWhole {
  static constexpr bool kStreamed = false;
};

// The nibbles of v under `mask` (0x000F000F or 0x00F000F0) as the f16 pair 1024 + q or
// 1024 + 16 q: one LOP3 ((v & mask) | 0x64006400; as PTX, so ptxas keeps the constant in a
// register rather than spending a second LOP3 on it).
__device__ __forceinline__ uint32_t nibbles_f16(uint32_t v, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(v), "r"(mask), "n"(0x64006400));
  return r;
}

// One load's 64 columns (4 k-tiles) of the lane's tile row (g for lanes t < 2, g + 8 for the
// others) into acc: per segment (F::kSegCols columns under one group pair) the tensor cores
// sum C = sum (1024 + q / m) x (m: 1 for rows g, 1/16 for rows g + 8, int4_tiles.cuh), and
// the pair adds a' C + (b - 1024 a') s, a' = a m. xl: the lane's B fragments
// of the load's first k-tile; sl: the sums of its 32-column blocks; upper: t >= 2; lo: the
// lane's C is its row times the inputs' lo (odd t), which leaves the offset term to hi. A group
// wider than a load (F::kGroupLoads > 1) keeps its pair in `pair` from its first load j on:
// the later loads' pairs are dead, and with batches of whole groups the compiler drops them.
template <class F, bool kWhole = true>
__device__ __forceinline__ void tile_load_dot(const typename F::Load& u,
                                              const float* __restrict__ xl,
                                              const float* __restrict__ sl, bool upper, bool lo,
                                              int j, int phase,
                                              float2& pair, float& acc) {
  const uint32_t wd[4] = {u.w.x, u.w.y, u.w.z, u.w.w};
  constexpr int kPerSeg = 4 / F::kSegs;  // k-tiles a segment
#pragma unroll
  for (int h = 0; h < F::kSegs; ++h) {
    float c[4];
#pragma unroll
    for (int m = h * kPerSeg; m < (h + 1) * kPerSeg; ++m) {
      const uint32_t v = wd[m], v8 = v >> 8;
      const uint32_t a[4] = {nibbles_f16(v, 0x000F000Fu), nibbles_f16(v, 0x00F000F0u),
                             nibbles_f16(v8, 0x000F000Fu), nibbles_f16(v8, 0x00F000F0u)};
      const uint2 x = *reinterpret_cast<const uint2*>(xl + 16 * m);
      if (m == h * kPerSeg)
        mma_f16_first(c, a, x.x, x.y);
      else
        mma_f16(c, a, x.x, x.y);
    }
    const float s = F::kSegCols == 32 ? sl[h] : sl[0] + sl[1];
    float2 ab = u.ab[h];
    if constexpr (F::kGroupLoads > 1) {
      if constexpr (kWhole) {
        if ((j & (F::kGroupLoads - 1)) == 0) pair = ab;
      } else {
        // A slice that starts inside a group takes its first load's pair too.
        if (((j + phase) & (F::kGroupLoads - 1)) == 0 || j == 0) pair = ab;
      }
      ab = pair;
    }
    acc = fmaf(ab.x, upper ? c[2] : c[0], lo ? acc : fmaf(ab.y, s, acc));
  }
}

// Tiles of W [rows, K] (rows a multiple of 16) times xs: unit u = (warp / S) * grid + cta owns
// tiles u, u + units, ... (numbered across CTAs first, so every CTA owns a tile wherever there
// are as many tiles as CTAs: flow.cuh flow_possible); pre holds its first tile's first batch
// (issue_split_first). sums: K / F::kSumCols floats of scratch. All threads of the CTA must call.
template <int K, int SPLIT, class Order = TilesInOrder, class In = TileInputsWhole, class F,
          class Out2>
__device__ __forceinline__ void gemv_tiles(Matrix<F> M, int rows, float* xs, float* sums,
                                           float* part, int warp, int lane,
                                           typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B],
                                           Out2 out2, int cta, In in = In{}) {
  using P = Split<F, K, SPLIT>;
  using S = typename P::Shape;
  using L = typename F::Load;
  constexpr int NB = (S::N + S::B - 1) / S::B;  // batches a tile slice
  constexpr int R = kTileRound;
  constexpr bool kWhole = kWholeGroups<F, P::KP>;
  if constexpr (!In::kStreamed) tile_inputs<K, F>(xs, sums);
  const int tiles = rows / F::kTileRows;
  const int units = gridDim.x * P::GROUPS;
  const int c0 = (warp % P::S) * P::KP;
  const int u0 = tile_unit(warp / P::S, cta);
  const int iters = (tiles - cta + units - 1) / units;  // max over the groups (group 0's)
  // B's column g = lane / 4 holds the inputs' hi where g & 2 is clear, else their lo; so the
  // product in C's column 2t (a lane's c[0] and c[2]) is hi for even t and lo for odd t.
  const float* xl = xs + c0 + 4 * (lane & 3) + ((lane & 8) ? 2 : 0);
  const float* sl = sums + c0 / (F::kSumCols ? F::kSumCols : 32);
  const int phase = slice_phase<K, SPLIT, F>(warp);
  const bool upper = lane & 2;  // this lane's row: g + 8, else g
  const bool lo = lane & 1;     // this lane's products: its row times the inputs' lo, else hi
  if constexpr (In::kStreamed) {
    static_assert(P::GROUPS == 1, "a streamed input: one K-slice a warp");
    in.begin(xs, sums, c0, lane);
  }
  // One stream of batches over the warp's tiles: while batch b is multiplied, the next is in
  // flight (the tile's next batch, or after its last the next tile's first, across rounds).
  // The batches run in a loop, not unrolled: a tile slice of up to K / 64 loads unrolled
  // would be tens of KB of code (the SM's instruction caches hold ~32 KB at full speed).
  L cur[S::B], nxt[S::B];
#pragma unroll
  for (int i = 0; i < S::B; ++i) cur[i] = pre[i];
  auto tile = [&](int it, int slot) {
    const int t = u0 + it * units, tn = t + units;
    const int tc = Order::at(t < tiles ? t : tiles - 1, tiles);
    const auto pc = F::tile_at(M.rows, M.scales, (size_t)tc, c0, K);
    const auto pn =
        F::tile_at(M.rows, M.scales, (size_t)Order::at(tn < tiles ? tn : tiles - 1, tiles), c0, K);
    float acc = 0.f;
    // A row-scaled format's scale, for the row this lane's partial is of (t clamped as pc).
    float sc = 1.f;
    if constexpr (F::kScaled)
      sc = M.row_scale((size_t)tc * 16 + (lane >> 2) + (upper ? 8 : 0));
    float block = 0.f;  // a block-scaled format's current block scale (set by its first load)
    float2 pair = make_float2(0.f, 0.f);  // a wide group's pair (tile_load_dot)
#pragma unroll 1
    for (int b = 0; b < NB; ++b) {
      const bool last = b + 1 == NB;
      const auto pa = last ? pn : pc;
      const int bn = last ? 0 : b + 1;
      const bool live = !last || tn < tiles;
      // The slice's late columns, before the next batch's registers are taken.
      if constexpr (In::kStreamed) {
        if (it == 0 && last) in.rest(xs, sums, c0, lane);
      }
#pragma unroll
      for (int i = 0; i < S::B; ++i) {
        const int j = bn * S::B + i;
        nxt[i] = live && j < S::N ? tile_load<F, kWhole>(pa, 32 * j + lane, phase) : F::zero();
      }
#pragma unroll
      for (int i = 0; i < S::B; ++i) {
        const int j = b * S::B + i;
        if constexpr (F::kGroups) {
          if (j < S::N)
            tile_load_dot<F, kWhole>(cur[i], xl + 64 * j, sl + 2 * j, upper, lo, j, phase, pair,
                                     acc);
        } else if constexpr (F::kSumCols) {
          if (j < S::N) F::tile_dot(cur[i], xl + 32 * j, sl + F::kSegs * j, upper, lo, acc);
        } else {
          if (j < S::N) F::tile_dot(cur[i], xl + F::kLoadCols * j, upper, j, block, acc);
        }
      }
#pragma unroll
      for (int i = 0; i < S::B; ++i) cur[i] = nxt[i];
    }
    if constexpr (F::kScaled) acc *= sc;
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);  // the row's hi and lo products
    if (!lo) part[(warp * R + slot) * 16 + (lane >> 2) + (upper ? 8 : 0)] = acc;
  };
  // TPI threads sum an item's (a tile's two rows') S partials, PER each, then shuffle.
  constexpr int TPI = P::S >= 2 ? P::S / 2 : 1;
  constexpr int PER = P::S / TPI;
  constexpr int ITEMS = P::GROUPS * R * 8;
  for (int it0 = 0; it0 < iters; it0 += R) {
    const int it1 = min(iters, it0 + R);
    for (int it = it0; it < it1; ++it) tile(it, it - it0);
    __syncthreads();
    for (int q = threadIdx.x; q < ITEMS * TPI; q += kThreads) {
      const int k = q % TPI, item = q / TPI;
      const int i = item % 8, j = (item / 8) % R, gg = item / (8 * R);
      float v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int e = 0; e < PER; ++e) {
        const float* pp = part + ((gg * P::S + k * PER + e) * R + j) * 16 + 2 * i;
        v0 += pp[0];
        v1 += pp[1];
      }
#pragma unroll
      for (int o = TPI / 2; o; o >>= 1) {
        v0 += __shfl_xor_sync(0xffffffffu, v0, o);
        v1 += __shfl_xor_sync(0xffffffffu, v1, o);
      }
      const int t = tile_unit(gg, cta) + (it0 + j) * units;
      if (k == 0 && it0 + j < it1 && t < tiles) out2(Order::at(t, tiles), i, v0, v1);
    }
    __syncthreads();
  }
}
