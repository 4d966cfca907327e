// What the tile formats with a float32 pair a group share (int4_tiles.cuh, int8_tiles.cuh):
// a tile slice's position (its first load's weights, its first group's pairs), a lane's load
// (its 16 bytes of weights, kLoadCols columns of its tile row, and the pairs of the groups
// among them: one a segment of kSegCols columns), and how a lane reads one.
// The pairs: [rows / 16][K / G][8][4] float32, for lane group g (a, b') of row g, then of
// row g + 8; lanes t = 0, 1 of the group read the first, t = 2, 3 the second.
#pragma once
#include "../common.cuh"

template <int kLoadCols, int G>
struct GroupPairTiles {
  static constexpr int kSegCols = G < kLoadCols ? G : kLoadCols;  // columns under one pair
  static constexpr int kSegs = kLoadCols / kSegCols;              // pairs a load

  struct Ptr {
    const uint4* w;     // a tile slice's first load (lane 0's)
    const float4* ab;   // its first group's pairs (lane group 0's)
  };
  struct Load {
    uint4 w;
    float2 ab[kSegs];  // (a, b') of the lane's row, g (t < 2) or g + 8, for each segment
  };

  // Chunk c = 32 j + lane of a slice: lane's load j (gemv.cuh's chunk numbering). phase: the
  // loads of the slice's first group before its start, where a slice starts inside a group
  // wider than a load (p.ab is that group's pairs).
  __device__ static __forceinline__ Load load(Ptr p, int c, int phase = 0) {
    Load u;
    const int j = c >> 5, g = (c & 31) >> 2, half = (c >> 1) & 1;
    u.w = ld_stream(p.w + c);
    const float2* ab = reinterpret_cast<const float2*>(p.ab);
#pragma unroll
    for (int h = 0; h < kSegs; ++h)
      u.ab[h] = __ldg(ab + (((kLoadCols * (j + phase) + kSegCols * h) / G) * 8 + g) * 2 + half);
    return u;
  }
  __device__ static __forceinline__ Load zero() {
    Load u;
    u.w = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int h = 0; h < kSegs; ++h) u.ab[h] = make_float2(0.f, 0.f);
    return u;
  }
};
