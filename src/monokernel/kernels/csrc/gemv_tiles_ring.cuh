// The tile GEMV (gemv_tiles.cuh) with its weights brought into shared memory by the copy
// engine (bulk_copy.cuh) instead of register batches. In registers a warp keeps at most one
// batch in flight behind the one it multiplies, and ptxas, short of registers at 512 threads,
// sinks the next batch's loads below the multiplies and copies the batch in flight between
// buffers (waiting for it): the 4-bit and fp8 stages streamed at 60-90% of the copy rate
// where bf16 rows reach ~95%. Here each warp has a ring of NS slots; a slot is RB of its
// loads (with their group pairs), filled by one bulk copy issued NS slots ahead, so NS - 1
// slots a warp stay in flight whatever the registers.
//
// The ring lives in the K/V window's rows (attention_window.cuh), which nothing uses from the
// end of stage B until the attention prefetch at stage D's hand-off: stage D streams through
// it, started at stage C's hand-off (ring_start, in place of the first register batch).
#pragma once
#include "bulk_copy.cuh"

#ifndef MK_TILE_RING
#define MK_TILE_RING 1
#endif
#ifndef MK_RING_NS
#define MK_RING_NS 4
#endif

// The window's K and V rows (bf16 [CHUNK, D] each), dealt to the warps in 128-byte units.
constexpr int kRingWarpBytes = MK_ATTN_CHUNK * MK_D * 4 / kWarps / 128 * 128;

template <class F>
constexpr int pair_bytes(int rb, bool lanes, int groups) {
  if constexpr (F::kPairCols > 0)
    return lanes ? rb * F::kSegs * 256 : 128 * groups;
  else
    return 0;
}

// A warp's ring for the tile GEMV of format F over K columns split SPLIT ways:
// [NS mbarriers, padded to 128 bytes][NS slots]; a slot is RB loads' weights
// [RB][32 lanes][16 bytes], then the pairs of the groups they meet [groups][8][4] float32.
template <class F, int K, int SPLIT>
struct TileRing {
  using P = Split<F, K, SPLIT>;
  static constexpr int N = P::Shape::N;  // loads a lane's tile slice
  // Loads a slot: two (1 KB), or a whole group where a group is wider.
  static constexpr int RB = F::kPairCols > 2 * F::kLoadCols ? F::kPairCols / F::kLoadCols : 2;
  static constexpr bool kLanes = MK_TILE_RING == 2;  // per-lane cp.async, not bulk copies
  static constexpr int kPairGroups =
      F::kPairCols > 0 ? (RB * F::kLoadCols + F::kPairCols - 1) / F::kPairCols : 0;
  static constexpr int kWeightBytes = RB * 512;
  static constexpr int kPairBytes = pair_bytes<F>(RB, kLanes, kPairGroups);
  static constexpr int kSlotBytes = kWeightBytes + kPairBytes;
  static constexpr int NS =
      cmin(kLanes ? MK_RING_NS : 8, (kRingWarpBytes - 128) / kSlotBytes);  // slots a warp
  static constexpr int NSL = (N + RB - 1) / RB;                            // slots a slice
  // Block-scaled fp8 (kPairCols < 0) keeps the register batches; so does a window too small
  // for three slots a warp (tests force windows of 32 positions).
  static constexpr bool kOn = MK_TILE_RING && F::kPairCols >= 0 && NS >= 3;

  __device__ static __forceinline__ unsigned char* base(float* win, int warp) {
    return reinterpret_cast<unsigned char*>(win) + warp * kRingWarpBytes;
  }
  __device__ static __forceinline__ unsigned long long* bar(unsigned char* base, int k) {
    return reinterpret_cast<unsigned long long*>(base) + k;
  }
  __device__ static __forceinline__ unsigned char* slot(unsigned char* base, int k) {
    return base + 128 + k * kSlotBytes;
  }

  // One thread: slot b of tile t's slice (from column c0) into `dst`, completing on `mbar`.
  __device__ static __forceinline__ void issue(Matrix<F> M, int t, int b, int c0,
                                               unsigned char* dst, unsigned long long* mbar) {
    const auto p = F::tile_at(M.rows, M.scales, (size_t)t, c0, K);
    const int j0 = b * RB, nb = cmin(RB, N - j0);
    if constexpr (F::kPairCols > 0) {
      const int ng = (nb * F::kLoadCols + F::kPairCols - 1) / F::kPairCols;
      mbar_expect(mbar, nb * 512 + ng * 128);
      bulk_copy(dst, p.w + 32 * j0, nb * 512, mbar);
      bulk_copy(dst + kWeightBytes, p.ab + (j0 * F::kLoadCols / F::kPairCols) * 8, ng * 128,
                mbar);
    } else {
      mbar_expect(mbar, nb * 512);
      bulk_copy(dst, reinterpret_cast<const uint4*>(p) + 32 * j0, nb * 512, mbar);
    }
  }

