// The monokernel: one persistent CTA per SM runs every decode step of a request.
//
// Per token: embedding -> per layer [A: norm+QKV | B: qk-norm+RoPE+KV append+attention |
// C: O-proj+residual | D: norm+gate/up+SiLU*mul | E: down+residual] -> F: final norm + LM
// head + per-CTA best (score, id) -> sampling -> stop check -> token to host-mapped memory.
// Inside a step, stages hand their outputs over as tagged data (flow.cuh): the next stage's
// readers spin on the values themselves, no grid barrier. One grid barrier per step remains,
// after the LM head. Before waiting for its input, each warp issues the first loads of its
// first row of the next stage (gemv.cuh), so HBM keeps streaming meanwhile.
#include "attention.cuh"
#include "drawn_rows.cuh"
#include "flow.cuh"
#include "gemv.cuh"
#include "params.cuh"
#include "probes.cuh"
#include "sampling.cuh"
#include "token_words.cuh"
#include "tp.cuh"

#define MK_QKV (MK_Q + 2 * MK_KV)
// Warps sharing one row (split-K) per stage; see gemv_split.
#ifndef MK_SPLIT_A
#define MK_SPLIT_A 2
#endif
#ifndef MK_SPLIT_C
#define MK_SPLIT_C 2
#endif
#ifndef MK_SPLIT_E
#define MK_SPLIT_E 4
#endif
// The LM head's split. Its first row goes into stage A's register buffer (the first entries
// where its rows are shorter): a buffer issued on one path only would stay live through
// every layer and spill.
#ifndef MK_SPLIT_F
#define MK_SPLIT_F 2
#endif
// 1: the LM head's rows alternate between two register buffers (gemv.cuh gemv_split's
// PINGPONG), two rows in flight a warp instead of one (docs/perf-notes.md step 58).
#ifndef MK_F_PINGPONG
#define MK_F_PINGPONG 1
#endif
// 1: stage D's gate/up pairs numbered across CTAs first (measured on an H100,
// docs/perf-notes.md step 28: Qwen2.5-Coder-1.5B 1,384 vs 1,416 µs/token, Llama-3.2-1B
// 1,003 vs 1,007); 0: CTA by CTA, as before.
#ifndef MK_D_INTERLEAVE
#define MK_D_INTERLEAVE 1
#endif
// Host I/O once per token is two PCIe round trips on one thread: the cancel word's read
// (before that CTA arrives at the step's barrier, so every CTA waits for it) and, with
// MK_TOKEN_FENCE=1, a system fence after the token's write (before that CTA's next layer 0;
// the host now polls the token words themselves, so the fence orders nothing it needs).
// MK_HOST_CTA_LAST=1 gives both to the last CTA, which has the fewest LM-head and QKV rows
// (the rows go out CTA by CTA), so it has slack to absorb them; 0: CTA 0, as before
// (docs/perf-notes.md step 29: -3 µs/token on Llama-3.2-1B, -11 on Qwen2.5-Coder-1.5B).
#ifndef MK_HOST_CTA_LAST
#define MK_HOST_CTA_LAST 1
#endif
#ifndef MK_TOKEN_FENCE
#define MK_TOKEN_FENCE 0
#endif
// 1: the cancel word is read before the LM head and used after it, so its PCIe round trip
// hides behind the LM head; 0: read after it, on the way to the step's end, as before.
#ifndef MK_CANCEL_EARLY
#define MK_CANCEL_EARLY 1
#endif
// 1: the hand-off D -> E per team of warps that share one K slice of the down projection
// (load_flow_team): a team fetches its slice of act and starts its rows while other warps
// still finish their gate/up pairs, and the pairs of D's last, partial round go to the teams
// of the last slices, whose inputs come last anyway. 0: the whole CTA waits for all of act.
// Measured on an H100 (docs/perf-notes.md, step 37): Llama-3.2-1B -1 to -7 µs/token in
// every run; Qwen2.5-Coder-1.5B -10 to +24, different from one process to the next; so off.
#ifndef MK_E_TEAMS
#define MK_E_TEAMS 0
#endif
// 1: stage C's rows numbered from the last CTA, so the units with a second row (Qwen2.5-1.5B:
// 1,536 rows on 1,056 units) sit on the CTAs without an attention unit (the first ones),
// which reach C's input first. Measured on an H100 (step 37): Llama-3.2-1B -3 µs/token,
// Qwen2.5-Coder-1.5B -8 to -13.
#ifndef MK_C_FROM_LAST
#define MK_C_FROM_LAST 1
#endif
// Rows of D's first gate/up pair issued before the hand-off C -> D (2: both, 1: the gate row,
// 0: neither); the rest go out once D's input is in. Fewer bytes in flight at the hand-off
// make its polls' L2 round trips shorter (scripts/loaded_latency.cu on an H100: an L2 hit
// takes 0.17 us with nothing in flight, 0.7 us with 60 KB in flight on every SM), at the
// price of D's first loads starting later. Measured on an H100 (step 39), three processes:
// Qwen2.5-Coder-1.5B -12.6 / -16.4 / -13.7 µs/token with 1 against 2, Llama-3.2-1B -0.2 /
// -1.7 / -6.1; with 0: +1 / +7.6. The same trade at the hand-offs into A, C and E lost.
// Since D's input settles through registers (step 46) the trade has turned for Llama-3.2-1B:
// 2 against 1 -4 and -8, Qwen2.5-Coder-1.5B -1 to +7; 0 is +8 / +17. build.py picks it per
// shape (gate_up_rows_before_input).
#ifndef MK_D_PRE
#define MK_D_PRE 1
#endif
static_assert(MK_D_PRE >= 0 && MK_D_PRE <= 2, "MK_D_PRE: 0, 1 or 2 rows");

