// How long a hand-off between two SMs takes while the other SMs stream HBM, as a function
// of how many bytes each streaming SM keeps in flight.
//
//   nvcc -O3 -arch=sm_90a scripts/loaded_latency.cu -o /tmp/loaded_latency && /tmp/loaded_latency
//
// Why: the decode kernel's stage hand-offs are L2 round trips (flow.cuh) that happen while
// the next stage's first loads are in flight. If an L2 hit queues behind the misses already
// outstanding, a hand-off costs about (bytes in flight) / bandwidth, and keeping more in
// flight than the bandwidth-latency product buys no bandwidth, only latency.
//
// One launch per configuration, one CTA per SM (the dynamic shared memory forces that):
// - CTA 0 and CTA gridDim/2 ping-pong a word (thread 0 each): P stores i, Q waits for i and
//   stores i back, P waits. One-way latency = time / (2 * rounds).
// - CTA 1 thread 0 chases a pointer chain in a 64 KB L2-resident buffer (L2 hit latency).
// - Every other CTA (loaded = 1: every CTA, the probes' too) streams a large buffer with
//   warps 1..`warps`, each lane keeping DEPTH 16-byte loads in flight
//   (ld.global.nc.L1::no_allocate, as the decode kernel's GEMVs).
// The probes run until the streamers are done; results are averages over that window.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

// The decode kernel's own weight load (ld_stream), so the streamers load as its GEMVs do.
#include "../src/monokernel/kernels/csrc/common.cuh"
#include "cuda_check.h"

struct Args {
  const uint4* stream;          // [blocks * 32] the streamed buffer
  long long blocks;             // 512-byte blocks in it
  int warps;                    // streaming warps per CTA (0: nothing streams)
  int loaded;                   // 1: the probes' CTAs stream too
  unsigned* flags;              // [64] ping (0) and pong (32), separate 128-byte lines
  const unsigned* chain;        // pointer chain, L2 resident
  unsigned* done;               // streaming warps finished (the probes stop at all of them)
  unsigned long long* out;      // [8] results
};

__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned u;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(u) : "l"(p) : "memory");
  return u;
}
__device__ __forceinline__ void st_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <int DEPTH>
__global__ void __launch_bounds__(512, 1) probe_kernel(Args a) {
  const int cta = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ping = 0, pong = gridDim.x / 2, chaser = 1;
  const bool probe_cta = cta == ping || cta == pong || cta == chaser;
  const int stream_ctas = a.loaded ? gridDim.x : gridDim.x - 3;
  const unsigned total = (unsigned)(stream_ctas * a.warps);
  if (probe_cta && threadIdx.x == 0) {
    unsigned long long t0 = globaltimer(), n = 0;
    if (cta == chaser) {
      unsigned i = 0;
      while (ld_relaxed(a.done) < total || n < 1000) {
        for (int k = 0; k < 64; ++k) i = ld_relaxed(a.chain + i);
        n += 64;
      }
      a.out[2] = globaltimer() - t0;
      a.out[3] = n + (i == 0xffffffffu);  // keeps the chain live
      return;
    }
    unsigned* mine = a.flags + (cta == ping ? 32 : 0);
    unsigned* theirs = a.flags + (cta == ping ? 0 : 32);
    for (unsigned r = 1;; ++r) {
      if (cta == ping) {
        st_relaxed(theirs, r);
        while (ld_relaxed(mine) != r) {
        }
        // Ping decides when to stop and tells pong with ~0u.
        if (ld_relaxed(a.done) >= total && r >= 1000) {
          a.out[0] = globaltimer() - t0;
          a.out[1] = r;
          st_relaxed(theirs, ~0u);
          return;
        }
      } else {
        unsigned v;
        while ((v = ld_relaxed(mine)) != r && v != ~0u) {
        }
        if (v == ~0u) return;
        st_relaxed(theirs, r);
      }
    }
  }
  // Streamers: warps 1 .. warps (warp 0 holds the probes' thread).
  if (probe_cta && !a.loaded) return;
  if (warp < 1 || warp > a.warps) return;
  const int sidx = a.loaded ? cta : (cta < pong ? cta - 2 : cta - 3);
  const long long gw = (long long)sidx * a.warps + warp - 1, nw = (long long)stream_ctas * a.warps;
  const unsigned long long t0 = globaltimer();
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long b = gw * DEPTH; b + DEPTH - 1 < a.blocks; b += nw * DEPTH) {
    uint4 v[DEPTH];
#pragma unroll
    for (int k = 0; k < DEPTH; ++k) v[k] = ld_stream(a.stream + (b + k) * 32 + lane);
#pragma unroll
    for (int k = 0; k < DEPTH; ++k) {
      acc.x ^= v[k].x;
      acc.y += v[k].y;
      acc.z ^= v[k].z;
      acc.w += v[k].w;
    }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) a.out[7] = 1;  // never: keeps loads
  __syncwarp();
  if (lane == 0) {
    atomicMax(&a.out[5], globaltimer());
    atomicMin(&a.out[4], t0);
    __threadfence();
    atomicAdd(a.done, 1u);
  }
}