  // Each lane its own loads of slot b (and the pairs its dot reads) into `dst`, as one
  // cp.async group (committed even when empty: the groups count slots).
  __device__ static __forceinline__ void issue_lane(Matrix<F> M, int t, int b, int c0,
                                                    unsigned char* dst, int lane, bool live) {
    if (live) {
      const auto p = F::tile_at(M.rows, M.scales, (size_t)t, c0, K);
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        const int j = b * RB + i;
        if (j < N) {
          const uint4* w;
          if constexpr (F::kPairCols > 0)
            w = p.w;
          else
            w = reinterpret_cast<const uint4*>(p);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                           smem_addr(dst + (i * 32 + lane) * 16)),
                       "l"(w + 32 * j + lane)
                       : "memory");
          if constexpr (F::kPairCols > 0) {
            const int g = lane >> 2, half = (lane >> 1) & 1;
            const float2* ab = reinterpret_cast<const float2*>(p.ab);
#pragma unroll
            for (int h = 0; h < F::kSegs; ++h) {
              // A wide group's later loads read the pair of its first (tile_load_dot).
              if (F::kPairCols > F::kLoadCols && (j * F::kLoadCols) % F::kPairCols) continue;
              asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(
                               dst + kWeightBytes + ((i * F::kSegs + h) * 32 + lane) * 8)),
                           "l"(ab + (((F::kLoadCols * j + F::kSegCols * h) / F::kPairCols) * 8 +
                                     g) * 2 + half)
                           : "memory");
            }
          }
        }
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  __device__ static __forceinline__ typename F::Load load_lane(const unsigned char* src, int i,
                                                               int lane) {
    const uint4 w = reinterpret_cast<const uint4*>(src)[i * 32 + lane];
    if constexpr (F::kPairCols > 0) {
      typename F::Load u;
      u.w = w;
      const float2* ab = reinterpret_cast<const float2*>(src + kWeightBytes);
#pragma unroll
      for (int h = 0; h < F::kSegs; ++h) u.ab[h] = ab[(i * F::kSegs + h) * 32 + lane];
      return u;
    } else {
      return w;
    }
  }

  // The lane's load i of a slot, as F::load would have brought it.
  __device__ static __forceinline__ typename F::Load load(const unsigned char* src, int i,
                                                          int lane) {
    const uint4 w = reinterpret_cast<const uint4*>(src)[i * 32 + lane];
    if constexpr (F::kPairCols > 0) {
      typename F::Load u;
      u.w = w;
      const float2* ab = reinterpret_cast<const float2*>(src + kWeightBytes);
      const int g = lane >> 2, half = (lane >> 1) & 1;
#pragma unroll
      for (int h = 0; h < F::kSegs; ++h)
        u.ab[h] = ab[(((F::kLoadCols * i + F::kSegCols * h) / F::kPairCols) * 8 + g) * 2 + half];
      return u;
    } else {
      return w;
    }
  }
};

// Lane 0 of each warp: the ring's mbarriers, and its first NS slots on their way, before the
// stage waits for its input. The window's last ordinary reads (stage B) come before.
template <int K, int SPLIT, class F>
__device__ __forceinline__ void ring_start(Matrix<F> M, int rows, int warp, int lane, int cta,
                                           float* win) {
  using T = TileRing<F, K, SPLIT>;
  if constexpr (T::kLanes) {
    const TileWalk<typename T::P> wk(rows, warp, cta);
    unsigned char* base = T::base(win, warp);
    fence_async_shared();
    const int total = wk.iters * T::NSL;
#pragma unroll
    for (int k = 0; k < T::NS - 1; ++k) {
      const int it = k / T::NSL, t = wk.tile(it);
      T::issue_lane(M, t, k - it * T::NSL, wk.c0, T::slot(base, k), lane,
                    k < total && t < wk.tiles);
    }
    return;
  }
  if (lane == 0) {
    const TileWalk<typename T::P> wk(rows, warp, cta);
    unsigned char* base = T::base(win, warp);
#pragma unroll
    for (int k = 0; k < T::NS; ++k) mbar_init(T::bar(base, k));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_async_shared();
    const int total = wk.iters * T::NSL;
#pragma unroll
    for (int k = 0; k < T::NS; ++k) {
      const int it = k / T::NSL, t = wk.tile(it);
      if (k < total && t < wk.tiles)
        T::issue(M, t, k - it * T::NSL, wk.c0, T::slot(base, k), T::bar(base, k));
    }
  }
  __syncwarp();
}

