// The build's -D defines, all from kernels/build.py (KernelDims.defines): the model's
// dimensions, then the per-shape choices of build.py's CHOICES table, each documented there
// (docs/kernel-knobs.md lists them).
//
// Dimensions: MK_H hidden, MK_Q = heads * head_dim, MK_KV = kv_heads * head_dim, MK_I
// intermediate, MK_V vocabulary, MK_L layers, MK_D head_dim, MK_NH heads, MK_NKV KV heads,
// the 0/1 features MK_QKV_BIAS, MK_O_BIAS, MK_QK_NORM, MK_TP tensor-parallel ranks (1: the
// single-GPU kernel, every TP addition compiled away), MK_V_ALL the whole vocabulary (MK_V
// is a rank's share of it under TP; top-k / top-p draw over all of it), MK_WEIGHT_FORMAT
// the weights' format type (formats/format.cuh), MK_TILES 1 where it streams 16-row
// tiles (gemv_tiles.cuh), MK_SUM_SPLIT 2 where its groups are 16 columns (the tile GEMV's
// input sums take twice the room), MK_SMS the SMs of the grid the choices are made for
// (the launch's grid is the device's), and MK_SMEM_BYTES the dynamic shared memory
// layout.py computed.
#pragma once
#include "common.cuh"

#if !defined(MK_H) || !defined(MK_Q) || !defined(MK_KV) || !defined(MK_I) || !defined(MK_V) || \
    !defined(MK_L) || !defined(MK_D) || !defined(MK_NH) || !defined(MK_NKV) ||                 \
    !defined(MK_QKV_BIAS) || !defined(MK_O_BIAS) || !defined(MK_QK_NORM) || !defined(MK_TP) || \
    !defined(MK_WEIGHT_FORMAT) || !defined(MK_SMEM_BYTES) || !defined(MK_SUM_SPLIT) ||       \
    !defined(MK_SMS)
#error "kernels/build.py passes every dimension (-D): build through it"
#endif
#if !defined(MK_SPLIT_E) || !defined(MK_BATCH2) || !defined(MK_D_PRE) || !defined(MK_F_DRAWN) || \
    !defined(MK_ATTN_CHUNK) || !defined(MK_ATTN_RANGE) || !defined(MK_ATTN_GROUP) ||         \
    !defined(MK_TILE_SPLIT_A) || !defined(MK_TILE_SPLIT_C) || !defined(MK_TILE_SPLIT_D) ||    \
    !defined(MK_TILE_BATCH) || !defined(MK_TILES) || !defined(MK_E_STREAM) ||                 \
    !defined(MK_ATTN_MIN_RANGE)
#error "kernels/build.py passes every per-shape choice (-D, its CHOICES table)"
#endif

#ifndef MK_V_ALL
#define MK_V_ALL MK_V
#endif
#ifndef MK_P
#define MK_P 1  // positions a verify pass computes (build.py KernelDims.positions)
#endif
static_assert(MK_P >= 1 && MK_P <= 8 && (MK_P == 1 || MK_TP == 1),
              "MK_P: a verify pass computes 1 to 8 positions, on one GPU");

#define MK_TP_MAX 8  // peer pointers in Params
static_assert(MK_TP >= 1 && MK_TP <= MK_TP_MAX, "MK_TP must be in [1, 8]");
static_assert(MK_H % 8 == 0 && MK_Q % 8 == 0 && MK_I % 8 == 0 && MK_D % 8 == 0,
              "hidden, q, intermediate sizes and head_dim must be multiples of 8 (16-byte loads)");
static_assert(MK_D <= 256, "head_dim above 256 is not supported");
static_assert(MK_NH % MK_NKV == 0, "query heads must be a multiple of KV heads");
static_assert(MK_D_PRE >= 0 && MK_D_PRE <= 2, "MK_D_PRE: 0, 1 or 2 rows");

constexpr int kQkv = MK_Q + 2 * MK_KV;  // rows of the fused QKV projection
constexpr int kGroup = MK_NH / MK_NKV;  // query heads per KV head
