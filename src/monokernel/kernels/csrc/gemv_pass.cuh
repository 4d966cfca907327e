// The GEMVs of a verify pass (MK_P > 1; docs/speculative.md): the n positions' inputs lie
// `stride` floats apart in shared memory. Where a GEMV's rows outnumber the grid's units,
// each loaded chunk of a row is dotted with all of them, so a pass streams each row once and
// pays each GEMV's latency once; where the step leaves units idle, each position of a row
// is a row of its own on its own unit (the *_spread loops), which reads the row again from
// L2 but keeps a warp's registers and instructions a step's. Each position's sums are made
// in the order a step makes its one (row_partial's chunks, then warp_sum, then the split-K
// slices in warp order), so every position is the step's to the bit. Row formats only; a
// tile format's pass runs gemv_tiles once a position (the stages).
// Included by gemv.cuh after gemv_split and gemv_pairs. The row loops repeat gemv.cuh's
// rather than share them through lambdas: that form left the step's cubins as they were but
// made the pass ~25% slower (perf-notes, step 88's lost lines). Only a round's turns of the
// prefetch buffers are shared (split_round), which leaves every cubin as it was.
#pragma once

// Lane partials of row w with each position's input (row_partial's, position by position).
template <class F, int K, int BATCH>
__device__ __forceinline__ void row_partials(
    const typename F::Load (&first)[RowShape<F, K, BATCH>::B], typename F::Ptr w,
    const float* __restrict__ xs, int stride, int n, int lane, float (&acc)[MK_P]) {
  using S = RowShape<F, K, BATCH>;
  int o[MK_P];
#pragma unroll
  for (int q = 0; q < MK_P; ++q) {
    acc[q] = 0.f;
    o[q] = lane_half<F>(xs + q * stride, lane);
  }
#pragma unroll
  for (int i = 0; i < S::B; ++i) {
    const int c = i * 32 + lane;
#pragma unroll
    for (int q = 0; q < MK_P; ++q)
      if (q < n && c < S::C) acc[q] += dot_load<F>(first[i], xs + q * stride, c, o[q]);
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
#pragma unroll
      for (int q = 0; q < MK_P; ++q)
        if (q < n && b0 + i < S::N && c < S::C)
          acc[q] += dot_load<F>(buf[i], xs + q * stride, c, o[q]);
    }
  }
}

// v[q] for a run-time q, kept in registers (an indexed array would live in local memory).
__device__ __forceinline__ float pick(const float (&v)[MK_P], int q) {
  float r = v[0];
#pragma unroll
  for (int j = 1; j < MK_P; ++j)
    if (j == q) r = v[j];
  return r;
}

