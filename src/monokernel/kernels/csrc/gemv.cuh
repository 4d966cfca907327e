// Warp-per-row GEMV on CUDA cores: weights streamed with 16-byte loads, fp32 input in shared
// memory, fp32 accumulation. Templates over the weight format (formats/format.cuh), which the
// entry points (gemv_split, gemv_pairs, split_first, issue_row; drawn_rows.cuh's gemv_drawn)
// take from the type of the matrix view they are given.
//
// A warp's rows form a software pipeline: the first batch of loads of row r+step is issued
// before row r is reduced, and the first batch of a stage's first row is issued *before* the
// stage waits for its input vector (flow.cuh, cta.cuh hand_off), so HBM keeps streaming while
// CTAs wait and while that vector is being loaded.
#pragma once
#include "layout.cuh"

// A GEMV unit of format F (a row, or a tile of 16 rows: F::kTileRows) over K columns, dealt
// over the 32 lanes of a warp in 16-byte loads. A tile format keeps its own batch
// (MK_TILE_BATCH): its loads carry their group pairs in registers too.
template <class F, int K, int BATCH>
struct RowShape {
  static_assert(K * F::kTileRows % (32 * F::kPerLoad) == 0 || !F::kTiles,
                "a tile slice is whole warp-wide loads (build.py checks)");
  static_assert(K % F::kPerLoad == 0, "a row is whole 16-byte loads (build.py checks)");
  static constexpr int C = K * F::kTileRows / F::kPerLoad;  // 16-byte chunks in a unit
  static constexpr int N = (C + 31) / 32;                   // chunks per lane
  static constexpr int BB = F::kTiles ? MK_TILE_BATCH : BATCH;
  static constexpr int B = N < BB ? N : BB;  // loads per lane per batch
};

// A tile format's load c of a slice with that phase (kWhole: its slices start on a group;
// else a group format's loads read their pairs by phase: slice_phase).
template <class F, bool kWhole>
__device__ __forceinline__ typename F::Load tile_load(typename F::Ptr p, int c, int phase) {
  if constexpr (kWhole)
    return F::load(p, c);
  else
    return F::load(p, c, phase);
}

// Issue the first batch of one row's loads into registers; zeros where !live (a pipeline's
// "next row" after a warp's last: no load, so the copy into the next row's buffer waits for
// nothing on the way to the hand-off). kWhole / phase: tile_load's, for a tile slice that
// starts inside a group.
template <class F, int K, int BATCH, bool kWhole = true>
__device__ __forceinline__ void issue_first(typename F::Load (&buf)[RowShape<F, K, BATCH>::B],
                                            typename F::Ptr w, int lane, bool live = true,
                                            int phase = 0) {
  using S = RowShape<F, K, BATCH>;
#pragma unroll
  for (int i = 0; i < S::B; ++i) {
    const int c = i * 32 + lane;
    buf[i] = live && c < S::C ? tile_load<F, kWhole>(w, c, phase) : F::zero();
  }
}

// Dot of 16-byte chunk c of a row with the same kPerLoad floats of xs (stored swizzled,
// common.cuh). o: 4 where this lane's chunks have their halves swapped, else 0 (lane_half).
template <class F>
__device__ __forceinline__ float dot_load(const typename F::Load u, const float* __restrict__ xs,
                                          int c, int o) {
  static_assert(F::kPerLoad % 8 == 0, "the input is read in 8-float units (32-byte swizzle)");
  if constexpr (F::kGroups) {
    return F::dot_chunk(u, xs + F::kPerLoad * c, c, o);
  } else {
    float4 x[F::kPerLoad / 4];
    load_inputs<F::kPerLoad>(x, xs + F::kPerLoad * c, o);
    return F::dot(u, x);
  }
}

// dot_load's o for a lane: its chunks c = i * 32 + lane lie a multiple of 1 KB apart, so all
// share the bit of the address that decides the swap.
template <class F>
__device__ __forceinline__ int lane_half(const float* xs, int lane) {
  return swz_off(xs + F::kPerLoad * lane);
}

