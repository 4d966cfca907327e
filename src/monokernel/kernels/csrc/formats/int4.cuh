// 4-bit weights with a float32 scale a and offset b per group of G input columns of a row
// (weights/formats/int4.py): w = a * q + b, q in 0..15 (GGUF Q4_0/Q4_1, AWQ, GPTQ and
// --quantize int4 all are this, with their own a and b). A 16-byte load holds the 32 weights
// of columns 32c .. 32c + 31 of a row (chunk c); word t of it columns 8t .. 8t + 7, byte k
// of the word column 8t + k in its low nibble and 8t + 4 + k in its high one. The pairs
// (a, b) lie in their own array, [rows, K / G] float2, one 8-byte load beside each chunk's
// (lanes of one group share it).
//
// Widening: a byte 0x80 | q put in bits 16..23 under 0x3f is the float 1 + q / 128, one byte
// permute a weight (after one mask a word for four low nibbles, a shift and a mask for the
// high ones). So a chunk sums f = sum (1 + q/128) x and s = sum x, and its dot product is
// a * 128 * (f - s) + b * s: exact in q, the rounding that of fp32 sums over 32 terms.
//
// Inputs: a chunk takes 32 floats (128 bytes) of the swizzled input, so lanes 128 bytes
// apart would all read the same banks. The packer stores chunk c's words rotated by
// rho = (c >> 1) & 3 (word t holds what is natural word (t + rho) & 3), and a lane reads its
// input units in that order: with the swizzle's half swap (common.cuh) the 8 lanes of a
// quarter warp read 8 different 16-byte bank groups. A split GEMV's slice and a tensor-
// parallel rank's column block start on a multiple of 8 chunks (build.py), so c counted from
// the slice gives the packer's rho.
#pragma once
#include "../common.cuh"

__device__ __forceinline__ float2 ld_stream2(const float2* p) {
  float2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.f32 {%0,%1}, [%2];"
               : "=f"(r.x), "=f"(r.y)
               : "l"(p));
  return r;
}

// Byte k of a word of bytes 0x80 | q, as the float 1 + q / 128.
template <int k>
__device__ __forceinline__ float nibble_unit(uint32_t w) {
  return __uint_as_float(__byte_perm(w, 0x3fu, 0x4055u | k << 8));
}

template <int G>
struct Int4Groups {
  static_assert(G % 32 == 0 && 256 % G == 0, "a group is 1, 2, 4 or 8 whole chunks");
  using Elem = uint8_t;  // two weights a byte: a row of K weights is K / 2 of them
  static constexpr int kPerLoad = 32;
  static constexpr bool kScaled = false;  // the groups' scales, not a row's
  static constexpr float kUnit = 1.f;
  static constexpr bool kGroups = true;
  static constexpr int kGroup = G;
  static constexpr bool kTiles = false;  // a GEMV unit is one row (int4_tiles.cuh: 16)
  static constexpr int kTileRows = 1;

  struct Ptr {
    const uint8_t* q;   // the chunk's bytes
    const float2* ab;   // its group's (a, b)
  };
  struct Load {
    uint4 w;
    float2 ab;
  };

  // Element e (= row * K + column, on a group's first column) of the matrix.
  __device__ static __forceinline__ Ptr at(const uint8_t* rows, const float* pairs, size_t e) {
    return {rows + e / 2, reinterpret_cast<const float2*>(pairs) + e / G};
  }
  __device__ static __forceinline__ Load load(Ptr p, int c) {
    return {ld_stream(reinterpret_cast<const uint4*>(p.q) + c), ld_stream2(p.ab + c * 32 / G)};
  }
  __device__ static __forceinline__ Load zero() {
    return {make_uint4(0u, 0u, 0u, 0u), make_float2(0.f, 0.f)};
  }

  // Chunk c's dot product with its 32 inputs at q (swizzled, o as gemv.cuh dot_load's).
  __device__ static __forceinline__ float dot_chunk(const Load u, const float* __restrict__ q,
                                                    int c, int o) {
    const int rho = (c >> 1) & 3;
    const uint32_t w[4] = {u.w.x, u.w.y, u.w.z, u.w.w};
    float f = 0.f, s = 0.f;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float* unit = q + 8 * ((t + rho) & 3);
      const float4 x0 = *reinterpret_cast<const float4*>(unit + o);
      const float4 x1 = *reinterpret_cast<const float4*>(unit + 4 - o);
      const uint32_t lo = (w[t] & 0x0f0f0f0fu) | 0x80808080u;
      const uint32_t hi = ((w[t] >> 4) & 0x0f0f0f0fu) | 0x80808080u;
      f = fmaf(nibble_unit<0>(lo), x0.x, f);
      f = fmaf(nibble_unit<1>(lo), x0.y, f);
      f = fmaf(nibble_unit<2>(lo), x0.z, f);
      f = fmaf(nibble_unit<3>(lo), x0.w, f);
      f = fmaf(nibble_unit<0>(hi), x1.x, f);
      f = fmaf(nibble_unit<1>(hi), x1.y, f);
      f = fmaf(nibble_unit<2>(hi), x1.z, f);
      f = fmaf(nibble_unit<3>(hi), x1.w, f);
      s += ((x0.x + x0.y) + (x0.z + x0.w)) + ((x1.x + x1.y) + (x1.z + x1.w));
    }
    return fmaf(u.ab.x * 128.f, f - s, u.ab.y * s);
  }
};
