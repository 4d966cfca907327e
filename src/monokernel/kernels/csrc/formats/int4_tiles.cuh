// int4.cuh's 4-bit weights (a float32 scale a and offset b per group of G input columns of a row)
// in tiles of 16 rows (weights/formats/int4.py's tile layout), multiplied on the tensor cores
// (gemv_tiles.cuh): the CUDA cores' widening and fp32 input reads ran out of issue slots and
// shared-memory bandwidth at ~55% of HBM's rate (perf-notes step 67), mma.m16n8k16 streams
// at ~85% (step 76).
//
// Layout, in tiles of 16 rows: a warp's 16-byte loads (one a lane) cover the tile's 64 columns
// c .. c + 63, 512 contiguous bytes, [rows / 16][K / 64][32 lanes][4 words]. Word m of lane l
// (g = l / 4, t = l % 4) is k-tile m of those columns in mma's A-fragment order: nibble 4i is
// element 2i and nibble 16 + 4i element 2i + 1 of the lane's 8, (g, 2t) (g, 2t+1) (g+8, 2t)
// (g+8, 2t+1) (g, 2t+8) (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9). Registers 0 and 2 (rows g) are
// (w & 0x000F000F) | 0x64006400 and the same of w >> 8, the f16 pair 1024 + q; registers 1
// and 3 (rows g + 8) take the nibbles where they lie, (w & 0x00F000F0) | 0x64006400, the f16
// pair 1024 + 16 q: one LOP3 a register, one shift a word, all exact.
// The pairs: [rows / 16][K / G][8][4] float32, for lane group g (a', b - 1024 a') of row g,
// then of row g + 8, a' = a for rows g and a / 16 for rows g + 8 (lanes t = 0, 1 of the group
// read the first, t = 2, 3 the second): the tensor cores sum C over a group and the lane adds
// a' C + (b - 1024 a') s = a sum q x + b s, s the group's sum of x (gemv_tiles.cuh
// tile_inputs). A load of 64 columns meets one group (G >= 64, "segment" of 64 columns) or
// two (G = 32): kSegs pairs.
#pragma once
#include "group_pairs.cuh"

template <int G>
struct Int4Tiles : GroupPairTiles<64, G> {
  static_assert(G % 32 == 0 && 256 % G == 0, "a group is 32, 64, 128 or 256 columns");
  using Elem = uint8_t;  // two weights a byte: a row of K weights is K / 2 of them
  static constexpr bool kTiles = true;
  static constexpr int kTileRows = 16;     // rows a unit of the GEMV streams together
  static constexpr int kPerLoad = 32;      // weights of one lane's 16-byte load
  static constexpr int kLoadCols = 64;     // a warp-wide load's columns of the tile
  // A split-K slice starts on a load; inside a group wider than a load where the warps'
  // slices are not whole groups (gemv.cuh slice_phase).
  static constexpr int kSliceCols = 64;
  static constexpr bool kScaled = false;   // the groups' scales, not a row's
  static constexpr float kUnit = 1.f;
  static constexpr bool kGroups = true;
  static constexpr int kSumCols = 32;      // tile_inputs' sums: one a 32 columns
  static constexpr bool kF16 = true;       // inputs as f16 hi + lo (1024 + q is an f16)
  static constexpr int kGroupLoads = G > 64 ? G / 64 : 1;  // a lane's loads a group
  using Ptr = typename GroupPairTiles<64, G>::Ptr;
  using Load = typename GroupPairTiles<64, G>::Load;

  // Tile `tile`'s columns from c0 (a multiple of kSliceCols) of a matrix of K columns; its
  // pairs from those of the group c0 lies in.
  __device__ static __forceinline__ Ptr tile_at(const uint8_t* rows, const float* pairs,
                                                size_t tile, int c0, int K) {
    return {reinterpret_cast<const uint4*>(rows) + (tile * (K / 64) + c0 / 64) * 32,
            reinterpret_cast<const float4*>(pairs) + (tile * (K / G) + c0 / G) * 8};
  }
};