// Lane-partial dot of row w with xs; the first batch was issued earlier into `first`.
template <class F, int K, int BATCH>
__device__ __forceinline__ float row_partial(
    const typename F::Load (&first)[RowShape<F, K, BATCH>::B], typename F::Ptr w,
    const float* __restrict__ xs, int lane) {
  using S = RowShape<F, K, BATCH>;
  const int o = lane_half<F>(xs, lane);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < S::B; ++i) {
    const int c = i * 32 + lane;
    if (c < S::C) acc += dot_load<F>(first[i], xs, c, o);
  }
#pragma unroll
  for (int b0 = S::B; b0 < S::N; b0 += S::B) {
    typename F::Load buf[S::B];
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      const int c = (b0 + i) * 32 + lane;
      if (b0 + i < S::N && c < S::C) buf[i] = F::load(w, c);
    }
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      const int c = (b0 + i) * 32 + lane;
      if (b0 + i < S::N && c < S::C) acc += dot_load<F>(buf[i], xs, c, o);
    }
  }
  return acc;
}

// Split-K GEMV: SPLIT consecutive warps of a CTA share each row, one K/SPLIT slice each,
// so short stages get more loads in flight and rows balance over fewer, larger units.
// Partial sums meet in shared memory (fixed order: deterministic, no atomics).
// Unit u = blockIdx * (WARPS/SPLIT) + warp/SPLIT owns rows u, u + units, ...
// A group format's slices start on a multiple of 8 chunks (int4.cuh: its rotation); a tile
// format's units are tiles of 16 rows (gemv_tiles.cuh), its slices start on a group.
// A tile format's first tile of unit group g of CTA cta: numbered across CTAs first
// (gemv_tiles.cuh), so every CTA owns a tile wherever there are as many tiles as CTAs.
__device__ __forceinline__ int tile_unit(int g, int cta) { return g * (int)gridDim.x + cta; }

// The order a tile GEMV takes its tiles in: its units' t-th tile (numbered across CTAs
// first, so rounds of tiles end one after another) is tile at(t, tiles) of the matrix.
struct TilesInOrder {
  __device__ static __forceinline__ int at(int t, int) { return t; }
};

// Stage D's order where the down projection streams its input (flow.cuh
// TileInputsStreamed): D's tiles are act rows 8 at a time, E's NS warps each read one slice
// of act from its start, and the last TAIL tiles of every slice (the act rows of E's last
// batch of loads) come last, by offset across the slices; the others first, in the matrix's
// order. So D's last rounds write what E reads last. (tiles = NS x a slice's tiles.)
// Interleaving every tile by offset (t % NS slice, t / NS offset) lost: what D streams at once
// was no longer contiguous (perf-notes step 103).
template <int NS, int TAIL>
struct TilesTailsLast {
  __device__ static __forceinline__ int at(int t, int tiles) {
    const int per = tiles / NS, head = per - TAIL;
    if (t < NS * head) return (t / head) * per + t % head;
    const int u = t - NS * head;
    return (u % NS) * per + head + u / NS;
  }
};

template <class F>
constexpr int slice_unit() {
  if constexpr (F::kTiles)
    return F::kSliceCols;
  else
    return F::kPerLoad * (F::kGroups ? 8 : 1);
}
template <class F, int K, int SPLIT>
struct Split {
  static constexpr int kSliceUnit = slice_unit<F>();
  static constexpr int S = (K % (kSliceUnit * SPLIT) == 0) ? SPLIT : 1;  // else no split
  static constexpr int KP = K / S;                                         // slice length
  static constexpr int GROUPS = kWarps / S;                                // units per CTA
  using Shape = RowShape<F, KP, kBatch>;
};

// Whether every slice of KP columns starts on a group of F (a group wider than a load
// otherwise leaves odd slices starting inside one: slice_phase, tile_load_dot's phase).
template <class F, int KP, bool kGroupTiles = F::kTiles && F::kGroups>
struct WholeGroups {
  static constexpr bool value = true;
};
template <class F, int KP>
struct WholeGroups<F, KP, true> {
  static constexpr bool value = KP % (F::kGroupLoads * F::kLoadCols) == 0;
};
template <class F, int KP>
constexpr bool kWholeGroups = WholeGroups<F, KP>::value;

