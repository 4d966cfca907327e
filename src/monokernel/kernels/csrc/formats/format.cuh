// The weight format seam. A format is a type with
//   Elem        the storage element (a row of K weights is K of them: one element a weight),
//   kPerLoad    the weights one 16-byte load holds (8, 16 or 32),
//   Ptr, Load   a position in a matrix and what one lane's load brings, with at() and
//               load() (plain_rows.cuh for the formats that are only their weights),
//   kScaled     whether each row's dot product is multiplied by its fp32 scale,
//   kUnit       a constant that scale is multiplied by (a dequantisation's fixed factor),
//   dot(u, x)   one load's weights dotted with kPerLoad fp32 inputs x, fp32 accumulation,
// and the GEMVs (gemv.cuh, drawn_rows.cuh) are templates over it, reached through the type
// of the matrix view they are given: the stages never name a format. MK_WEIGHT_FORMAT picks
// the layers' format (MK_QKV_FORMAT / MK_DOWN_FORMAT those two stages' where they differ) and
// MK_HEAD_FORMAT the LM head's (build.py's WEIGHT_FORMATS table). A
// new format adds its header here, its row in that table and its packing on the host.
#pragma once
#include <type_traits>

#include "bf16.cuh"
#include "fp8.cuh"
#include "fp8_tiles.cuh"
#include "int4.cuh"
#include "int4_tiles.cuh"
#include "int8.cuh"
#include "int8_tiles.cuh"

// A row-major weight matrix [rows, K] in format F, as the kernel's LayerWeights hold it.
// scales: [rows] fp32 for a scaled format, else null.
template <class F>
struct Matrix {
  using Format = F;
  const typename F::Elem* rows;
  const float* scales;  // int4: the groups' (a, b) pairs

  // Element e (= row * K + column) of the matrix.
  __device__ __forceinline__ typename F::Ptr at(size_t e) const { return F::at(rows, scales, e); }

  // Row r's scale (1 for an unscaled format).
  __device__ __forceinline__ float row_scale(size_t r) const {
    if constexpr (F::kScaled)
      return __ldg(scales + r) * F::kUnit;
    else
      return 1.f;
  }
};

// The scales of a warp's rows, read together where the warp's first rows are issued: the
// scales are ~0.1% of a matrix's bytes, so each comes from HBM, and one read when its row is
// reduced would expose a round trip a row (measured: a quarter of an fp8 8B model's step).
// Lane j holds the scale of the warp's j-th row (rows first + j * stride, j < 32, below
// `rows`); at(j) for a later row reads it then.
template <class F>
struct RowScales {
  float mine = 1.f;

  __device__ __forceinline__ RowScales(Matrix<F> M, size_t first, size_t stride, int count,
                                       size_t rows, int lane) {
    if constexpr (F::kScaled) {
      const size_t r = first + (size_t)lane * stride;
      if (lane < count && r < rows) mine = M.row_scale(r);
    }
  }
  // The scale of the warp's j-th row (warp-uniform j), which is row r of M.
  __device__ __forceinline__ float at(Matrix<F> M, int j, size_t r) const {
    if constexpr (F::kScaled)
      return j < 32 ? __shfl_sync(0xffffffffu, mine, j) : M.row_scale(r);
    else
      return 1.f;
  }
};

using WeightFormat = MK_WEIGHT_FORMAT;
using HeadFormat = MK_HEAD_FORMAT;
// The fused QKV and the down projection may stream another format than the other layers'
// matrices (MK_QKV_FORMAT, MK_DOWN_FORMAT): a GGUF Q4_K_M keeps V and the down projection in
// 6 bits (int8 groups) and the rest in 4 (int4 tiles). Both tile formats where they differ.
#ifdef MK_QKV_FORMAT
using QkvFormat = MK_QKV_FORMAT;
#else
using QkvFormat = WeightFormat;
#endif
#ifdef MK_DOWN_FORMAT
using DownFormat = MK_DOWN_FORMAT;
#else
using DownFormat = WeightFormat;
#endif
static_assert(QkvFormat::kTiles == WeightFormat::kTiles && DownFormat::kTiles == WeightFormat::kTiles,
              "a stage of its own format streams tiles as the others do (build.py checks)");
using WeightMatrix = Matrix<WeightFormat>;
using QkvMatrix = Matrix<QkvFormat>;
using DownMatrix = Matrix<DownFormat>;
using HeadMatrix = Matrix<HeadFormat>;

// The kPerLoad inputs of one load: 8-float units of the swizzled vector (common.cuh) at q,
// each read as two 16-byte halves, o (0 or 4) the swap of this lane's units (lane_half).
// A load's units lie in one 128-byte block (a 64-byte load of x at most), so they swap alike.
template <int N>
__device__ __forceinline__ void load_inputs(float4 (&x)[N / 4], const float* __restrict__ q,
                                            int o) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    x[2 * j] = *reinterpret_cast<const float4*>(q + 8 * j + o);
    x[2 * j + 1] = *reinterpret_cast<const float4*>(q + 8 * j + 4 - o);
  }
}
