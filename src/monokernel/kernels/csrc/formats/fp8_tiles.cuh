// fp8.cuh's E4M3 weights (one fp32 scale a row) in tiles of 16 rows (weights/formats/
// tiles.py's byte tiles), multiplied on the tensor cores (gemv_tiles.cuh): the CUDA cores' widening
// sits on each warp's serial path (perf-notes step 66: fp8 rows at ~80% of the copy rate
// where bf16 rows reach ~95%), mma.m16n8k16 streamed fp8 at 92-95% in the skinny-GEMV bench.
//
// Layout, in tiles of 16 rows: a warp's 16-byte loads (one a lane) cover the tile's 32 columns
// c .. c + 31, 512 contiguous bytes, [rows / 16][K / 32][32 lanes][16]. Bytes 8i .. 8i + 7 of
// lane l (g = l / 4, t = l % 4) are k-tile i of those columns in mma's A-fragment order,
// (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8) (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9): each
// 16-bit half is one A register, widened by one cvt to an exact f16 pair. The inputs are f16
// hi + lo (gemv_tiles.cuh tile_inputs) and the row's scale multiplies the lane's partial
// (Fp8Tiles), or each block's scale its load's product (Fp8BlockTiles).
#pragma once
#include "../mma.cuh"
#include "plain_rows.cuh"

// One load's 32 columns (2 k-tiles) of the lane's tile row (g for lanes t < 2, g + 8 for the
// others) dotted with the input. xl: the lane's B fragments of the load's first k-tile.
__device__ __forceinline__ float fp8_tile_dot(const uint4 u, const float* __restrict__ xl,
                                              bool upper) {
  const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
  float c[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t a[4] = {e4m3x2_f16x2(wd[2 * h], 0), e4m3x2_f16x2(wd[2 * h], 1),
                           e4m3x2_f16x2(wd[2 * h + 1], 0), e4m3x2_f16x2(wd[2 * h + 1], 1)};
    const uint2 x = *reinterpret_cast<const uint2*>(xl + 16 * h);
    if (h == 0)
      mma_f16_first(c, a, x.x, x.y);
    else
      mma_f16(c, a, x.x, x.y);
  }
  return upper ? c[2] : c[0];
}

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

  // Load j's 32 columns of the lane's tile row into acc (fp8_tile_dot); no block state.
  __device__ static __forceinline__ void tile_dot(const Load& u, const float* __restrict__ xl,
                                                  bool upper, int, float&, float& acc) {
    acc += fp8_tile_dot(u, xl, upper);
  }
};

// The same tiles with a float32 scale per row and block of BN columns (a checkpoint's block
// scales, repeated over each block's rows: weights/formats/fp8.py), the bits as stored:
// [rows / 16][K / BN][16] floats, the 16 rows of a tile's block together, so a warp's load
// reads 64 contiguous bytes of them. The lane's load carries its row's scale for the load's
// block, which multiplies the load's product: no row scale at the end.
template <int BN>
struct Fp8BlockTiles {
  static_assert(BN >= 64 && (BN & (BN - 1)) == 0,
                "a block is a power of two of 64 columns or more (build.py checks)");
  static constexpr int kBlockLoads = BN / 32;  // a lane's loads a block
  using Elem = uint8_t;
  static constexpr bool kTiles = true;
  static constexpr int kTileRows = 16;
  static constexpr int kPerLoad = 16;
  static constexpr int kLoadCols = 32;
  static constexpr int kSliceCols = BN;  // a split-K slice starts on a block
  static constexpr bool kScaled = false;  // the blocks' scales, not a row's
  static constexpr float kUnit = 1.f;
  static constexpr bool kGroups = false;
  static constexpr int kSumCols = 0;
  static constexpr bool kF16 = true;

  struct Ptr {
    const uint4* w;   // a tile slice's first load (lane 0's)
    const float* s;   // its first block's 16 row scales
  };
  struct Load {
    uint4 w;
    // The scale of the lane's row (g for t < 2, else g + 8) for the load's block, read by a
    // block's first load only (tile_dot): in the others it is dead, and with batches of
    // whole blocks the compiler sees which those are, drops their reads and frees their
    // registers.
    float s;
  };

  __device__ static __forceinline__ Ptr tile_at(const uint8_t* rows, const float* scales,
                                                size_t tile, int c0, int K) {
    return {reinterpret_cast<const uint4*>(rows + (tile * (size_t)K + c0) * kTileRows),
            scales + (tile * (size_t)(K / BN) + c0 / BN) * kTileRows};
  }
  // Chunk c = 32 j + lane of a slice: lane's load j.
  __device__ static __forceinline__ Load load(Ptr p, int c) {
    Load u;
    const int j = c >> 5, lane = c & 31;
    u.w = ld_stream(p.w + c);
    u.s = __ldg(p.s + (kLoadCols * j / BN) * kTileRows + (lane >> 2) + ((lane & 2) ? 8 : 0));
    return u;
  }
  __device__ static __forceinline__ Load zero() {
    Load u;
    u.w = make_uint4(0u, 0u, 0u, 0u);
    u.s = 0.f;
    return u;
  }
  // Load j of the slice: a block's first load sets the block's scale `block`.
  __device__ static __forceinline__ void tile_dot(const Load& u, const float* __restrict__ xl,
                                                  bool upper, int j, float& block, float& acc) {
    if ((j & (kBlockLoads - 1)) == 0) block = u.s;
    acc = fmaf(block, fp8_tile_dot(u.w, xl, upper), acc);
  }
};
