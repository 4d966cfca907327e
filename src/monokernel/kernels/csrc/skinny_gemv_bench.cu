// Skinny GEMV on the tensor cores: y[n] = W x[n] for N = 1..16 input vectors, one pass over
// W. Standalone (decode.cu does not include it): it measures how fast the weights stream when
// the products run as mma.m16n8k16 instead of on the CUDA cores, for the two places the decode
// kernel's warp-per-row GEMV falls short (perf-notes):
//   * 4-bit weights (issue 35): the CUDA-core GEMV widens 32 weights and reads 128 bytes of
//     fp32 inputs from shared memory per 16-byte load, so issue slots and shared-memory
//     bandwidth run out at ~55% of HBM's rate;
//   * several positions at once (issue 36, a speculative verify pass over K+1 tokens): each
//     weight meets N inputs, N times the CUDA-core work.
//
// Layout (kernels/skinny_gemv.py packs it): W [R, K] in row tiles of 16 rows and k-tiles of 16
// columns. Lane l of a warp holds, per k-tile, the 8 elements of its A fragment of
// mma.m16n8k16 (g = l / 4, t = l % 4): (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8)
// (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9), so a warp's load of one tile step is 512 contiguous
// bytes and needs no shuffle:
//   bf16: one k-tile a 16-byte load, [R/16][K/16][32 lanes][8] bf16;
//   fp8:  two k-tiles a 16-byte load, [R/16][K/32][32][16] E4M3 bytes, bytes 8i .. 8i + 7 the
//         elements of k-tile 2j + i; each 16-bit half widens to A's register as an f16 pair
//         (one cvt.rn.f16x2.e4m3x2, exact), one fp32 scale a row applied at the end, the
//         inputs as f16 hi + lo;
//   int4: four k-tiles a 16-byte load, [R/16][K/64][32][4 words], the decode kernel's tile
//         layout (formats/int4_tiles.cuh, which says how a word widens). Each row's
//         groups of 128 columns have an fp32 scale a and offset b (w = a q + b): the kernel
//         sums C = sum (128 + q) x a group on the tensor cores (exact products, fp32 sums)
//         and adds a C + (b - 128 a) s, s the group's sum of x; the packer stores b - 128 a.
// Inputs: x rounded to bf16 hi + lo (hi = bf16(x), lo = bf16(x - hi)), two mma a k-tile, so
// the products carry ~16 mantissa bits of x, as the fp32 inputs of the decode kernel nearly
// do. Each CTA holds a K-slice of x in shared memory ([hi, lo][N][KS] bf16 rows padded by 8
// so the 8 groups' reads fall in different banks) and adds its partial rows into y with
// atomicAdd (the bench sums in any order; the decode kernel would reduce in a fixed one).
#include "common.cuh"  // ld_stream
#include "mma.cuh"

// Mirrored by monokernel/kernels/skinny_gemv.py (ctypes).
struct SkinnyParams {
  const uint4* w;     // packed weights (above)
  const float2* ab;   // int4: [R][K / 128] (a, b - 128 a); fp8: [R] fp32 scales; bf16: unused
  const float* x;     // [N][K] fp32
  float* y;           // [N][R] fp32, zeroed by the host, accumulated
  int rows;           // R, a multiple of 16
  int k;              // K, a multiple of ks
  int ks;             // the K-slice a CTA holds, a multiple of 128
  int ctas_per_slice; // gridDim.x / (k / ks)
};

constexpr int kSkThreads = 512;
constexpr int kSkWarps = kSkThreads / 32;
constexpr int kGroup = 128;  // int4 columns sharing (a, b)

// The B fragments of k-tile j for n-tile nt: hi and lo pairs (k 2t, 2t+1) and (2t+8, 2t+9) of
// input column nt * 8 + g; zeros past N.
template <int N>
struct Inputs {
  static constexpr int NT = (N + 7) / 8;
  const uint32_t* hi;  // [N][stride] words of bf16 pairs
  const uint32_t* lo;
  int stride;
  __device__ __forceinline__ void frag(int nt, int j, int g, int t, uint32_t (&b)[4]) const {
    const int n = nt * 8 + g;
    if (n < N) {
      const int at = n * stride + 8 * j + t;
      b[0] = hi[at];
      b[1] = hi[at + 4];
      b[2] = lo[at];
      b[3] = lo[at + 4];
    } else {
      b[0] = b[1] = b[2] = b[3] = 0u;
    }
  }
};

