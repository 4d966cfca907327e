// FP8 E4M3 weights with one fp32 scale a row (weights/formats/fp8.py): a 16-byte load holds
// 16 consecutive weights of a row. A byte s.eeee.mmm becomes the fp32 bits s<<31 | eeeemmm<<20,
// whose value is the weight times 2^-120 for normal and subnormal E4M3 alike (the exponent
// bias differs by 120 and fp32's subnormals line up with E4M3's), so the widening is three
// integer ops and exact; the 2^120 joins the row's scale (kUnit), applied once a row.
#pragma once
#include "bytes16.cuh"

// Byte k of w, widened as above: one byte permute puts it in bits 16..23 with its sign copied
// through bits 24..31, so after a shift by 4 the sign is already at bit 31 and one mask clears
// its other copies (bits 27..30) and what lies below the mantissa.
template <int k>
__device__ __forceinline__ float e4m3_scaled(uint32_t w) {
  // prmt, not __byte_perm: the intrinsic drops the selector's sign-replicate bit.
  uint32_t t;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(t) : "r"(w), "n"(0x0044 | k << 8 | (8 | k) << 12));
  return __uint_as_float((t << 4) & 0x87f00000u);
}

struct Fp8Rows : PlainRows<uint8_t> {
  static constexpr int kPerLoad = 16;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 0x1p120f;

  template <int k>
  __device__ static __forceinline__ float widen(uint32_t w) {
    return e4m3_scaled<k>(w);
  }
  __device__ static __forceinline__ float dot(const uint4 u, const float4 (&x)[4]) {
    return dot_bytes16<Fp8Rows>(u, x);
  }
};
