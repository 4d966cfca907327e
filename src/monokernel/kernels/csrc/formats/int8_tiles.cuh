// Byte weights with a float32 scale a and offset b per group of G input columns of a row
// (weights/formats/int8.py's groups): w = a u + b, u one unsigned byte. It holds GGUF's 5-,
// 6- and 8-bit block types with their values unchanged (weights/gguf_8bit.py), in 16-row
// tiles multiplied on the tensor cores (gemv_tiles.cuh).
//
// Layout: tiles.py's byte tiles, as fp8_tiles.cuh's ([rows / 16][K / 32][32 lanes][16]: a
// warp's loads cover 32 columns of a tile, each 16-bit half of a lane's load one A register).
// A byte widens to f16 by one byte permute: 0x64 above u is 1024 + u exactly. The pairs:
// [rows / 16][K / G][8][4] float32, for lane group g (a, b - 1024 a) of row g, then of row
// g + 8 (int4_tiles.cuh's order): the tensor cores sum C = sum (1024 + u) x over a group and
// the lane adds a C + (b - 1024 a) s, s the group's sum of x (gemv_tiles.cuh tile_inputs).
// A load of 32 columns meets two groups of 16 (a GGUF Q6_K's) or one of 32: kSegs pairs.
#pragma once
#include "../mma.cuh"
#include "group_pairs.cuh"

template <int G>
struct Int8GroupTiles : GroupPairTiles<32, G> {
  static_assert(G == 16 || G == 32, "groups of 16 or 32 columns (build.py checks)");
  using Elem = uint8_t;
  static constexpr bool kTiles = true;
  static constexpr int kTileRows = 16;
  static constexpr int kPerLoad = 16;
  static constexpr int kLoadCols = 32;
  static constexpr int kSliceCols = 64;
  static constexpr bool kScaled = false;  // the groups' pairs, not a row's scale
  static constexpr float kUnit = 1.f;
  static constexpr bool kGroups = false;  // int4's nibble path (tile_load_dot) is not ours
  static constexpr bool kF16 = true;      // 1024 + u is an f16: inputs as f16 hi + lo
  static constexpr int kSumCols = G;      // tile_inputs' sums: one a group
  using GroupPairTiles<32, G>::kSegs;     // groups a load meets
  using Ptr = typename GroupPairTiles<32, G>::Ptr;
  using Load = typename GroupPairTiles<32, G>::Load;

  __device__ static __forceinline__ Ptr tile_at(const uint8_t* rows, const float* pairs,
                                                size_t tile, int c0, int K) {
    return {reinterpret_cast<const uint4*>(rows + (tile * (size_t)K + c0) * kTileRows),
            reinterpret_cast<const float4*>(pairs) + (tile * (K / G) + c0 / G) * 8};
  }
  // Bytes 2r, 2r + 1 of w's half r (0 or 1) as the f16 pair 1024 + u.
  __device__ static __forceinline__ uint32_t widen(uint32_t w, int r) {
    return __byte_perm(w, 0x64646464u, r ? 0x4342 : 0x4140);
  }

  // Load j's 32 columns (2 k-tiles) of the lane's tile row into acc. xl: the lane's B
  // fragments of the load's first k-tile; sl: the sums of its groups.
  __device__ static __forceinline__ void tile_dot(const Load& u, const float* __restrict__ xl,
                                                  const float* __restrict__ sl, bool upper,
                                                  bool lo, float& acc) {
    const uint32_t wd[4] = {u.w.x, u.w.y, u.w.z, u.w.w};
    float c[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t a[4] = {widen(wd[2 * h], 0), widen(wd[2 * h], 1), widen(wd[2 * h + 1], 0),
                             widen(wd[2 * h + 1], 1)};
      const uint2 x = *reinterpret_cast<const uint2*>(xl + 16 * h);
      if (h == 0 || kSegs == 2)
        mma_f16_first(c, a, x.x, x.y);
      else
        mma_f16(c, a, x.x, x.y);
      if (kSegs == 2 || h == 1) {
        const float2 ab = u.ab[kSegs == 2 ? h : 0];
        acc = fmaf(ab.x, upper ? c[2] : c[0], lo ? acc : fmaf(ab.y, sl[kSegs == 2 ? h : 0], acc));
      }
    }
  }
};
