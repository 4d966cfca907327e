// The weight format seam. A format is a type with
//   Elem       the storage element (a row of K weights is K / (weights per element) of them),
//   kPerLoad   the weights one 16-byte load holds,
//   dot(u, a, b)  one load's weights dotted with 8 fp32 inputs, fp32 accumulation,
// and the GEMVs (gemv.cuh, drawn_rows.cuh) are templates over it, reached through the type
// of the matrix view they are given: the stages never name a format. MK_WEIGHT_FORMAT
// (build.py's WEIGHT_FORMATS table, KernelDims.weight_format) picks the build's. A new
// format adds its header here, its row in that table and its repacking on the host.
#pragma once
#include "bf16.cuh"

using WeightFormat = MK_WEIGHT_FORMAT;

// A row-major weight matrix [rows, K] in format F, as the kernel's LayerWeights hold it.
template <class F>
struct Matrix {
  using Format = F;
  const typename F::Elem* rows;
};
using WeightMatrix = Matrix<WeightFormat>;
