// bf16 weights, row-major: a 16-byte load holds 8 consecutive weights of one row, which
// widen to fp32 exactly, so a load's dot product is 8 fused multiply-adds.
#pragma once
#include "plain_rows.cuh"

struct Bf16Rows : PlainRows<bf16> {
  static constexpr int kPerLoad = 8;  // weights in one 16-byte load
  static constexpr bool kScaled = false;
  static constexpr float kUnit = 1.f;

  // The 8 weights of one load dotted with the 8 floats x, fp32 accumulation.
  __device__ static __forceinline__ float dot(const uint4 u, const float4 (&x)[2]) {
    return dot_bf16x8(u, x[0], x[1]);
  }
};