// gemv_tiles through the ring that ring_start began (same arguments, no register batch):
// slot s of the warp's stream is slot s % NSL of tile s / NSL's slice, in ring slot s % NS,
// phase (s / NS) & 1. Once a slot is multiplied, lane 0 refills it with stream slot s + NS.
// All threads of the CTA must call; the ring's mbarriers are invalidated before the last
// round's barrier, so the window is free again when it returns.
template <int K, int SPLIT, class F, class Out2>
__device__ __forceinline__ void gemv_tiles_ring(Matrix<F> M, int rows, float* xs, float* sums,
                                                float* part, int warp, int lane, Out2 out2,
                                                int cta, float* win) {
  using T = TileRing<F, K, SPLIT>;
  using P = typename T::P;
  constexpr int R = kTileRound;
  tile_inputs<K, F>(xs, sums);
  const TileWalk<P> wk(rows, warp, cta);
  const float* xl = wk.xl(xs, lane);
  const float* sl = wk.sl(sums);
  const bool upper = lane & 2;  // this lane's row: g + 8, else g
  unsigned char* base = T::base(win, warp);
  const int total = wk.iters * T::NSL;
  float acc = 0.f, sc = 1.f;
  float block = 0.f;  // unused: block-scaled formats keep the register batches
  float2 pair = make_float2(0.f, 0.f);  // a wide group's pair (tile_load_dot)
  auto invalidate = [&] {
    if (!T::kLanes && lane == 0) {
#pragma unroll
      for (int k = 0; k < T::NS; ++k) mbar_inval(T::bar(base, k));
    }
  };
  for (int it0 = 0; it0 < wk.iters; it0 += R) {
    const int it1 = min(wk.iters, it0 + R);
#pragma unroll 1
    for (int s = it0 * T::NSL; s < it1 * T::NSL; ++s) {
      const int it = s / T::NSL, b = s - it * T::NSL;
      const int t = wk.tile(it);
      const int k = s % T::NS;
      unsigned char* slot = T::slot(base, k);
      if (b == 0) {
        acc = 0.f;
        if constexpr (F::kScaled)
          sc = M.row_scale((size_t)(t < wk.tiles ? t : wk.tiles - 1) * 16 + (lane >> 2) +
                           (upper ? 8 : 0));
      }
      if constexpr (T::kLanes) {
        // Slot s + NS - 1 into the ring slot slot s - 1 left (this lane read it last round).
        const int sn = s + T::NS - 1, itn = sn / T::NSL, tn = wk.tile(itn);
        T::issue_lane(M, tn, sn - itn * T::NSL, wk.c0, T::slot(base, sn % T::NS), lane,
                      sn < total && tn < wk.tiles);
        asm volatile("cp.async.wait_group %0;" ::"n"(T::NS - 1) : "memory");
        if (t < wk.tiles) {
#pragma unroll
          for (int i = 0; i < T::RB; ++i) {
            const int j = b * T::RB + i;
            if (j < T::N)
              tile_slice_dot<F>(T::load_lane(slot, i, lane), j, xl, sl, upper, pair, block, acc);
          }
        }
      } else if (t < wk.tiles) {
        mbar_wait(T::bar(base, k), (s / T::NS) & 1);
#pragma unroll
        for (int i = 0; i < T::RB; ++i) {
          const int j = b * T::RB + i;
          if (j < T::N)
            tile_slice_dot<F>(T::load(slot, i, lane), j, xl, sl, upper, pair, block, acc);
        }
      }
      if constexpr (!T::kLanes) __syncwarp();  // every lane has read the slot
      const int sn = s + T::NS;
      if (!T::kLanes && lane == 0 && sn < total) {
        const int itn = sn / T::NSL, tn = wk.tile(itn);
        if (tn < wk.tiles) {
          fence_async_shared();
          T::issue(M, tn, sn - itn * T::NSL, wk.c0, slot, T::bar(base, k));
        }
      }
      if (b == T::NSL - 1) {
        float v = acc;
        if constexpr (F::kScaled) v *= sc;
        if ((lane & 1) == 0) part[(warp * R + it - it0) * 16 + (lane >> 2) + (upper ? 8 : 0)] = v;
      }
    }
    if (it1 == wk.iters) invalidate();
    __syncthreads();
    tile_combine<P>(part, it0, it1, wk.units, wk.tiles, cta, out2);
    __syncthreads();
  }
  if (wk.iters == 0) {
    invalidate();
    __syncthreads();
  }
}