// This warp's slice's phase: the loads of its first group before it (kWholeGroups).
template <int K, int SPLIT, class F>
__device__ __forceinline__ int slice_phase(int warp) {
  using P = Split<F, K, SPLIT>;
  if constexpr (kWholeGroups<F, P::KP>)
    return 0;
  else
    return ((warp % P::S) * P::KP / F::kLoadCols) & (F::kGroupLoads - 1);
}

// This warp's first row slice of a split GEMV over W [rows, K] (clamped: always valid).
// cta: the CTA's rank in the stage's row order (gemv_split).
template <int K, int SPLIT, class Order = TilesInOrder, class F>
__device__ __forceinline__ typename F::Ptr split_first(Matrix<F> W, int rows, int warp,
                                                       int cta = (int)blockIdx.x) {
  using P = Split<F, K, SPLIT>;
  if constexpr (F::kTiles) {
    const int unit = tile_unit(warp / P::S, cta);
    const int tiles = rows / F::kTileRows;
    return F::tile_at(W.rows, W.scales, (size_t)Order::at(unit < tiles ? unit : tiles - 1, tiles),
                      (warp % P::S) * P::KP, K);
  } else {
    const int unit = cta * P::GROUPS + warp / P::S;
    const int r = unit < rows ? unit : rows - 1;
    return W.at((size_t)r * K + (warp % P::S) * P::KP);
  }
}

// Issue the first batch of this warp's slice at p (split_first's) into buf: issue_first,
// with the slice's phase where a tile format's slices start inside a group.
template <int K, int SPLIT, class F>
__device__ __forceinline__ void issue_slice_first(
    typename F::Load (&buf)[Split<F, K, SPLIT>::Shape::B], typename F::Ptr p, int warp,
    int lane) {
  using P = Split<F, K, SPLIT>;
  issue_first<F, P::KP, kBatch, kWholeGroups<F, P::KP>>(buf, p, lane, true,
                                                         slice_phase<K, SPLIT, F>(warp));
}

// Issue this warp's first row slice of a split GEMV (split_first) into buf.
template <int K, int SPLIT, class Order = TilesInOrder, class F>
__device__ __forceinline__ void issue_split_first(
    typename F::Load (&buf)[Split<F, K, SPLIT>::Shape::B], Matrix<F> W, int rows, int warp,
    int lane,
    int cta = (int)blockIdx.x) {
  issue_slice_first<K, SPLIT, F>(buf, split_first<K, SPLIT, Order>(W, rows, warp, cta), warp,
                                 lane);
}

// Issue row r of W [rows, K] (BATCH loads a lane) into buf.
template <int K, int BATCH, class F>
__device__ __forceinline__ void issue_row(typename F::Load (&buf)[RowShape<F, K, BATCH>::B],
                                          Matrix<F> W, size_t r, int lane) {
  issue_first<F, K, BATCH>(buf, W.at(r * K), lane);
}

#include "gemv_tiles.cuh"  // gemv_split's branch for tile formats

// A round of a unit's rows it0 .. it1 - 1, each by row(cur, nxt, it, it0): the row's first
// batch in cur, the next row's issued into nxt; the two buffers take turns (PINGPONG: an
// even number of rows a round ends with the next row in pre again), or nxt is copied back.
template <bool PINGPONG, class L, int B, class Row>
__device__ __forceinline__ void split_round(const Row& row, L (&pre)[B], int it0, int it1) {
  if (PINGPONG) {
    L alt[B];
    for (int it = it0; it < it1; it += 2) {
      row(pre, alt, it, it0);
      if (it + 1 < it1) row(alt, pre, it + 1, it0);
    }
  } else {
    for (int it = it0; it < it1; ++it) {
      L nxt[B];
      row(pre, nxt, it, it0);
#pragma unroll
      for (int i = 0; i < B; ++i) pre[i] = nxt[i];
    }
  }
}

