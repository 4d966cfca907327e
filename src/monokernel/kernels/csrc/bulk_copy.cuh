// The copy engine's 1-D bulk copies from global into shared memory and the mbarriers they
// complete on: no registers hold the bytes in flight and no thread issues a load per lane,
// so how far ahead a stream runs is set by the shared memory it may fill, not by registers
// (attention_window.cuh's K/V ring, gemv_tiles_ring.cuh's weight ring).
#pragma once
#include <stdint.h>

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// An mbarrier that one arrival (the issuing thread's expect_tx) plus the copies' bytes
// complete.
__device__ __forceinline__ void mbar_init(unsigned long long* mbar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(mbar)) : "memory");
}

// Before the mbarrier's memory is used for anything else.
__device__ __forceinline__ void mbar_inval(unsigned long long* mbar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(mbar)) : "memory");
}

// The issuing thread's arrival, announcing the bytes the phase's copies will bring.
__device__ __forceinline__ void mbar_expect(unsigned long long* mbar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(bytes)
               : "memory");
}

// Spin until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(const unsigned long long* mbar, unsigned parity) {
  const unsigned mb = smem_addr(mbar);
  unsigned ok = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(mb), "r"(parity)
        : "memory");
  } while (!ok);
}

// One 1-D bulk copy (16-byte aligned, a multiple of 16 bytes) completing on `mbar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(mbar))
      : "memory");
}

// Shared memory last read or written through ordinary accesses: order those before the copy
// engine's writes.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
