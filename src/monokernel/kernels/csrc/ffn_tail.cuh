// Stage D's last, partial round of gate/up pairs, spread over every warp of the CTA.
//
// D deals its pairs to the grid's warps round by round. When the pairs do not fill the last
// round (Qwen2.5-Coder-1.5B on 132 SMs: 8,960 pairs = 4 rounds of 2,112 + 512), a few warps
// per CTA stream one more pair each at the end, three dependent round trips a pair, with the
// SM's other warps idle: per-SM bandwidth then bounds that round. Here the round's pairs are
// copied into shared memory while the whole rounds stream (the same bytes, just earlier),
// and once every warp is done with its whole rounds, each warp dots a K-slice of one row
// from shared memory: no round trip at the stage's end.
#pragma once
#include "common.cuh"
#include "gemv.cuh"

// 1: staged in shared memory; 2: loaded into registers at the end; 0: the last round
// streamed like the others. Measured worse both ways (docs/perf-notes.md step 38).
#ifndef MK_D_TAIL
#define MK_D_TAIL 0
#endif
#define MK_TAIL_PAIRS (MK_WARPS / 4)             // a CTA's tail pairs at most
#define MK_TAIL_SLICES (MK_WARPS / (2 * MK_TAIL_PAIRS))  // warps per tail row

struct PairTail {
  int whole;  // pairs of the whole rounds: the warps stream [0, whole) as before
  int first;  // this CTA's first tail pair; its others follow every `grid`
  int n;      // this CTA's tail pairs (<= MK_TAIL_PAIRS)
  bool on;
};

// The tail of `pairs` pairs on `tw` warps of `grid` CTAs: pair whole + j goes to CTA j % grid.
// On when the partial round leaves each CTA at most MK_TAIL_PAIRS pairs, they fit the
// shared memory given (`room` bytes), and K splits into MK_TAIL_SLICES whole chunks.
template <int K>
__device__ __forceinline__ PairTail pair_tail(int pairs, int tw, int grid, int cta, int room) {
  PairTail t;
  t.whole = pairs / tw * tw;
  const int rest = pairs - t.whole;
  const int most = (rest + grid - 1) / grid;
  t.on = MK_D_TAIL && rest > 0 && most <= MK_TAIL_PAIRS &&
         K % (8 * MK_TAIL_SLICES) == 0 && most * 2 * K * 2 <= room;
  if (!t.on) t.whole = pairs;
  t.first = t.whole + cta;
  t.n = t.on && rest > cta ? (rest - cta + grid - 1) / grid : 0;
  return t;
}

// Copy this CTA's tail pairs (rows 2q and 2q+1 of W [2*pairs, K], contiguous) into `dst`
// [n, 2, K] bf16 with cp.async (L2 only, no registers held); waited for by tail_pairs.
template <int K>
__device__ __forceinline__ void tail_copy(const bf16* __restrict__ W, const PairTail& t, int grid,
                                          bf16* dst) {
  constexpr int PC = 2 * K / 8;  // 16-byte chunks a pair
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  for (int c = threadIdx.x; c < t.n * PC; c += MK_THREADS) {
    const int s = c / PC, o = c % PC;
    const bf16* src = W + (size_t)2 * (t.first + s * grid) * K + 8 * o;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16u * c), "l"(src)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Every warp dots one K-slice of one tail row from shared memory with xs; out(q, gate, up) is
// called once per tail pair q, by one thread. part: MK_WARPS floats of scratch. All threads
// of the CTA must call (after their whole rounds).
template <int K, class Out>
__device__ __forceinline__ void tail_pairs(const PairTail& t, int grid, const bf16* src,
                                           const bf16* __restrict__ W,
                                           const float* __restrict__ xs, float* part, int warp,
                                           int lane, Out out) {
  constexpr int KS = K / MK_TAIL_SLICES, CS = KS / 8;
  const int row = warp / MK_TAIL_SLICES, sl = warp % MK_TAIL_SLICES;  // row 2s + (gate|up)
  float acc = 0.f;
#if MK_D_TAIL == 2
  if (row < 2 * t.n) {
    const int s = row / 2;
    const uint4* w = reinterpret_cast<const uint4*>(
        W + ((size_t)2 * (t.first + s * grid) + row % 2) * K + sl * KS);
    constexpr int NL = (CS + 31) / 32;
    uint4 b[NL];
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (i * 32 + lane < CS) b[i] = ld_stream(w + i * 32 + lane);
    const float* x = xs + sl * KS;
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (i * 32 + lane < CS) acc += dot8(b[i], x, i * 32 + lane);
  }
#else
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (row < 2 * t.n) {
    const uint4* w = reinterpret_cast<const uint4*>(src + (size_t)row * K + sl * KS);
    const float* x = xs + sl * KS;
    for (int c = lane; c < CS; c += 32) acc += dot8(w[c], x, c);
  }
#endif
  acc = warp_sum(acc);
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if ((int)threadIdx.x < t.n) {
    const int s = threadIdx.x;
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int k = 0; k < MK_TAIL_SLICES; ++k) {
      g += part[(2 * s) * MK_TAIL_SLICES + k];
      u += part[(2 * s + 1) * MK_TAIL_SLICES + k];
    }
    out(t.first + s * grid, g, u);
  }
}