// gemv_split_rows over a pass's n inputs: out(q, r, value) once per position and row. A round
// holds kSplitSlots / MK_P rows (each row's MK_P sums side by side in part; an even number of
// rows where two buffers take turns); the rows' sums are the step's whatever the round (each
// is its own slices added in warp order).
template <int K, int SPLIT, bool PINGPONG, class F, class Out>
__device__ __forceinline__ void gemv_split_rows_pass(
    Matrix<F> M, int rows, const float* __restrict__ xs, int stride, int n, float* part, int warp,
    int lane, typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B], Out out, int cta,
    const float* __restrict__ bias, const float (&scale)[MK_P]) {
  using P = Split<F, K, SPLIT>;
  using L = typename F::Load;
  using S = typename P::Shape;
  constexpr bool PIPE = S::N <= S::B;
  constexpr int R = PINGPONG ? kSplitSlots / MK_P / 2 * 2 : kSplitSlots / MK_P;
  static_assert(R >= (PINGPONG ? 2 : 1), "a whole round must end with the next row in pre");
  const int units = gridDim.x * P::GROUPS;
  const int g = warp / P::S, s = warp % P::S;
  const int u0 = cta * P::GROUPS + g;
  const int iters = (rows - cta * P::GROUPS + units - 1) / units;  // max over groups
  const float* xp = xs + s * P::KP;
  const RowScales<F> scales(M, u0, units, iters, rows, lane);
  auto row = [&](L(&cur)[S::B], L(&nxt)[S::B], int it, int it0) {
    const int r = u0 + it * units;
    const int rn = r + units;
    const auto wn = M.at((size_t)(rn < rows ? rn : (r < rows ? r : rows - 1)) * K + s * P::KP);
    if (PIPE) issue_first<F, P::KP, kBatch>(nxt, wn, lane, rn < rows);
    float d[MK_P];
#pragma unroll
    for (int q = 0; q < MK_P; ++q) d[q] = 0.f;
    if (r < rows) {
      row_partials<F, P::KP, kBatch>(cur, M.at((size_t)r * K + s * P::KP), xp, stride, n, lane, d);
#pragma unroll
      for (int q = 0; q < MK_P; ++q) d[q] = warp_sum(d[q]);
    }
    if constexpr (F::kScaled) {
      const float sc = r < rows ? scales.at(M, it, r) : 0.f;
#pragma unroll
      for (int q = 0; q < MK_P; ++q) d[q] *= sc;
    }
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < MK_P; ++q) part[warp * kSplitSlots + (it - it0) * MK_P + q] = d[q];
    }
    if (!PIPE) issue_first<F, P::KP, kBatch>(nxt, wn, lane, rn < rows);
  };
  for (int it0 = 0; it0 < iters; it0 += R) {
    const int it1 = min(iters, it0 + R);
    split_round<PINGPONG>(row, pre, it0, it1);
    __syncthreads();
    // Thread (group gg, slot j, position q) adds the slices of row u(gg) + (it0 + j) * units.
    for (int t = threadIdx.x; t < P::GROUPS * R * MK_P; t += kThreads) {
      const int q = t % MK_P, j = (t / MK_P) % R, gg = t / (MK_P * R);
      const int r = cta * P::GROUPS + gg + (it0 + j) * units;
      if (q < n && it0 + j < it1 && r < rows) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < P::S; ++k) v += part[(gg * P::S + k) * kSplitSlots + j * MK_P + q];
        v *= pick(scale, q);
        if (bias) v += bias[r];
        out(q, r, v);
      }
    }
    __syncthreads();
  }
}

// gemv_split_rows over a pass's n inputs where the step leaves units idle (rows <= units):
// n x rows virtual rows (position q of row r is virtual row q rows + r), dealt to the units as
// a step deals its rows and each computed by the step's own row code with position q's input,
// so each position is the step's to the bit and no lane dots more than a step's lane does
// for a row; a later position reads its row again (from L2). out(q, r, value).
template <int K, int SPLIT, class F, class Out>
__device__ __forceinline__ void gemv_split_rows_spread(
    Matrix<F> M, int rows, const float* __restrict__ xs, int stride, int n, float* part,
    int warp, int lane, typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B], Out out, int cta,
    const float* __restrict__ bias, const float (&scale)[MK_P]) {
  using P = Split<F, K, SPLIT>;
  using L = typename F::Load;
  using S = typename P::Shape;
  constexpr bool PIPE = S::N <= S::B;
  const int units = gridDim.x * P::GROUPS;
  const int g = warp / P::S, s = warp % P::S;
  const int u0 = cta * P::GROUPS + g;
  const int vrows = n * rows;
  const int iters = (vrows - cta * P::GROUPS + units - 1) / units;  // max over groups
  // Virtual row v's slice (clamped: always a valid address).
  auto slice = [&](int v) {
    const int vv = v < vrows ? v : vrows - 1;
    return M.at((size_t)(vv % rows) * K + s * P::KP);
  };
  // The stage before issued row min(u0, rows - 1) (split_first): a unit whose first virtual
  // row is a later position's issues its own.
  if (u0 >= rows && u0 < vrows) issue_first<F, P::KP, kBatch>(pre, slice(u0), lane);
  auto row = [&](L(&cur)[S::B], L(&nxt)[S::B], int it, int it0) {
    const int v = u0 + it * units;
    const int vn = v + units;
    if (PIPE) issue_first<F, P::KP, kBatch>(nxt, slice(vn), lane, vn < vrows);
    float d = 0.f;
    if (v < vrows) {
      const int q = v / rows, r = v - q * rows;
      d = warp_sum(row_partial<F, P::KP, kBatch>(cur, M.at((size_t)r * K + s * P::KP),
                                                 xs + q * stride + s * P::KP, lane));
      if constexpr (F::kScaled) d *= M.row_scale(r);
    }
    if (lane == 0) part[warp * kSplitSlots + (it - it0)] = d;
    if (!PIPE) issue_first<F, P::KP, kBatch>(nxt, slice(vn), lane, vn < vrows);
  };
  for (int it0 = 0; it0 < iters; it0 += kSplitSlots) {
    const int it1 = min(iters, it0 + kSplitSlots);
    split_round<false>(row, pre, it0, it1);
    __syncthreads();
    // Thread (group gg, slot j) adds the slices of virtual row u(gg) + (it0 + j) * units.
    for (int t = threadIdx.x; t < P::GROUPS * kSplitSlots; t += kThreads) {
      const int gg = t / kSplitSlots, j = t % kSplitSlots;
      const int v = cta * P::GROUPS + gg + (it0 + j) * units;
      if (it0 + j < it1 && v < vrows) {
        const int q = v / rows, r = v - q * rows;
        float x = 0.f;
#pragma unroll
        for (int k = 0; k < P::S; ++k) x += part[(gg * P::S + k) * kSplitSlots + j];
        x *= pick(scale, q);
        if (bias) x += bias[r];
        out(q, r, x);
      }
    }
    __syncthreads();
  }
}

