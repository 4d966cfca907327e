// What the 1-byte formats (fp8.cuh, int8.cuh) share: a 16-byte load holds 16 weights, four a
// 32-bit word, each widened to fp32 by the format's W::widen<k> (byte k of a word) and dotted
// with the matching 4 of the load's 16 inputs, in order, fp32 accumulation.
#pragma once
#include "plain_rows.cuh"

template <class W>
__device__ __forceinline__ float dot_bytes4(uint32_t w, const float4 a, float acc) {
  acc = fmaf(W::template widen<0>(w), a.x, acc);
  acc = fmaf(W::template widen<1>(w), a.y, acc);
  acc = fmaf(W::template widen<2>(w), a.z, acc);
  return fmaf(W::template widen<3>(w), a.w, acc);
}

template <class W>
__device__ __forceinline__ float dot_bytes16(const uint4 u, const float4 (&x)[4]) {
  float acc = dot_bytes4<W>(u.x, x[0], 0.f);
  acc = dot_bytes4<W>(u.y, x[1], acc);
  acc = dot_bytes4<W>(u.z, x[2], acc);
  return dot_bytes4<W>(u.w, x[3], acc);
}
