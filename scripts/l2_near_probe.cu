// Which L2 lines are near which SMs: the hit latency of every (SM, line) pair, one SM at a time.
//
//   nvcc -O3 -arch=sm_90a scripts/l2_near_probe.cu -o /tmp/l2_near_probe && \
//     /tmp/l2_near_probe OUT.csv [WARPS [DEPTH]]
//
// Why: every hand-off of the decode kernel ends with a poll of lines the whole grid reads
// (flow.cuh), and where the hand-off buffer lies moved Qwen2.5-Coder-1.5B by ~1% on an H100
// (docs/perf-notes.md step 48). If an L2 hit costs more from some SMs than from others, and
// which ones depends on the line, each hand-off vector could be kept in one copy per group of
// SMs, each copy near its readers.
//
// One CTA per SM, thread 0 only, in turns (a counter passes the turn), so no two probes
// share the L2 at once. The turn's SM loads each line once (an L2 fill), then times REPS
// dependent loads of it with the instruction the decode kernel polls with
// (ld.relaxed.gpu: past L1, answered by L2). Lines: LINES consecutive 128-byte lines from the
// start of a 2 MB-aligned buffer, then one line at each power-of-two offset from 256 bytes to
// half the buffer (the address bits a partition hash may use).
// With WARPS > 0, warps 1..WARPS of every CTA stream a 1 GB buffer meanwhile, each lane
// keeping DEPTH (4 or 8) 16-byte loads in flight as the decode kernel's GEMVs do (stage D:
// ~60 KB a SM, i.e. 15 warps x 8), so the latencies are those a hand-off sees under load.
// Output CSV: one row per SM: smid, then the mean cycles per load of every line.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

// The decode kernel's own weight load (ld_stream), so the streamers load as its GEMVs do.
#include "../src/monokernel/kernels/csrc/common.cuh"
#include "cuda_check.h"

constexpr int LINES = 1024;          // consecutive lines probed (128 KB)
constexpr int BUF_LOG2 = 25;         // 32 MB buffer: bit offsets 8..24
constexpr int BITS = BUF_LOG2 - 1 - 7;  // one line at 2^k bytes, k = 8 .. BUF_LOG2 - 1
constexpr int PROBES = LINES + BITS;
constexpr int REPS = 16;

__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned u;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(u) : "l"(p) : "memory");
  return u;
}

__device__ __forceinline__ size_t probe_offset(int i) {  // bytes from the buffer's start
  return i < LINES ? (size_t)i * 128 : (size_t)1 << (8 + (i - LINES));
}

struct Stream {
  const uint4* buf;  // [blocks * 32]
  long long blocks;  // 512-byte blocks
  int warps;         // streaming warps a CTA (warps 1..warps)
  unsigned* stop;    // set once the last turn is done
  unsigned* sink;
};

template <int DEPTH>
__device__ void stream_until_stop(const Stream& s, int warp, int lane) {
  const long long gw = (long long)blockIdx.x * s.warps + warp - 1, tw = (long long)gridDim.x * s.warps;
  unsigned acc = 0;
  long long b = gw * DEPTH;
  for (int it = 0;; ++it) {
    if ((it & 63) == 0 && ld_relaxed(s.stop)) break;
    uint4 v[DEPTH];
#pragma unroll
    for (int k = 0; k < DEPTH; ++k) v[k] = ld_stream(s.buf + ((b + k) % s.blocks) * 32 + lane);
#pragma unroll
    for (int k = 0; k < DEPTH; ++k) acc ^= v[k].x ^ v[k].w;
    b += tw * DEPTH;
  }
  if (acc == 0x12345678u) *s.sink = acc;  // keeps the loads live
}

template <int DEPTH>
__global__ void probe(const unsigned* buf, unsigned* turn, float* out, int* smids, Stream st) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= 1 && warp <= st.warps) stream_until_stop<DEPTH>(st, warp, lane);
  if (threadIdx.x != 0) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  smids[blockIdx.x] = (int)sm;
  while (ld_relaxed(turn) != blockIdx.x) __nanosleep(2000);  // few polls beside the probe
  const char* base = reinterpret_cast<const char*>(buf);
  for (int i = 0; i < PROBES; ++i) {
    const unsigned* p = reinterpret_cast<const unsigned*>(base + probe_offset(i));
    unsigned v = ld_relaxed(p);  // the buffer is zero: v keeps the chain's address unchanged
    const long long t0 = clock64();
#pragma unroll 1
    for (int r = 0; r < REPS; ++r) v = ld_relaxed(p + v);
    const long long t1 = clock64();
    out[(size_t)blockIdx.x * PROBES + i] = (float)(t1 - t0 + v) / REPS;
  }
  __threadfence();
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(turn), "r"(blockIdx.x + 1) : "memory");
  if (blockIdx.x + 1 == gridDim.x)
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(st.stop), "r"(1u) : "memory");
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "l2_near.csv";
  const int warps = argc > 2 ? std::atoi(argv[2]) : 0, depth = argc > 3 ? std::atoi(argv[3]) : 8;
  if (warps < 0 || warps > 15 || (depth != 4 && depth != 8)) {
    std::fprintf(stderr, "WARPS: 0..15, DEPTH: 4 or 8\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned *buf, *turn;
  float* out;
  int* smids;
  CK(cudaMalloc(&buf, (size_t)1 << BUF_LOG2));
  CK(cudaMemset(buf, 0, (size_t)1 << BUF_LOG2));
  CK(cudaMalloc(&turn, 4));
  CK(cudaMemset(turn, 0, 4));
  CK(cudaMalloc(&out, (size_t)sms * PROBES * sizeof(float)));
  CK(cudaMalloc(&smids, sms * sizeof(int)));
  Stream st{nullptr, (1ll << 30) / 512, warps, nullptr, nullptr};
  CK(cudaMalloc((void**)&st.buf, (size_t)st.blocks * 512));
  CK(cudaMemset((void*)st.buf, 1, (size_t)st.blocks * 512));
  CK(cudaMalloc(&st.stop, 8));
  CK(cudaMemset(st.stop, 0, 8));
  st.sink = st.stop + 1;
  // 150 KB of shared memory a CTA: one CTA per SM, all resident (the turns need that).
  auto k = depth == 8 ? probe<8> : probe<4>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 150 << 10));
  k<<<sms, 512, 150 << 10>>>(buf, turn, out, smids, st);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> h((size_t)sms * PROBES);
  std::vector<int> ids(sms);
  CK(cudaMemcpy(h.data(), out, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ids.data(), smids, sms * sizeof(int), cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::perror(path);
    return 1;
  }
  std::fprintf(f, "smid");
  for (int i = 0; i < PROBES; ++i)
    std::fprintf(f, ",%s%d", i < LINES ? "line" : "bit", i < LINES ? i : 8 + i - LINES);
  std::fprintf(f, "\n");
  for (int c = 0; c < sms; ++c) {
    std::fprintf(f, "%d", ids[c]);
    for (int i = 0; i < PROBES; ++i) std::fprintf(f, ",%.1f", h[(size_t)c * PROBES + i]);
    std::fprintf(f, "\n");
  }
  std::fclose(f);
  std::printf("buffer at %p; %d SMs x %d lines, %d warps x %d loads streaming -> %s\n",
              (void*)buf, sms, PROBES, warps, depth, path);
  return 0;
}