// gemv_split over rows (a row format).
template <int K, int SPLIT, bool PINGPONG = false, class F, class Out>
__device__ __forceinline__ void gemv_split_rows(
    Matrix<F> M, int rows, const float* __restrict__ xs, float* part, int warp, int lane,
    typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B], Out out, int cta,
    const float* __restrict__ bias, float scale) {
  using P = Split<F, K, SPLIT>;
  using L = typename F::Load;
  using S = typename P::Shape;
  constexpr bool PIPE = S::N <= S::B;
  const int units = gridDim.x * P::GROUPS;
  const int g = warp / P::S, s = warp % P::S;
  const int u0 = cta * P::GROUPS + g;
  const int iters = (rows - cta * P::GROUPS + units - 1) / units;  // max over groups
  const float* xp = xs + s * P::KP;
  float b0 = 0.f;  // bias of the row this thread combines in the first round
  if (bias && (int)threadIdx.x < P::GROUPS * kSplitSlots) {
    const int j = threadIdx.x % kSplitSlots;
    const int r = cta * P::GROUPS + (int)threadIdx.x / kSplitSlots + j * units;
    if (j < iters && r < rows) b0 = bias[r];
  }
  const RowScales<F> scales(M, u0, units, iters, rows, lane);
  // Row it of this unit: its first batch is in cur; the next row's goes into nxt.
  auto row = [&](L(&cur)[S::B], L(&nxt)[S::B], int it, int it0) {
    const int r = u0 + it * units;
    const int rn = r + units;
    const auto wn = M.at((size_t)(rn < rows ? rn : (r < rows ? r : rows - 1)) * K + s * P::KP);
    if (PIPE) issue_first<F, P::KP, kBatch>(nxt, wn, lane, rn < rows);
    float d = 0.f;
    if (r < rows)
      d = warp_sum(row_partial<F, P::KP, kBatch>(cur, M.at((size_t)r * K + s * P::KP), xp, lane));
    if constexpr (F::kScaled) d *= r < rows ? scales.at(M, it, r) : 0.f;
    if (lane == 0) part[warp * kSplitSlots + (it - it0)] = d;
    if (!PIPE) issue_first<F, P::KP, kBatch>(nxt, wn, lane, rn < rows);
  };
  for (int it0 = 0; it0 < iters; it0 += kSplitSlots) {
    const int it1 = min(iters, it0 + kSplitSlots);
    static_assert(!PINGPONG || kSplitSlots % 2 == 0, "a round must end with the next row in pre");
    split_round<PINGPONG>(row, pre, it0, it1);
    __syncthreads();
    // Thread (group gg, slot j) adds the slices of row u(gg) + (it0 + j) * units.
    for (int q = threadIdx.x; q < P::GROUPS * kSplitSlots; q += kThreads) {
      const int gg = q / kSplitSlots, j = q % kSplitSlots;
      const int r = cta * P::GROUPS + gg + (it0 + j) * units;
      if (it0 + j < it1 && r < rows) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < P::S; ++k) v += part[(gg * P::S + k) * kSplitSlots + j];
        v *= scale;
        if (bias) v += it0 == 0 ? b0 : bias[r];
        out(r, v);
      }
    }
    __syncthreads();
  }
}

// out(r, value) is called once per row, by one thread. All threads of the CTA must call.
// cta: the CTA's rank in the row order (the units of the first ranks get a row more when the
// rows do not divide evenly). bias (may be null): added to each row's value. The first
// round's values are loaded before the rows are computed: read in the combine, they cost a
// round trip on the stage's way out. scale: multiplies each row's dot product before the bias (a
// deferred norm's 1/rms, flow.cuh norm_scale). PINGPONG: a unit's rows alternate between
// `pre` and a second buffer, so no copy joins them: the compiler otherwise copies the row in
// flight out of its registers at the top of each row (waiting for it) before issuing the
// next, leaving one row in flight a warp. For the LM head's ~144 rows a unit.
//
// A tile format (gemv_tiles.cuh) rewrites xs in place as its 16-bit input pairs, or, with
// an input `in` that streams (flow.cuh TileInputsStreamed), each warp fetches its own slice.
template <int K, int SPLIT, bool PINGPONG = false, class F, class Out,
          class In = TileInputsWhole>