// gemv_pairs over a pass's n inputs where the step leaves warps idle (pairs <= step): n x
// pairs virtual pairs (position q of pair p is q pairs + p), each by the step's own pair code
// with position q's input, so each position is the step's to the bit. out(q, pair, gate, up).
template <int K, class F, class Out>
__device__ __forceinline__ void gemv_pairs_spread(
    Matrix<F> M, int pairs, int p0, int step, const float* __restrict__ xs, int stride, int n,
    int lane, typename F::Load (&pre0)[RowShape<F, K, MK_BATCH2>::B],
    typename F::Load (&pre1)[RowShape<F, K, MK_BATCH2>::B], Out out) {
  using S = RowShape<F, K, MK_BATCH2>;
  const int vpairs = n * pairs;
  // The stage before issued pair min(p0, pairs - 1) (issue_pair_rows): a warp whose first
  // virtual pair is a later position's issues its own.
  if (p0 >= pairs && p0 < vpairs) {
    const size_t pp = (size_t)(p0 % pairs);
    issue_first<F, K, MK_BATCH2>(pre0, M.at((2 * pp) * K), lane);
    issue_first<F, K, MK_BATCH2>(pre1, M.at((2 * pp + 1) * K), lane);
  }
  for (int v = p0; v < vpairs; v += step) {
    typename F::Load n0[S::B], n1[S::B];
    const int q = v / pairs, p = v - q * pairs;
    const int vn = v + step;
    const size_t pn = (size_t)((vn < vpairs ? vn : v) % pairs);
    const float* x = xs + q * stride;
    const float a = row_partial<F, K, MK_BATCH2>(pre0, M.at((size_t)(2 * p) * K), x, lane);
    const float b = row_partial<F, K, MK_BATCH2>(pre1, M.at((size_t)(2 * p + 1) * K), x, lane);
    if constexpr (F::kScaled)
      out(q, p, warp_sum(a) * M.row_scale(2 * (size_t)p),
          warp_sum(b) * M.row_scale(2 * (size_t)p + 1));
    else
      out(q, p, warp_sum(a), warp_sum(b));
    issue_first<F, K, MK_BATCH2>(n0, M.at((2 * pn) * K), lane, vn < vpairs);
    issue_first<F, K, MK_BATCH2>(n1, M.at((2 * pn + 1) * K), lane, vn < vpairs);
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      pre0[i] = n0[i];
      pre1[i] = n1[i];
    }
  }
}

// Whether a pass's GEMV over `units` (rows, or gate/up pairs) deals each position of a unit to
// its own warp or group (the *_spread loops) rather than dotting each loaded chunk with every
// position: where the step leaves units idle on a full Hopper grid. Known at compile time, so
// the other loops are not built: they cost the pass build registers and spills at every n.
__host__ __device__ constexpr bool pass_spreads(int units, int units_per_cta) {
  return units <= MK_SMS * units_per_cta;
}

