// The tensor-parallel prefill's all-reduce (runtime/prefill_exchange.py): a small kernel each
// rank launches on its own stream after a block, so a rank's whole prefill can be one CUDA
// graph instead of one per block with the host copying partials between them.
//
// Standalone (decode.cu does not include it). Every rank holds two partial buffers (the
// attention block's and the MLP block's, [rows, hidden] fp32) in memory its peers can load
// from. An exchange pulls: CTA b of each rank tells CTA b of every peer that its partial is
// complete (the blocks that wrote it ran before this kernel on the rank's stream), waits
// until every peer has said the same, then reads every rank's partial and adds them to its
// residual in rank order 0..N-1, then the bias: the same fp32 additions in the same order as
// the host path (prefill_tp.ShardedPrefill.reduce), so every rank holds the same bits.
//
// Why no rank overwrites a partial a peer still reads: a rank writes its attention partial
// again only after its next MLP exchange, which needs every peer's MLP signal, which a peer
// sends only after its attention exchange (the read) has finished; the same holds for the
// MLP partial one exchange later. Two buffers, strictly alternating, are the whole protocol.
//
// The signal is a counter, not a flag: a rank's CTA b counts its exchanges (count[b], its own
// memory) and stores the count into slot [b][rank] of every peer's arrivals; it waits for its
// own slots [b][q] to reach that count. Every rank runs the same exchanges with the same
// grid, so the counts agree; a peer can be at most one exchange ahead (it cannot pass the
// next without our signal), hence ">=". Nothing is ever reset; u32 counts compare modulo 2^32.
#include "common.cuh"  // globaltimer

#define PAR_MAX_RANKS 8
#define PAR_MAX_CTAS 256
#define PAR_THREADS 256

// Mirrored field by field by monokernel/kernels/prefill_allreduce.py (ctypes).
struct PrefillArParams {
  const float* parts[PAR_MAX_RANKS];  // rank q's partial [rows, hidden] (peer addresses)
  unsigned* arrivals[PAR_MAX_RANKS];  // rank q's [PAR_MAX_CTAS][PAR_MAX_RANKS] signal slots
  unsigned* count;                    // [PAR_MAX_CTAS] this rank's exchanges, per CTA
  float* x;                           // [rows, hidden] the residual: += every partial, + bias
  const float* bias;                  // [hidden] or null
  int rank;
  int nranks;
  int rows;
  int hidden;
  unsigned timeout_ms;  // per wait: a peer that never comes ends in a trap, not a hang
};

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 of each CTA: signal every peer, then wait for every peer's signal.
__device__ void handshake(const PrefillArParams& p) {
  const int b = blockIdx.x;
  const unsigned e = p.count[b] + 1;
  p.count[b] = e;
  for (int q = 0; q < p.nranks; ++q)
    if (q != p.rank) st_release_sys(p.arrivals[q] + b * PAR_MAX_RANKS + p.rank, e);
  const unsigned long long t0 = globaltimer();
  const unsigned long long limit = 1000000ull * p.timeout_ms;
  for (int q = 0; q < p.nranks; ++q) {
    if (q == p.rank) continue;
    const unsigned* slot = p.arrivals[p.rank] + b * PAR_MAX_RANKS + q;
    while (static_cast<int>(ld_acquire_sys(slot) - e) < 0) {
      if (globaltimer() - t0 > limit) __trap();  // the context is lost; the host sees it
    }
  }
}

// One thread's share, NR ranks: U float4s a round, every rank's loads of a round issued before
// any sum, so U * (NR + 1) 16-byte loads a thread are in flight. One load a thread and rank at
// a time left a peer's reads waiting on NVLink's latency (~4 KB an SM in flight).
template <int NR>
__device__ __forceinline__ void sum_vec4(const PrefillArParams& p, long long n4, long long first,
                                         long long stride) {
  constexpr int U = NR >= 8 ? 1 : 8 / NR;  // NR * U <= 8 partial float4s in registers
  float4* x = reinterpret_cast<float4*>(p.x);
  const float4* bias = reinterpret_cast<const float4*>(p.bias);
  const long long h4 = p.hidden / 4;
  for (long long base = first; base < n4; base += stride * U) {
    float4 v[U];
    float4 a[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + u * stride;
      if (i < n4) v[u] = x[i];
    }
#pragma unroll
    for (int q = 0; q < NR; ++q) {
      // L2-only loads: a peer's lines must not come from this SM's L1.
      const float4* part = reinterpret_cast<const float4*>(p.parts[q]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long i = base + u * stride;
        if (i < n4) a[q][u] = __ldcg(part + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + u * stride;
      if (i >= n4) continue;
#pragma unroll
      for (int q = 0; q < NR; ++q) {  // rank order: the same bits on every rank
        v[u].x += a[q][u].x;
        v[u].y += a[q][u].y;
        v[u].z += a[q][u].z;
        v[u].w += a[q][u].w;
      }
      if (bias != nullptr) {
        const float4 c = bias[i % h4];
        v[u].x += c.x;
        v[u].y += c.y;
        v[u].z += c.z;
        v[u].w += c.w;
      }
      x[i] = v[u];
    }
  }
}

extern "C" __global__ void __launch_bounds__(PAR_THREADS) prefill_allreduce(const PrefillArParams p) {
  if (p.nranks > 1) {
    if (threadIdx.x == 0) handshake(p);
    __syncthreads();  // thread 0's acquire orders every thread's reads of the peers' partials
  }
  const long long n = static_cast<long long>(p.rows) * p.hidden;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p.hidden % 4 == 0) {
    const long long n4 = n / 4;
    switch (p.nranks) {
      case 1: sum_vec4<1>(p, n4, first, stride); break;
      case 2: sum_vec4<2>(p, n4, first, stride); break;
      case 3: sum_vec4<3>(p, n4, first, stride); break;
      case 4: sum_vec4<4>(p, n4, first, stride); break;
      case 5: sum_vec4<5>(p, n4, first, stride); break;
      case 6: sum_vec4<6>(p, n4, first, stride); break;
      case 7: sum_vec4<7>(p, n4, first, stride); break;
      default: sum_vec4<PAR_MAX_RANKS>(p, n4, first, stride); break;
    }
  } else {
    for (long long i = first; i < n; i += stride) {
      float v = p.x[i];
      for (int q = 0; q < p.nranks; ++q) v += __ldcg(p.parts[q] + i);
      if (p.bias != nullptr) v += p.bias[i % p.hidden];
      p.x[i] = v;
    }
  }
}