// Shared memory: [hi, lo][N][stride] words, then the int4 groups' sums [N][ks / 128] fp32.
template <int N, bool F16>
__device__ __forceinline__ Inputs<N> stage_inputs(const SkinnyParams& p, int k0, uint32_t* sm,
                                                   float* sums) {
  const int stride = p.ks / 2 + 4;
  for (int i = threadIdx.x; i < N * (p.ks / 2); i += kSkThreads) {
    const int n = i / (p.ks / 2), w = i % (p.ks / 2);
    const float2 v = *reinterpret_cast<const float2*>(p.x + (size_t)n * p.k + k0 + 2 * w);
    split_pair<F16>(v, sm[n * stride + w], sm[N * stride + n * stride + w]);
  }
  // One warp a group: its sum of x.
  const int groups = p.ks / kGroup, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int q = warp; q < N * groups; q += kSkWarps) {
    const int n = q / groups, gq = q % groups;
    const float* xp = p.x + (size_t)n * p.k + k0 + gq * kGroup;
    float s = xp[lane] + xp[lane + 32] + xp[lane + 64] + xp[lane + 96];
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sums[q] = s;
  }
  __syncthreads();
  return {sm, sm + N * stride, stride};
}

// A row tile's partial sums into y: c[nt][e] is row g (+8 for e >= 2), column nt*8 + 2t + e%2.
template <int N>
__device__ __forceinline__ void add_out(const SkinnyParams& p, int tile, int g, int t,
                                        const float (&c)[(N + 7) / 8][4]) {
#pragma unroll
  for (int nt = 0; nt < (N + 7) / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = nt * 8 + 2 * t + (e & 1);
      const int r = tile * 16 + g + 8 * (e >> 1);
      if (n < N) atomicAdd(p.y + (size_t)n * p.rows + r, c[nt][e]);
    }
}

// A warp's row tiles of its K-slice: ``loads`` 16-byte loads a lane each (a tile's loads lie
// ``per_tile`` uint4 apart, the slice's first at ``first``), BATCH in flight, each tile's last
// batch issued with the next tile's first. begin(tile), on_load(j, load j), end(tile).
template <int BATCH, class Begin, class OnLoad, class End>
__device__ __forceinline__ void stream_tiles(const SkinnyParams& p, int tile0, int tile_step,
                                             int loads, size_t per_tile, size_t first,
                                             Begin begin, OnLoad on_load, End end) {
  const int lane = threadIdx.x % 32;
  uint4 cur[BATCH], nxt[BATCH];
  bool have = false;  // cur holds this tile's first batch already
  for (int tile = tile0; tile < p.rows / 16; tile += tile_step) {
    const uint4* w = p.w + (size_t)tile * per_tile + first + lane;
    const uint4* wn = w + (size_t)tile_step * per_tile;
    const bool ahead = tile + tile_step < p.rows / 16;
    begin(tile);
    if (!have)
#pragma unroll
      for (int i = 0; i < BATCH; ++i) cur[i] = ld_stream(w + i * 32);
    for (int j0 = 0; j0 < loads; j0 += BATCH) {
      const bool more = j0 + BATCH < loads;
#pragma unroll
      for (int i = 0; i < BATCH; ++i)
        if (more)
          nxt[i] = ld_stream(w + (j0 + BATCH + i) * 32);
        else if (ahead)
          nxt[i] = ld_stream(wn + i * 32);
#pragma unroll
      for (int i = 0; i < BATCH; ++i) on_load(j0 + i, cur[i]);
#pragma unroll
      for (int i = 0; i < BATCH; ++i) cur[i] = nxt[i];
    }
    have = ahead;
    end(tile);
  }
}

