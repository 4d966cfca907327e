// In-kernel all-reduce microbenchmark: N GPUs of one process, NVLink peer-to-peer stores.
//
// Standalone (decode.cu does not include it). Each GPU runs this kernel at the same time;
// every iteration each GPU adds its partial fp32 vector into one all-reduced vector, the
// same bits on every GPU, `iters` times back to back in one launch, as the decode loop
// would twice per layer.
//
// Protocol (LL, "data as flag", as in NCCL's LL protocol): the wire unit is 16 bytes
// {float, tag, float, tag}, stored with one volatile vector store straight into the peer's
// memory. Each 8-byte half (value, tag) lands atomically, so a reader that sees this
// generation's tag in both halves holds both values: no separate flag, no fence on the
// send path, and nothing is ever reset. Tags only grow (the host continues them across
// launches and never uses 0, the value of freshly zeroed buffers), so stale data can never
// look current.
//
// Receive buffer of each GPU: [2 parities][N sources][n/2 units]. Generation g uses parity
// g & 1. A GPU writes generation g+2 into a peer's parity only after it has received the
// peer's g+1 data, which the peer sends only after it read all of g (same thread owns the
// same units in both phases here; in the decode kernel the next stage's dependence on the
// reduced vector gives the same order), so a slot is never overwritten before it is read.
//
// Summation is in rank order 0..N-1 on every GPU, so all GPUs hold identical results (the
// decode loop needs that: ranks that disagreed by one ulp could sample different tokens).
#include "common.cuh"  // globaltimer

#define AR_MAX_RANKS 8
#define AR_MAX_THREADS 512

// Mirrored field by field by monokernel/kernels/allreduce.py (ctypes).
struct ArParams {
  uint4* peer_recv[AR_MAX_RANKS];  // rank r's receive buffer as seen from this GPU (own: local)
  const float* in;                 // [n]  this rank's partial; iteration `it` adds (float)it
  float* out;                      // [n]  the reduced vector (every iteration writes it)
  unsigned long long* timing;      // [2 * gridDim.x] globaltimer ns: start of iteration 1, end
  int* error;                      // [1]  set to 1 when a peer's data did not arrive in time
  int rank;
  int nranks;                      // must equal the entry point's N
  int n;                           // floats, even
  int iters;
  unsigned base_tag;               // tags base_tag .. base_tag + iters - 1, never 0
  unsigned timeout_ms;             // per wait; a lost peer then ends the launch with an error
};

__device__ __forceinline__ void st_peer(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// volatile: every poll goes to L2, where the peer's NVLink stores land.
__device__ __forceinline__ uint4 ld_poll(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ float2 my_part(const float* in, int u, float bump) {
  float2 v = reinterpret_cast<const float2*>(in)[u];
  v.x += bump;
  v.y += bump;
  return v;
}

// Wait for unit u of every peer's slot of generation `tag`; the loads of all pending peers
// are issued together so their round trips overlap. False on timeout.
template <int N>
__device__ __forceinline__ bool gather(const uint4* recv, size_t units, int u, int rank,
                                       unsigned tag, unsigned timeout_ms, float2 (&v)[N]) {
  unsigned pending = ((1u << N) - 1u) & ~(1u << rank);
  unsigned spins = 0;
  unsigned long long t0 = 0;
  while (pending) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (pending & (1u << r)) {
        const uint4 w = ld_poll(recv + (size_t)r * units + u);
        if (w.y == tag && w.w == tag) {
          v[r] = make_float2(__uint_as_float(w.x), __uint_as_float(w.z));
          pending &= ~(1u << r);
        }
      }
    }
    if (pending && (++spins & 1023u) == 0) {
      const unsigned long long now = globaltimer();
      if (t0 == 0) t0 = now;
      else if (now - t0 > 1000000ull * timeout_ms) return false;
    }
  }
  return true;
}

template <int N>
__device__ __forceinline__ void allreduce_loop(const ArParams& p) {
  // Fields into registers once, with constant indices only (a dynamic index into the
  // parameter array would copy the whole struct to local memory).
  uint4* peer[N];
  const uint4* mine = p.peer_recv[0];
  const int rank = p.rank;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    peer[r] = p.peer_recv[r];
    if (r == rank) mine = peer[r];
  }
  const float* in = p.in;
  float2* out = reinterpret_cast<float2*>(p.out);
  const size_t units = (size_t)(p.n >> 1);
  const int stride = gridDim.x * blockDim.x;
  const int first = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long t_start = 0;
  bool ok = true;
  for (int it = 0; it < p.iters && ok; ++it) {
    if (it == 1 && threadIdx.x == 0) t_start = globaltimer();
    const unsigned tag = p.base_tag + (unsigned)it;
    const size_t par = (size_t)(tag & 1u) * N * units;
    const float bump = (float)it;
    // Push: this rank's partial into its slot of every peer's buffer.
    for (int u = first; u < (int)units; u += stride) {
      const float2 v = my_part(in, u, bump);
      const uint4 w = make_uint4(__float_as_uint(v.x), tag, __float_as_uint(v.y), tag);
#pragma unroll
      for (int r = 0; r < N; ++r)
        if (r != rank) st_peer(peer[r] + par + (size_t)rank * units + u, w);
    }
    // Gather and sum in rank order.
    for (int u = first; u < (int)units && ok; u += stride) {
      const float2 own = my_part(in, u, bump);
      float2 v[N];  // peers' values; indexed only by unrolled constants, so in registers
      ok = gather<N>(mine + par, units, u, rank, tag, p.timeout_ms, v);
      float2 acc = rank == 0 ? own : v[0];
#pragma unroll
      for (int r = 1; r < N; ++r) {
        const float2 x = r == rank ? own : v[r];
        acc.x += x.x;
        acc.y += x.y;
      }
      out[u] = acc;
    }
  }
  if (!ok) atomicExch(p.error, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    p.timing[2 * blockIdx.x] = t_start;
    p.timing[2 * blockIdx.x + 1] = globaltimer();
  }
}

// One entry point per N, so the per-peer loops unroll and v[] stays in registers.
#define AR_ENTRY(N)                                                                        \
  extern "C" __global__ void __launch_bounds__(AR_MAX_THREADS) ar_bench_##N(const ArParams p) { \
    allreduce_loop<N>(p);                                                                  \
  }
AR_ENTRY(1)
AR_ENTRY(2)
AR_ENTRY(3)
AR_ENTRY(4)
AR_ENTRY(5)
AR_ENTRY(6)
AR_ENTRY(7)
AR_ENTRY(8)
