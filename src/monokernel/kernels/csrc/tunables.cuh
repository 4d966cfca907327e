// The decode kernel's fixed tunables: the same for every shape and never set from outside.
// Each was measured on an H100; docs/perf-notes.md's journal has the runs. The choices that
// do vary by shape come from build.py as -D defines (its CHOICES table).
//
// kernels/layout.py reads the ones the host's buffers and the shared-memory carve-up depend
// on (threads, split-K slots, ticket stride, hand-off copies, ring stages and their size
// bound) from its own table; the generated layout.cuh static_asserts that both
// agree.
#pragma once

// Threads a CTA (one persistent CTA a SM): 16 warps, enough loads in flight to saturate HBM.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// 16-byte loads a lane keeps in flight for one row (8 spill registers).
constexpr int kBatch = 6;

// Warps sharing one row (split-K, gemv_split) in stages A (QKV) and C (O projection): more
// loads in flight for short rows. The down projection's split varies by shape (MK_SPLIT_E).
constexpr int kSplitA = 2;
constexpr int kSplitC = 2;
// The LM head's split; its first row goes into stage A's register buffer, so it never needs
// a buffer of its own that would stay live through every layer.
constexpr int kSplitF = 2;

// Rows a split-K unit combines per round: part[] holds kWarps x kSplitSlots partial sums.
constexpr int kSplitSlots = 32;

// Words of the barrier buffer before the first LM-head ticket counter and between two
// counters: one 128-byte line each, so warps drawing tickets never share a line.
constexpr int kTicketStride = 32;

// Copies of every hand-off vector all CTAs poll: each copy sees half the polls (one copy
// was slower, three or four no better, eight slower).
constexpr int kFlowCopies = 2;

// Offset in `red` (64 floats) of the warps' sums of squares for a deferred norm
// (norm_scale): clear of block_sum's slots and of attn_finish's flag at red[32].
constexpr int kNormRed = 40;

// Head units' independent score chains a thread: a short-context range is one pass.
constexpr int kAttnU = 4;

// Ring stages of the K/V window: each stage a group unit computes costs a fixed latency (three
// barriers, the max exchange, the mbarrier wait), so two large stages beat more small ones
// although only one is in flight while the other is computed.
constexpr int kAttnStages = 2;
// Positions per ring stage at most (sizes group units' probability scratch).
constexpr int kAttnPmax = 256;

// The CTA whose stage marks the profile records: CTA 0.
constexpr int kProfCta = 0;