// bf16 weights: one 16-byte load a k-tile, 8 loads a lane in flight.
template <int N>
__device__ __forceinline__ void bf16_tiles(const SkinnyParams& p, const Inputs<N>& in, int k0,
                                           int tile0, int tile_step) {
  constexpr int NT = (N + 7) / 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float c[NT][4];
  stream_tiles<8>(
      p, tile0, tile_step, p.ks / 16, (size_t)(p.k / 16) * 32, (size_t)(k0 / 16) * 32,
      [&](int) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
      },
      [&](int j, const uint4 u) {
        const uint32_t a[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[4];
          in.frag(nt, j, g, t, b);
          mma_bf16(c[nt], a, b[0], b[1]);
          mma_bf16(c[nt], a, b[2], b[3]);
        }
      },
      [&](int tile) { add_out<N>(p, tile, g, t, c); });
}

// fp8 weights: two k-tiles a 16-byte load, 8 loads a lane in flight; each row's scale at the
// end.
template <int N>
__device__ __forceinline__ void fp8_tiles(const SkinnyParams& p, const Inputs<N>& in, int k0,
                                          int tile0, int tile_step) {
  constexpr int NT = (N + 7) / 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* scale = reinterpret_cast<const float*>(p.ab);
  float c[NT][4];
  float s0 = 0.f, s1 = 0.f;
  stream_tiles<8>(
      p, tile0, tile_step, p.ks / 32, (size_t)(p.k / 32) * 32, (size_t)(k0 / 32) * 32,
      [&](int tile) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
        s0 = __ldg(scale + tile * 16 + g);
        s1 = __ldg(scale + tile * 16 + g + 8);
      },
      [&](int j, const uint4 u) {
        const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {e4m3x2_f16x2(words[2 * h], 0), e4m3x2_f16x2(words[2 * h], 1),
                                 e4m3x2_f16x2(words[2 * h + 1], 0),
                                 e4m3x2_f16x2(words[2 * h + 1], 1)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            uint32_t b[4];
            in.frag(nt, 2 * j + h, g, t, b);
            mma_f16(c[nt], a, b[0], b[1]);
            mma_f16(c[nt], a, b[2], b[3]);
          }
        }
      },
      [&](int tile) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          c[nt][0] *= s0;
          c[nt][1] *= s0;
          c[nt][2] *= s1;
          c[nt][3] *= s1;
        }
        add_out<N>(p, tile, g, t, c);
      });
}

// int4 weights: a group (128 columns, 8 k-tiles) is two 16-byte loads a lane; GROUPS groups'
// loads in flight, and each group's (a, b') of the lane's rows g and g + 8 beside them (four
// groups in flight spilled: 60-64% of the copy bandwidth against 83-86% for two).
template <int N>
__device__ __forceinline__ void int4_tiles(const SkinnyParams& p, const Inputs<N>& in,
                                           const float* sums, int k0, int tile0, int tile_step) {
  constexpr int NT = (N + 7) / 8;
  constexpr int GROUPS = 2;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int groups = p.ks / kGroup, groups_all = p.k / kGroup, kq_all = p.k / 64;
  uint4 cur[GROUPS][2], nxt[GROUPS][2];
  float2 sc[GROUPS][2], sn[GROUPS][2];
  bool have = false;
  for (int tile = tile0; tile < p.rows / 16; tile += tile_step) {
    const uint4* w = p.w + ((size_t)tile * kq_all + k0 / 64) * 32 + lane;
    const float2* ab0 = p.ab + (size_t)(tile * 16 + g) * groups_all + k0 / kGroup;
    const float2* ab1 = ab0 + (size_t)8 * groups_all;
    const bool ahead = tile + tile_step < p.rows / 16;  // the last batch issues the next's first
    const uint4* wn = w + (size_t)tile_step * kq_all * 32;
    const float2* an0 = ab0 + (size_t)tile_step * 16 * groups_all;
    const float2* an1 = an0 + (size_t)8 * groups_all;
    float acc[NT][4] = {};
    if (!have)
#pragma unroll
      for (int i = 0; i < GROUPS; ++i) {
        cur[i][0] = ld_stream(w + (2 * i) * 32);
        cur[i][1] = ld_stream(w + (2 * i + 1) * 32);
        sc[i][0] = __ldg(ab0 + i);
        sc[i][1] = __ldg(ab1 + i);
      }
    for (int q0 = 0; q0 < groups; q0 += GROUPS) {
      const bool more = q0 + GROUPS < groups;
#pragma unroll
      for (int i = 0; i < GROUPS; ++i)
        if (more) {
          nxt[i][0] = ld_stream(w + (2 * (q0 + GROUPS + i)) * 32);
          nxt[i][1] = ld_stream(w + (2 * (q0 + GROUPS + i) + 1) * 32);
          sn[i][0] = __ldg(ab0 + q0 + GROUPS + i);
          sn[i][1] = __ldg(ab1 + q0 + GROUPS + i);
        } else if (ahead) {
          nxt[i][0] = ld_stream(wn + (2 * i) * 32);
          nxt[i][1] = ld_stream(wn + (2 * i + 1) * 32);
          sn[i][0] = __ldg(an0 + i);
          sn[i][1] = __ldg(an1 + i);
        }
#pragma unroll
      for (int i = 0; i < GROUPS; ++i) {
        float c[NT][4] = {};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t words[4] = {cur[i][h].x, cur[i][h].y, cur[i][h].z, cur[i][h].w};
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const uint32_t v = words[m];
            const uint32_t a[4] = {(v & 0x000F000Fu) | 0x43004300u,
                                   ((v >> 4) & 0x000F000Fu) | 0x43004300u,
                                   ((v >> 8) & 0x000F000Fu) | 0x43004300u,
                                   ((v >> 12) & 0x000F000Fu) | 0x43004300u};
            const int j = 8 * (q0 + i) + 4 * h + m;  // k-tile in the slice
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              uint32_t b[4];
              in.frag(nt, j, g, t, b);
              mma_bf16(c[nt], a, b[0], b[1]);
              mma_bf16(c[nt], a, b[2], b[3]);
            }
          }
        }
        // acc += a C + b' s, rows g (e < 2) and g + 8, columns nt*8 + 2t + e%2.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int n = nt * 8 + 2 * t + (e & 1);
            const float s = n < N ? sums[n * groups + q0 + i] : 0.f;
            const float2 r = sc[i][e >> 1];
            acc[nt][e] = fmaf(r.x, c[nt][e], fmaf(r.y, s, acc[nt][e]));
          }
      }