__device__ __forceinline__ void gemv_split(Matrix<F> M, int rows, float* xs,
                                           float* part, int warp, int lane,
                                           typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B],
                                           Out out,
                                           int cta = (int)blockIdx.x,
                                           const float* __restrict__ bias = nullptr,
                                           float scale = 1.f, In in = In{}) {
  static_assert(F::kTiles || !In::kStreamed, "a streamed input is a tile format's");
  if constexpr (F::kTiles) {
    gemv_tiles<K, SPLIT>(M, rows, xs, part + kAttSums, part, warp, lane, pre,
                         [&](int tile, int i, float v0, float v1) {
                           const int r = tile * F::kTileRows + 2 * i;
                           v0 *= scale;
                           v1 *= scale;
                           if (bias) v0 += bias[r], v1 += bias[r + 1];
                           out(r, v0);
                           out(r + 1, v1);
                         },
                         cta, in);
  } else {
    gemv_split_rows<K, SPLIT, PINGPONG>(M, rows, xs, part, warp, lane, pre, out, cta, bias, scale);
  }
}

// Row pairs (2p, 2p+1) of W [2*pairs, K] (gate/up interleaved): out(p, dot0, dot1).
template <int K, class F, class Out>
__device__ __forceinline__ void gemv_pairs(Matrix<F> M, int pairs, int p0, int step,
                                           const float* __restrict__ xs, int lane,
                                           typename F::Load (&pre0)[RowShape<F, K, MK_BATCH2>::B],
                                           typename F::Load (&pre1)[RowShape<F, K, MK_BATCH2>::B],
                                           Out out) {
  using S = RowShape<F, K, MK_BATCH2>;
  // Two rows already stream together; a second pair in flight would need 128 registers.
  constexpr bool PIPE = false;
  // Lane j: the scale of row j of this warp's rows 2p0, 2p0 + 1, 2(p0 + step), ...
  const int count = 2 * ((pairs - p0 + step - 1) / step);
  float sc = 1.f;
  if constexpr (F::kScaled) {
    const size_t r = 2 * ((size_t)p0 + (size_t)(lane >> 1) * step) + (lane & 1);
    if (lane < count && r < 2 * (size_t)pairs) sc = M.row_scale(r);
  }
  for (int p = p0, k = 0; p < pairs; p += step, ++k) {
    typename F::Load n0[S::B], n1[S::B];
    const int pn = p + step;
    const size_t q = (size_t)(pn < pairs ? pn : p);
    if (PIPE) {
      issue_first<F, K, MK_BATCH2>(n0, M.at((2 * q) * K), lane, pn < pairs);
      issue_first<F, K, MK_BATCH2>(n1, M.at((2 * q + 1) * K), lane, pn < pairs);
    }
    // While row 2p is reduced, row 2p+1's first batch is already in flight.
    const float a = row_partial<F, K, MK_BATCH2>(pre0, M.at((size_t)(2 * p) * K), xs, lane);
    const float b = row_partial<F, K, MK_BATCH2>(pre1, M.at((size_t)(2 * p + 1) * K), xs, lane);
    if constexpr (F::kScaled) {
      const bool held = 2 * k + 1 < 32;
      const float s0 = held ? __shfl_sync(0xffffffffu, sc, 2 * k) : M.row_scale(2 * (size_t)p);
      const float s1 =
          held ? __shfl_sync(0xffffffffu, sc, 2 * k + 1) : M.row_scale(2 * (size_t)p + 1);
      out(p, warp_sum(a) * s0, warp_sum(b) * s1);
    } else
      out(p, warp_sum(a), warp_sum(b));
    if (!PIPE) {
      issue_first<F, K, MK_BATCH2>(n0, M.at((2 * q) * K), lane, pn < pairs);
      issue_first<F, K, MK_BATCH2>(n1, M.at((2 * q + 1) * K), lane, pn < pairs);
    }
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      pre0[i] = n0[i];
      pre1[i] = n1[i];
    }
  }
}

#include "gemv_pass.cuh"  // a verify pass's GEMVs over row formats