// gemv_pairs over a pass's n inputs: out(q, pair, gate, up); PAIRS = pairs.
template <int K, int PAIRS, class F, class Out>
__device__ __forceinline__ void gemv_pairs_pass(
    Matrix<F> M, int pairs, int p0, int step, const float* __restrict__ xs, int stride, int n,
    int lane, typename F::Load (&pre0)[RowShape<F, K, MK_BATCH2>::B],
    typename F::Load (&pre1)[RowShape<F, K, MK_BATCH2>::B], Out out) {
  using S = RowShape<F, K, MK_BATCH2>;
  if (n == 1) {  // a draftless pass: the step's own loop
    gemv_pairs<K>(M, pairs, p0, step, xs, lane, pre0, pre1,
                  [&](int pp, float g, float u) { out(0, pp, g, u); });
    return;
  }
  if constexpr (pass_spreads(PAIRS, kWarps)) {
    gemv_pairs_spread<K>(M, pairs, p0, step, xs, stride, n, lane, pre0, pre1, out);
    return;
  }
  const int count = 2 * ((pairs - p0 + step - 1) / step);
  float sc = 1.f;
  if constexpr (F::kScaled) {
    const size_t r = 2 * ((size_t)p0 + (size_t)(lane >> 1) * step) + (lane & 1);
    if (lane < count && r < 2 * (size_t)pairs) sc = M.row_scale(r);
  }
  for (int p = p0, k = 0; p < pairs; p += step, ++k) {
    typename F::Load n0[S::B], n1[S::B];
    const int pn = p + step;
    const size_t q2 = (size_t)(pn < pairs ? pn : p);
    float a[MK_P], b[MK_P];
    row_partials<F, K, MK_BATCH2>(pre0, M.at((size_t)(2 * p) * K), xs, stride, n, lane, a);
    row_partials<F, K, MK_BATCH2>(pre1, M.at((size_t)(2 * p + 1) * K), xs, stride, n, lane, b);
    float s0 = 1.f, s1 = 1.f;
    if constexpr (F::kScaled) {
      const bool held = 2 * k + 1 < 32;
      s0 = held ? __shfl_sync(0xffffffffu, sc, 2 * k) : M.row_scale(2 * (size_t)p);
      s1 = held ? __shfl_sync(0xffffffffu, sc, 2 * k + 1) : M.row_scale(2 * (size_t)p + 1);
    }
#pragma unroll
    for (int q = 0; q < MK_P; ++q) {
      if (q < n) {
        if constexpr (F::kScaled)
          out(q, p, warp_sum(a[q]) * s0, warp_sum(b[q]) * s1);
        else
          out(q, p, warp_sum(a[q]), warp_sum(b[q]));
      }
    }
    issue_first<F, K, MK_BATCH2>(n0, M.at((2 * q2) * K), lane, pn < pairs);
    issue_first<F, K, MK_BATCH2>(n1, M.at((2 * q2 + 1) * K), lane, pn < pairs);
#pragma unroll
    for (int i = 0; i < S::B; ++i) {
      pre0[i] = n0[i];
      pre1[i] = n1[i];
    }
  }
}

// gemv_split over a pass's n inputs (xs + q stride): out(q, r, value). A tile format runs
// gemv_tiles once a position, its first batch issued again for each later one. ROWS: the
// rows where known at compile time (0: not, as the LM head's drawn share).
template <int K, int SPLIT, int ROWS, bool PINGPONG = false, class F, class Out>
__device__ __forceinline__ void gemv_split_pass(
    Matrix<F> M, int rows, float* xs, int stride, int n, float* part, int warp, int lane,
    typename F::Load (&pre)[Split<F, K, SPLIT>::Shape::B], Out out, int cta,
    const float* __restrict__ bias, const float (&scale)[MK_P]) {
  if constexpr (!F::kTiles) {
    if (n > 1) {
      if constexpr (!PINGPONG && ROWS > 0 && pass_spreads(ROWS, Split<F, K, SPLIT>::GROUPS))
        gemv_split_rows_spread<K, SPLIT>(M, rows, xs, stride, n, part, warp, lane, pre, out, cta,
                                         bias, scale);
      else
        gemv_split_rows_pass<K, SPLIT, PINGPONG>(M, rows, xs, stride, n, part, warp, lane, pre,
                                                 out, cta, bias, scale);
      return;
    }
  }
  // A draftless pass (one position) runs the step's own loop.
  for (int q = 0; q < n; ++q) {
    if (q) issue_split_first<K, SPLIT>(pre, M, rows, warp, lane, cta);
    gemv_split<K, SPLIT, PINGPONG>(
        M, rows, xs + q * stride, part, warp, lane, pre, [&](int r, float v) { out(q, r, v); },
        cta, bias, pick(scale, q));
  }
}
