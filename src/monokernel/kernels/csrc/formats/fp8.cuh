// FP8 E4M3 weights with one fp32 scale a row (weights/formats/fp8.py): a 16-byte load holds
// 16 consecutive weights of a row. A byte s.eeee.mmm becomes the fp32 bits s<<31 | eeeemmm<<20,
// whose value is the weight times 2^-120 for normal and subnormal E4M3 alike (the exponent
// bias differs by 120 and fp32's subnormals line up with E4M3's), so the widening is three
// integer ops and exact; the 2^120 joins the row's scale (kUnit), applied once a row.
#pragma once
#include "../common.cuh"

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

__device__ __forceinline__ float dot_e4m3x4(uint32_t w, const float4 a, float acc) {
  acc = fmaf(e4m3_scaled<0>(w), a.x, acc);
  acc = fmaf(e4m3_scaled<1>(w), a.y, acc);
  acc = fmaf(e4m3_scaled<2>(w), a.z, acc);
  acc = fmaf(e4m3_scaled<3>(w), a.w, acc);
  return acc;
}

struct Fp8Rows {
  using Elem = uint8_t;
  static constexpr int kPerLoad = 16;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 0x1p120f;

  __device__ static __forceinline__ float dot(const uint4 u, const float4 (&x)[4]) {
    float acc = dot_e4m3x4(u.x, x[0], 0.f);
    acc = dot_e4m3x4(u.y, x[1], acc);
    acc = dot_e4m3x4(u.z, x[2], acc);
    return dot_e4m3x4(u.w, x[3], acc);
  }
};
