// fp8.cuh's E4M3 weights (one fp32 scale a row) in tiles of 16 rows (weights/formats/
// byte_tiles.py), multiplied on the tensor cores (gemv_tiles.cuh): the CUDA cores' widening
// sits on each warp's serial path (perf-notes step 66: fp8 rows at ~80% of the copy rate
// where bf16 rows reach ~95%), mma.m16n8k16 streamed fp8 at 92-95% in the skinny-GEMV bench.
//
// Layout, in tiles of 16 rows: a warp's 16-byte loads (one a lane) cover the tile's 32 columns
// c .. c + 31, 512 contiguous bytes, [rows / 16][K / 32][32 lanes][16]. Bytes 8i .. 8i + 7 of
// lane l (g = l / 4, t = l % 4) are k-tile i of those columns in mma's A-fragment order,
// (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8) (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9): each
// 16-bit half is one A register, widened by one cvt to an exact f16 pair. The inputs are f16
// hi + lo (gemv_tiles.cuh tile_inputs) and the row's scale multiplies the lane's partial.
#pragma once
#include "../mma.cuh"
#include "plain_rows.cuh"

struct Fp8Tiles : PlainRows<uint8_t> {
  static constexpr bool kTiles = true;
  static constexpr int kTileRows = 16;    // rows a unit of the GEMV streams together
  static constexpr int kPerLoad = 16;     // weights of one lane's 16-byte load
  static constexpr int kLoadCols = 32;    // a warp-wide load's columns of the tile
  static constexpr int kSliceCols = 64;   // a split-K slice: whole 64-column input blocks
  static constexpr bool kScaled = true;   // a row's scale, read by the lane streaming the row
  static constexpr float kUnit = 1.f;     // the widening is exact: no fixed factor
  static constexpr bool kF16 = true;      // inputs as f16 hi + lo (E4M3 widens to f16)

  // Tile `tile`'s columns from c0 (a multiple of kSliceCols) of a matrix of K columns.
  __device__ static __forceinline__ Ptr tile_at(const uint8_t* rows, const float*, size_t tile,
                                                int c0, int K) {
    return rows + (tile * (size_t)K + c0) * kTileRows;
  }

  // One load's 32 columns (2 k-tiles) of the lane's tile row (g for lanes t < 2, g + 8 for the
  // others) into acc. xl: the lane's B fragments of the load's first k-tile.
  __device__ static __forceinline__ void tile_dot(const Load& u, const float* __restrict__ xl,
                                                  bool upper, float& acc) {
    const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
    float c[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t a[4] = {e4m3x2_f16x2(wd[2 * h], 0), e4m3x2_f16x2(wd[2 * h], 1),
                             e4m3x2_f16x2(wd[2 * h + 1], 0), e4m3x2_f16x2(wd[2 * h + 1], 1)};
      const uint4 x = *reinterpret_cast<const uint4*>(xl + 16 * h);
      if (h == 0)
        mma_f16_first(c, a, x.x, x.z);
      else
        mma_f16(c, a, x.x, x.z);
      mma_f16(c, a, x.y, x.w);
    }
    acc += upper ? c[2] : c[0];
  }
};
