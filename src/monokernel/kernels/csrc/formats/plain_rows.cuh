// What the formats whose rows are only their weights share (bf16, fp8, int8): a row of K
// weights is K storage elements, a position in a matrix is a pointer to its element, and one
// load is one 16-byte vector. The GEMVs (gemv.cuh) reach a matrix only through these names,
// so a format with side data streamed beside its weights (int4.cuh's group scales) brings its
// own position and load types instead.
#pragma once
#include "../common.cuh"

template <class E>
struct PlainRows {
  using Elem = E;         // storage element: a row of K weights is K of them
  using Ptr = const E*;   // a position in a matrix
  using Load = uint4;     // what one lane's load of a row brings
  static constexpr bool kGroups = false;  // group scales beside the weights (int4.cuh)
  static constexpr int kSumCols = 0;      // a tile GEMV's input sums a group (gemv_tiles.cuh)
  static constexpr bool kTiles = false;   // a GEMV unit is one row (int4.cuh: 16-row tiles)
  static constexpr int kTileRows = 1;

  // Element e (= row * K + column) of the matrix whose rows start at `rows`.
  __device__ static __forceinline__ Ptr at(const E* rows, const float*, size_t e) {
    return rows + e;
  }
  // 16-byte chunk c of the row part that starts at p.
  __device__ static __forceinline__ Load load(Ptr p, int c) {
    return ld_stream(reinterpret_cast<const uint4*>(p) + c);
  }
  __device__ static __forceinline__ Load zero() { return make_uint4(0u, 0u, 0u, 0u); }
};