#pragma unroll
      for (int i = 0; i < GROUPS; ++i) {
        cur[i][0] = nxt[i][0];
        cur[i][1] = nxt[i][1];
        sc[i][0] = sn[i][0];
        sc[i][1] = sn[i][1];
      }
    }
    have = ahead;
    add_out<N>(p, tile, g, t, acc);
  }
}

enum SkinnyFormat { kBf16, kFp8, kInt4 };

template <int N, SkinnyFormat FMT>
__device__ __forceinline__ void skinny(const SkinnyParams& p) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int slice = blockIdx.x / p.ctas_per_slice, c = blockIdx.x % p.ctas_per_slice;
  const int k0 = slice * p.ks;
  float* sums = reinterpret_cast<float*>(smem + 2 * N * (p.ks / 2 + 4));
  const Inputs<N> in = stage_inputs<N, FMT == kFp8>(p, k0, smem, sums);
  const int warp = threadIdx.x / 32;
  const int tile0 = c * kSkWarps + warp, step = p.ctas_per_slice * kSkWarps;
  if constexpr (FMT == kInt4)
    int4_tiles<N>(p, in, sums, k0, tile0, step);
  else if constexpr (FMT == kFp8)
    fp8_tiles<N>(p, in, k0, tile0, step);
  else
    bf16_tiles<N>(p, in, k0, tile0, step);
}

#define SKINNY_ENTRY(N)                                                  \
  extern "C" __global__ void __launch_bounds__(kSkThreads, 1)            \
      skinny_bf16_n##N(const __grid_constant__ SkinnyParams p) {         \
    skinny<N, kBf16>(p);                                                 \
  }                                                                      \
  extern "C" __global__ void __launch_bounds__(kSkThreads, 1)            \
      skinny_fp8_n##N(const __grid_constant__ SkinnyParams p) {          \
    skinny<N, kFp8>(p);                                                  \
  }                                                                      \
  extern "C" __global__ void __launch_bounds__(kSkThreads, 1)            \
      skinny_int4_n##N(const __grid_constant__ SkinnyParams p) {         \
    skinny<N, kInt4>(p);                                                 \
  }

SKINNY_ENTRY(1)
SKINNY_ENTRY(2)
SKINNY_ENTRY(4)
SKINNY_ENTRY(8)
SKINNY_ENTRY(16)