// Shared memory, in floats: xs [MK_XS] | xres [MK_H] | attention [MK_ATTN_SMEM] | red [64] |
// K/V window [MK_KVWIN_FLOATS] | h64 [256 x u64] | h32 [256] | misc [16]. build.py computes
// the same total.
#define MK_SMEM_FLOATS_A (((MK_XS + MK_H + MK_ATTN_SMEM + 64 + MK_KVWIN_FLOATS) + 3) & ~3)

// xs[0..K) <- src (fp32, written by other CTAs with `tag`, flow.cuh), swizzled as every GEMV
// input is (common.cuh); optionally RMS-normalised, the 1/rms deferred to the dot products
// (norm_scale). gain (may be null): the norm's gain when it was not folded into the next
// matrix, in global or (staged) shared memory. Returns the scale the stage's dot products
// still need: the norm's 1/rms, or 1.
template <int K>
__device__ __forceinline__ float load_vec(float* xs, const float* src, unsigned tag, bool norm,
                                          float eps, float* red, const float* gain = nullptr) {
  if (norm) return norm_scale<K>(load_flow<K>(xs, src, tag, gain), red, eps);
  load_flow<K>(xs, src, tag);
  __syncthreads();
  return 1.f;
}

// Layer 0's input: the token's embedding row times the norm's gain into xs (swizzled, a GEMV
// input) and, by CTA 0, the row into x (tag_x) for the residual. Each thread takes whole
// 4-float chunks, the ones whose gain it staged (stage_gain), so it reads its gain without a
// barrier. Returns the norm's 1/rms, deferred to the dot products (norm_scale).
__device__ __forceinline__ float embed_norm(const Params& p, float* xs, int tok, unsigned tag_x,
                                            const float* gain, float* red) {
  const bf16* row = p.embed + (size_t)tok * MK_H;
  const int so = swz_off(xs + 4 * threadIdx.x);  // the same for every chunk of this thread
  cp_async_wait_all();                           // this thread's staged gain chunks
  float ss = 0.f;
  for (int i = 4 * threadIdx.x; i < MK_H; i += 4 * MK_THREADS) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + i);
    const float v[4] = {bf_lo(u.x), bf_hi(u.x), bf_lo(u.y), bf_hi(u.y)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      xs[i + so + k] = gain ? v[k] * gain[i + k] : v[k];
      ss += v[k] * v[k];
      if (blockIdx.x == 0) st_flow_copies(p.x + i + k, MK_H, v[k], tag_x);
    }
  }
  return norm_scale<MK_H>(ss, red, p.eps);
}