template <int DEPTH>
void run(const Args& base, int grid, int warps, int loaded, size_t smem) {
  Args a = base;
  a.warps = warps;
  a.loaded = loaded;
  CK(cudaMemset(a.flags, 0, 64 * sizeof(unsigned)));
  CK(cudaMemset(a.done, 0, sizeof(unsigned)));
  std::vector<unsigned long long> init(8, 0);
  init[4] = ~0ull;
  CK(cudaMemcpy(a.out, init.data(), 8 * sizeof(unsigned long long), cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(probe_kernel<DEPTH>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)smem));
  probe_kernel<DEPTH><<<grid, 512, smem>>>(a);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long o[8];
  CK(cudaMemcpy(o, a.out, sizeof(o), cudaMemcpyDeviceToHost));
  const double oneway = (double)o[0] / (2.0 * (double)o[1]);
  const double chase = (double)o[2] / (double)o[3];
  const int streamers = loaded ? grid : grid - 3;
  double tbs = 0.0;
  long long blocks_read = 0;
  if (warps > 0) {
    blocks_read = a.blocks / DEPTH * DEPTH;
    tbs = (double)blocks_read * 512.0 / (double)(o[5] - o[4]) / 1e3;
  }
  const double inflight_kb = warps * 32.0 * 16.0 * DEPTH / 1024.0;
  std::printf("%6d %5d %5d %10.1f %12.1f %12.1f %10.2f %12.1f\n", loaded, warps, DEPTH, inflight_kb,
              inflight_kb * streamers / 1024.0, oneway, chase, tbs);
}

int main() {
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const size_t bytes = (size_t)2 << 30;
  Args a{};
  void* buf;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMemset(buf, 1, bytes));
  a.stream = (const uint4*)buf;
  a.blocks = (long long)(bytes / 512);
  CK(cudaMalloc(&a.flags, 64 * sizeof(unsigned)));
  CK(cudaMalloc(&a.done, sizeof(unsigned)));
  CK(cudaMalloc(&a.out, 8 * sizeof(unsigned long long)));
  // Chain: 512 entries 128 bytes apart (64 KB), a fixed odd stride so the order is not
  // sequential.
  const int n = 512, stride_words = 32;
  std::vector<unsigned> chain(n * stride_words, 0);
  for (int i = 0; i < n; ++i) chain[i * stride_words] = ((i * 97 + 31) % n) * stride_words;
  unsigned* dchain;
  CK(cudaMalloc(&dchain, chain.size() * sizeof(unsigned)));
  CK(cudaMemcpy(dchain, chain.data(), chain.size() * sizeof(unsigned), cudaMemcpyHostToDevice));
  a.chain = dchain;
  const size_t smem = 160 * 1024;  // one CTA per SM
  std::printf("# %s, %d SMs; 2 GiB streamed per configuration; loaded 0: the probes' SMs\n"
              "# stream nothing, 1: they stream like every other SM\n",
              prop.name, sms);
  std::printf("%6s %5s %5s %10s %12s %12s %10s %12s\n", "loaded", "warps", "depth", "KB/SM", "MB total",
              "handoff ns", "L2hit ns", "stream TB/s");
  for (int loaded : {0, 1}) {
    run<1>(a, sms, 0, loaded, smem);
    for (int w : {15, 8, 4}) {
      run<1>(a, sms, w, loaded, smem);
      run<2>(a, sms, w, loaded, smem);
      run<4>(a, sms, w, loaded, smem);
      run<6>(a, sms, w, loaded, smem);
      run<8>(a, sms, w, loaded, smem);
    }
  }
  return 0;
}
