// int8 weights (symmetric, no zero point) with one fp32 scale a row (weights/formats/int8.py):
// a 16-byte load holds 16 consecutive weights of a row. A byte b widens through the float
// whose bits are 0x4b0000 | (b ^ 0x80): that is 2^23 + 128 + b exactly, so one byte permute
// and one subtraction make b, exactly, without the slow integer-to-float conversion.
#pragma once
#include "../common.cuh"

template <int k>
__device__ __forceinline__ float s8_exact(uint32_t biased) {
  // biased = w ^ 0x80808080: byte k of it into the low byte of 0x4b000000.
  return __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7650u | k)) - 8388736.f;
}

__device__ __forceinline__ float dot_s8x4(uint32_t w, const float4 a, float acc) {
  const uint32_t b = w ^ 0x80808080u;
  acc = fmaf(s8_exact<0>(b), a.x, acc);
  acc = fmaf(s8_exact<1>(b), a.y, acc);
  acc = fmaf(s8_exact<2>(b), a.z, acc);
  acc = fmaf(s8_exact<3>(b), a.w, acc);
  return acc;
}

struct Int8Rows {
  using Elem = int8_t;
  static constexpr int kPerLoad = 16;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 1.f;

  __device__ static __forceinline__ float dot(const uint4 u, const float4 (&x)[4]) {
    float acc = dot_s8x4(u.x, x[0], 0.f);
    acc = dot_s8x4(u.y, x[1], acc);
    acc = dot_s8x4(u.z, x[2], acc);
    return dot_s8x4(u.w, x[3], acc);
  }
};