// A valid row for a warp that has none in a stage: its early loads stay harmless, and every
// register buffer is written on every path (no values carried around the loops, no spills).
__device__ __forceinline__ size_t clamp_row(int r, int rows) {
  return (size_t)(r < rows ? r : rows - 1);
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) mk_decode(const Params p) {
  extern __shared__ __align__(16) float smem[];
  float* xs = smem;              // [XS] the current stage's input vector
  float* xres = xs + MK_XS;      // [H]  residual after attention, from D to E
  float* att = xres + MK_H;
  float* red = att + MK_ATTN_SMEM;
  // [H] stage D's normalised input, in the attention scratch after the split-K partials
  // (`part`): not in xs, which E's slices overwrite while D's last pairs still read this.
  float* xd = att + MK_WARPS * MK_SPLIT_SLOTS;
  // [H] the next norm's gain (stage_gain), copied at the end of the stage before that norm.
  float* gn = xd + MK_H;
  static_assert(MK_ATTN_SMEM >= MK_WARPS * MK_SPLIT_SLOTS + 2 * MK_H,
                "build.py sizes MK_ATTN_SMEM");
  float* kvwin = red + 64;  // 16-byte aligned: every region above is a multiple of 4 floats
  SampleScratch ss;
  ss.h64 = reinterpret_cast<unsigned long long*>(smem + MK_SMEM_FLOATS_A);
  ss.h32 = reinterpret_cast<unsigned*>(ss.h64 + 256);
  ss.misc = reinterpret_cast<int*>(ss.h32 + 256);
  ss.red = red;

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  using SA = Split<MK_H, MK_SPLIT_A>;
  using SC = Split<MK_Q, MK_SPLIT_C>;
  using SE = Split<MK_I, MK_SPLIT_E>;
  // The warp's rank in stage D. With E's teams, the teams of the last K slices of the down
  // projection rank first: they take D's last, partial round of pairs (the last entries of
  // act), so the teams whose slices are complete earlier are free to start E.
#if MK_E_TEAMS
  const int drank = (SE::S - 1 - warp % SE::S) * SE::GROUPS + warp / SE::S;
#else
  const int drank = warp;
#endif
  // This warp's rank in the grid: its first gate/up pair in stage D, then every tw-th.
#if MK_D_INTERLEAVE
  // Ranks across CTAs first, so a last, partial round of pairs (Qwen2.5-1.5B: 8,960 pairs
  // on 2,112 warps) spreads over every SM instead of filling the first CTAs.
  const int gw = drank * gridDim.x + blockIdx.x;
#else
  const int gw = blockIdx.x * MK_WARPS + drank;
#endif
  const int tw = gridDim.x * MK_WARPS;  // warps in the grid
  const int c_cta = MK_C_FROM_LAST ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
  const bool greedy = p.temperature == 0.f;
  const bool host_cta = blockIdx.x == (MK_HOST_CTA_LAST ? gridDim.x - 1 : 0);
  const bool flow =
      flow_possible<Split<MK_Q, MK_SPLIT_C>::GROUPS, Split<MK_I, MK_SPLIT_E>::GROUPS>();
  // top-k / top-p need the whole vocabulary; under TP it is split over ranks, so the host
  // refuses those requests and the kernel never takes the slow path.
#if MK_TP > 1
  const bool filtered = false;
#else
  const bool filtered = !greedy && ((p.top_k > 0 && p.top_k < MK_V) || p.top_p < 1.f);
#endif
  // The step ends on tagged token words (token_words.cuh) instead of a grid barrier.
  const bool words = MK_TOKEN_WORDS && !filtered;
  auto* const token_words = reinterpret_cast<unsigned long long*>(p.part_score);
  unsigned bar = 0;
  // Ranges finished so far per head (head units) and per KV head (group units): the values
  // stage B's completion counters reach, tracked alike by every CTA (attention_window.cuh).
  unsigned attn_done = 0, attn_done_g = 0;
  int token = p.first_token;

  // First batches held in registers across barriers, one buffer per stage shape.
  uint4 preA[SA::Shape::B], preC[SC::Shape::B], preE[SE::Shape::B];  // preA also serves F
  using SF = Split<MK_H, MK_SPLIT_F>;
  static_assert(SF::Shape::B <= SA::Shape::B, "the LM head's first batch must fit in preA");
  uint4(&preF)[SF::Shape::B] = *reinterpret_cast<uint4(*)[SF::Shape::B]>(&preA);
  uint4 preG[RowShape<MK_H, MK_BATCH2>::B], preU[RowShape<MK_H, MK_BATCH2>::B];
  float* part = att;  // split-K partial sums [WARPS, SLOTS]; attention scratch is idle then
  stage_gain<MK_H>(gn, p.layers[0].attn_gain);
  issue_first<SA::KP, MK_BATCH>(preA, split_first<MK_H, MK_SPLIT_A>(p.layers[0].wqkv, MK_QKV, warp),
                                lane);

  attention_window_init(kvwin);
  attention_prefetch(p, 0, p.start_pos, kvwin);

  for (int step = 0; step < p.n_steps; ++step) {
    const int pos = p.start_pos + step;
    const int in_tok = p.forced ? p.forced[step] : token;
    int mk = 0;  // timing slot
    if (profiling(p, step)) p.timing[10 * MK_L + 5] = (long long)globaltimer();
    mark(p, step, mk++);
    for (int layer = 0; layer < MK_L; ++layer) {
      const LayerWeights& lw = p.layers[layer];  // re-read at each use: 20 fewer live registers
      const unsigned tag = flow_tag(step, layer), tag_x = flow_tag(step, layer - 1);
#if MK_TP > 1
      // Generations of this layer's two all-reduces (after O-proj, after down).
      const unsigned tag_c = p.tp_tag + 2u * (unsigned)(step * MK_L + layer);
#endif
      // ---- A: RMSNorm + QKV projection -> qkv [QKV]
      float ra = 1.f;  // the norm's 1/rms where it is deferred to the dot products
      if (layer == 0) {
        ra = embed_norm(p, xs, in_tok, tag_x, staged_gain(gn, lw.attn_gain), red);
      } else {
#if MK_TP > 1
        tp_load_residual(p, xs, xres, tag_c - 1u, tag_x, p.eps, red,
                         staged_gain(gn, lw.attn_gain));  // prev. E
#else
        ra = load_vec<MK_H>(xs, flow_copy(p.x, MK_H), tag_x, true, p.eps, red,
                            staged_gain(gn, lw.attn_gain));
#endif
      }
      skew(p, step, layer, 0);
      gemv_split<MK_H, MK_SPLIT_A>(
          lw.wqkv, MK_QKV, xs, part, warp, lane, preA,
          [&](int r, float d) { st_flow(p.qkv + r, d, tag); }, (int)blockIdx.x,
          MK_QKV_BIAS ? lw.bqkv : nullptr, ra);
      mark(p, step, mk++);
      skew(p, step, layer, 1);
      handoff_arrive(flow, p.barrier, bar);
      prefetch_pairs_l2<MK_H>(lw.wgu, MK_I, gw, tw, lane);  // off unless MK_PF_PAIRS > 0
      handoff_wait(flow, p.barrier, bar);
      mark(p, step, mk++);

      // ---- B: attention, one CTA per unit of this step's plan -> attn_out
      attention_stage(p, lw, layer, pos, attn_done, attn_done_g, tag, att, red, kvwin);
      skew(p, step, layer, 2);
      handoff_arrive(flow, p.barrier, bar);
      issue_first<SC::KP, MK_BATCH>(preC, split_first<MK_Q, MK_SPLIT_C>(lw.wo, MK_H, warp, c_cta),
                                    lane);
      mark(p, step, mk++);
      handoff_wait(flow, p.barrier, bar);
      mark(p, step, mk++);

      // ---- C: O projection -> delta [H]
      if (attn_reader_merges(attn_plan(p, pos))) {
        load_attn_merged(p, attn_plan(p, pos).ns, tag, xs, att);
      } else {
        load_vec<MK_Q>(xs, flow_copy(p.attn_out, MK_Q), tag, false, p.eps, red);
      }
      skew(p, step, layer, 3);
      gemv_split<MK_Q, MK_SPLIT_C>(lw.wo, MK_H, xs, part, warp, lane, preC, [&](int r, float d) {
#if MK_TP > 1
        tp_send(p, tag_c, r, d);  // partial, bias-free: o-bias is added once after the sum (D)
#else
        st_flow_copies(p.delta + r, MK_H, d, tag);
#endif
      }, c_cta, MK_O_BIAS && MK_TP == 1 ? lw.bo : nullptr);
      skew(p, step, layer, 4);
      handoff_arrive(flow, p.barrier, bar);
      stage_gain<MK_H>(gn, lw.ffn_gain);
      if (MK_D_PRE >= 1)
        issue_first<MK_H, MK_BATCH2>(preG, lw.wgu + 2 * clamp_row(gw, MK_I) * MK_H, lane);
      if (MK_D_PRE >= 2)
        issue_first<MK_H, MK_BATCH2>(preU, lw.wgu + (2 * clamp_row(gw, MK_I) + 1) * MK_H, lane);
      mark(p, step, mk++);
      handoff_wait(flow, p.barrier, bar);
      mark(p, step, mk++);

      // ---- D: residual (x + delta, kept in xres for E) + RMSNorm + gate/up + SiLU*mul -> act
      float rd = 1.f;  // the norm's 1/rms where it is deferred to the dot products
      {
        float s2 = 0.f;
#if MK_TP > 1
        for (int i = t; i < MK_H; i += MK_THREADS) {
          float dl = tp_sum(p, tag_c, i);
#if MK_O_BIAS
          dl += lw.bo[i];
#endif
          const float v = ld_flow(flow_copy(p.x, MK_H) + i, tag_x) + dl;
          xres[i] = v;
          s2 += v * v;
        }
#else
        // x and delta in one round trip (xs is scratch for delta); xres <- x + delta, and
        // with the norm deferred xd <- (x + delta) * gain.
        s2 = load_flow_sum<MK_H>(xres, flow_copy(p.x, MK_H), tag_x, xs, flow_copy(p.delta, MK_H),
                                 tag, xd, staged_gain(gn, lw.ffn_gain));
#endif
        if (MK_D_PRE < 1)
          issue_first<MK_H, MK_BATCH2>(preG, lw.wgu + 2 * clamp_row(gw, MK_I) * MK_H, lane);
        if (MK_D_PRE < 2)
          issue_first<MK_H, MK_BATCH2>(preU, lw.wgu + (2 * clamp_row(gw, MK_I) + 1) * MK_H, lane);
#if MK_TP > 1
        const float r = rms_scale<MK_H>(s2, red, p.eps);
        const float* g = staged_gain(gn, lw.ffn_gain);
        const int so = swz_off(xd + t);  // xd is a GEMV input (common.cuh)
        for (int i = t; i < MK_H; i += MK_THREADS) xd[i + so] = xres[i] * (g ? r * g[i] : r);
        __syncthreads();
#else
        rd = norm_scale<MK_H>(s2, red, p.eps);  // publishes xd and xres
#endif
      }
      skew(p, step, layer, 5);
      gemv_pairs<MK_H>(lw.wgu, MK_I, gw, tw, xd, lane, preG, preU, [&](int r, float g, float u) {
        g *= rd;
        u *= rd;
        if (lane == 0) st_flow_copies(p.act + r, MK_I, g / (1.f + expf(-g)) * u, tag);
      });
      skew(p, step, layer, 6);
      // With E's teams and data as flag, no CTA-wide wait here: E's slices land in xs, which
      // D no longer reads (xd), and each team waits for its own slice and partners only.
      if (!MK_E_TEAMS || !flow) handoff_arrive(flow, p.barrier, bar);
      issue_first<SE::KP, MK_BATCH>(preE, split_first<MK_I, MK_SPLIT_E>(lw.wdown, MK_H, warp),
                                    lane);
      // The next layer's cached keys and values (positions before pos, appended in earlier
      // steps, so ordered by the barrier that ends every step) are copied into the window now,
      // inside a long bandwidth-bound stage, so the copies' issue and flight stay off the
      // latency-bound A -> B path. Layer 0's copy waits for that barrier (after F).
      if (layer + 1 < MK_L) attention_prefetch(p, layer + 1, pos, kvwin);
      mark(p, step, mk++);
      handoff_wait(flow, p.barrier, bar);
      mark(p, step, mk++);

      // ---- E: down projection + residual -> x [H]
#if MK_E_TEAMS
      load_flow_team<MK_I, MK_SPLIT_E>(xs, flow_copy(p.act, MK_I), tag, warp, lane);
#else
      load_vec<MK_I>(xs, flow_copy(p.act, MK_I), tag, false, p.eps, red);
#endif
      skew(p, step, layer, 7);
      gemv_split<MK_I, MK_SPLIT_E>(lw.wdown, MK_H, xs, part, warp, lane, preE,
                                   [&](int r, float d) {
#if MK_TP > 1
                                     tp_send(p, tag_c + 1u, r, d);  // summed at the next A / F
#else
                                     st_flow_copies(p.x + r, MK_H, xres[r] + d, tag);
#endif
                                   });
      skew(p, step, layer, 8);
      const bf16* next_first =
          layer + 1 < MK_L
              ? split_first<MK_H, MK_SPLIT_A>(p.layers[layer + 1].wqkv, MK_QKV, warp)
              : split_first<MK_H, MK_SPLIT_F>(p.lm_head, MK_V, warp);
      handoff_arrive(flow, p.barrier, bar);
      stage_gain<MK_H>(gn, layer + 1 < MK_L ? p.layers[layer + 1].attn_gain : p.norm_gain);
      if (SF::KP == SA::KP || layer + 1 < MK_L)
        issue_first<SA::KP, MK_BATCH>(preA, next_first, lane);
      else
        issue_first<SF::KP, MK_BATCH>(preF, next_first, lane);
      mark(p, step, mk++);
      handoff_wait(flow, p.barrier, bar);
      mark(p, step, mk++);
    }

    // ---- F: final RMSNorm + LM head + this CTA's best draw
    // The host's cancel word (one PCIe read a token): MK_CANCEL_EARLY.
    const bool cancel_early = MK_CANCEL_EARLY && host_cta && t == 0 && *p.host_cancel != 0;
#if MK_TP > 1
    tp_load_residual(p, xs, xres, p.tp_tag + 2u * (unsigned)((step + 1) * MK_L) - 1u,
                     flow_tag(step, MK_L - 1), p.eps, red,
                     staged_gain(gn, p.norm_gain));  // the last layer's down all-reduce
    const float rf = 1.f;
#else
    const float rf = load_vec<MK_H>(xs, flow_copy(p.x, MK_H), flow_tag(step, MK_L - 1), true,
                                    p.eps, red, staged_gain(gn, p.norm_gain));
#endif
    const uint32_t key = draw_key(p.seed_lo, p.seed_hi, pos + 1);  // position of the new token
    float best = -INFINITY;
    int best_id = 0x7fffffff;
    // Whole rounds of rows dealt statically, the rest by tickets (drawn_rows.cuh); this warp's
    // first ticket is drawn now, so its round trip hides behind the static rows.
    const int f_static = static_rows(MK_V, SF::GROUPS);
    const unsigned f_got = MK_F_DRAWN && lane == 0 ? draw_ticket(ticket_counter(p.barrier)) : 0u;
    auto lm_out = [&](int r, float logit) {
      p.logits[r] = logit;
      if (p.debug_logits) p.debug_logits[(size_t)step * MK_V + r] = logit;
#if MK_TP > 1
      const int gid = p.vocab_start + r;  // noise and tie-break keyed by the global id
      const float sc = greedy ? logit : logit / p.temperature + gumbel(key, gid);
      if (better(sc, gid, best, best_id)) { best = sc; best_id = gid; }
#else
      const float sc = greedy ? logit : logit / p.temperature + gumbel(key, r);
      if (better(sc, r, best, best_id)) { best = sc; best_id = r; }
#endif
    };
    gemv_split<MK_H, MK_SPLIT_F, MK_F_PINGPONG>(p.lm_head, f_static, xs, part, warp, lane, preF,
                                                 lm_out, (int)blockIdx.x, nullptr, rf);
    if (MK_F_DRAWN)
      gemv_drawn<MK_H>(p.lm_head, row_tickets(p.barrier, f_static, MK_V, step), f_got, xs,
                       lane, lm_out, rf);
    warp_argmax(best, best_id);
    if (lane == 0) {
      red[warp] = best;
      ss.h32[warp] = (unsigned)best_id;
    }
    __syncthreads();
    if (t == 0) {
      float b = red[0];
      int bi = (int)ss.h32[0];
      for (int w = 1; w < MK_WARPS; ++w)
        if (better(red[w], (int)ss.h32[w], b, bi)) { b = red[w]; bi = (int)ss.h32[w]; }
      const bool cancel = MK_CANCEL_EARLY ? cancel_early : host_cta && *p.host_cancel != 0;
      if (words) {
        publish_token_word(token_words, b, bi, cancel, step);
      } else {
        p.part_score[blockIdx.x] = b;
        p.part_id[blockIdx.x] = bi;
        if (host_cta) p.flags[0] = cancel;
      }
    }
    if (!words) grid_arrive(p.barrier, bar);
    stage_gain<MK_H>(gn, p.layers[0].attn_gain);  // F's norm is done with gn
    issue_first<SA::KP, MK_BATCH>(
        preA, split_first<MK_H, MK_SPLIT_A>(p.layers[0].wqkv, MK_QKV, warp), lane);
    mark(p, step, mk++);
    if (!words) {
      grid_wait(p.barrier, bar);
      if (step + 1 < p.n_steps)  // every KV append of this step is visible now
        attention_prefetch(p, 0, pos + 1, kvwin);
    }
    mark(p, step, mk++);

    // ---- sampling: every CTA reduces the partials itself (no extra barrier), unless
    // top-k/top-p needs the whole distribution: then CTA 0 draws and publishes the token.
    int next;
    bool cancelled = false;  // under TP: rank 0's cancel word; with token words: the host's
    if (filtered) {
      if (blockIdx.x == 0) {
        next = sample_filtered(p, key, ss);
        if (t == 0) p.flags[1] = next;
      }
      grid_barrier(p.barrier, bar);
      next = __ldcg(p.flags + 1);
    } else {
      float b = -INFINITY;
      int bi = 0x7fffffff;
      bool cancel_seen = false;
      for (int c = t; c < (int)gridDim.x; c += MK_THREADS) {
        float s;
        int i;
        if (words) {
          const unsigned long long w = wait_token_word(token_words, c, step);
          s = token_word_score(w);
          i = token_word_id(w);
          cancel_seen |= token_word_cancel(w);
        } else {
          s = __ldcg(p.part_score + c);
          i = __ldcg(p.part_id + c);
        }
        if (better(s, i, b, bi)) { b = s; bi = i; }
      }
      if (words) {
        // Every word is in (acquired): this step's KV appends are visible to the copies.
        cancelled = __syncthreads_or(cancel_seen);
        if (step + 1 < p.n_steps) attention_prefetch(p, 0, pos + 1, kvwin);
      }
      warp_argmax(b, bi);
      __syncthreads();
      if (lane == 0) {
        red[warp] = b;
        ss.h32[warp] = (unsigned)bi;
      }
      __syncthreads();
      if (t == 0) {
        for (int w = 1; w < MK_WARPS; ++w)
          if (better(red[w], (int)ss.h32[w], b, bi)) { b = red[w]; bi = (int)ss.h32[w]; }
#if MK_TP > 1
        ss.misc[1] = tp_pick_token(p, step, b, bi);  // bi: the winner over all ranks
#endif
        ss.misc[0] = bi;
      }
      __syncthreads();
      next = ss.misc[0];
#if MK_TP > 1
      cancelled = ss.misc[1] != 0;
#endif
      __syncthreads();
    }
#if MK_TP > 1
    // Rank 0's cancel word, as exchanged with the token: every rank stops at the same step.
    bool done = step + 1 == p.n_steps || cancelled;
#else
    bool done = step + 1 == p.n_steps || (words ? cancelled : __ldcg(p.flags) != 0);
#endif
    for (int i = 0; i < p.n_stop; ++i) done |= p.stop_ids[i] == next;
#if MK_TP > 1
    if (host_cta && t == 0 && p.tp_rank == 0) {  // one rank speaks to the host
#else
    if (host_cta && t == 0) {
#endif
      // Nonzero once written: the host polls each token's word (zeroed before the launch)
      // in order, so it needs no order among them; only `done` is fenced after them all.
      p.host_out[2 + step] = next + 1;
#if MK_TOKEN_FENCE
      __threadfence_system();
#endif
      p.host_out[0] = step + 1;  // the count, read once the kernel has exited
      if (done) {
        __threadfence_system();
        p.host_out[1] = 1;
      }
    }
    mark(p, step, mk++);
    if (profiling(p, step))  // with slot 10L+5: ns for the clock64 marks' cycles
      p.timing[mk] = (long long)globaltimer();
    token = next;
    if (done) break;
  }
  cp_async_wait_all();  // the next step's gain, staged for a step that will not run
  attention_window_drain(kvwin);
}
