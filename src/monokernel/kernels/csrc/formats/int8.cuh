// int8 weights (symmetric, no zero point) with one fp32 scale a row (weights/formats/int8.py):
// a 16-byte load holds 16 consecutive weights of a row. A byte b widens through the float
// whose bits are 0x4b0000 | (b ^ 0x80): that is 2^23 + 128 + b exactly, so one byte permute
// and one subtraction make b, exactly, without the slow integer-to-float conversion.
#pragma once
#include "bytes16.cuh"

struct Int8Rows : PlainRows<int8_t> {
  static constexpr int kPerLoad = 16;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 1.f;

  // Byte k of w, widened as above (w ^ 0x80808080 is one op a word once the compiler
  // shares it between the word's four bytes).
  template <int k>
  __device__ static __forceinline__ float widen(uint32_t w) {
    return __uint_as_float(__byte_perm(w ^ 0x80808080u, 0x4b000000u, 0x7650u | k)) - 8388736.f;
  }
  __device__ static __forceinline__ float dot(const uint4 u, const float4 (&x)[4]) {
    return dot_bytes16<Int8Rows>(u, x);
  }
};
