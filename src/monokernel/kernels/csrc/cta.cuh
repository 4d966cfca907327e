// What one CTA of the decode kernel carries from stage to stage: where each stage's data lives
// in shared memory (layout.cuh's carve-up), the thread's ranks, the grid-wide choices made once
// a launch, the barrier and completion counters, and the first batch of each stage's weights,
// held in registers across the hand-off before it (gemv.cuh). The stages take it by reference;
// everything is inlined, so these are the kernel's registers, as plain locals would be.
#pragma once
#include "flow.cuh"
#include "gemv.cuh"
#include "sampling.cuh"
#include "token_words.cuh"
#include "tp.cuh"

// Warps sharing a unit of stages A, C and D: a row (tunables.cuh), or in a tile format a
// tile of 16 rows (build.py's per-shape tile splits; D then runs as a split GEMV too).
constexpr int kSplitQkv = QkvFormat::kTiles ? MK_TILE_SPLIT_A : kSplitA;
constexpr int kSplitO = WeightFormat::kTiles ? MK_TILE_SPLIT_C : kSplitC;
constexpr int kSplitD = MK_TILE_SPLIT_D;

// The split GEMVs' shapes, one register buffer each (F's shares A's).
using SA = Split<QkvFormat, MK_H, kSplitQkv>;      // A: QKV
using SC = Split<WeightFormat, MK_Q, kSplitO>;     // C: O projection
using SE = Split<DownFormat, MK_I, MK_SPLIT_E>;    // E: down projection
using SF = Split<HeadFormat, MK_H, kSplitF>;       // F: the LM head (its own format)
using SD = Split<WeightFormat, MK_H, kSplitD>;     // D in a tile format: a tile of pairs
using GateUp = RowShape<WeightFormat, MK_H, MK_BATCH2>;  // D: one gate or up row
// The columns of E's slice before its tiles' last batch of loads (a tile format's).
template <class F>
constexpr int late_cols() {
  if constexpr (F::kTiles)
    return ((SE::Shape::N + SE::Shape::B - 1) / SE::Shape::B - 1) * SE::Shape::B * F::kLoadCols;
  else
    return 0;
}
// E's input streamed by each warp (MK_E_STREAM, flow.cuh TileInputsStreamed): tile formats
// in D and E, one K-slice a warp, a step build, and a slice of more than one batch (one
// batch has nothing to start on early); D then takes its tiles in the order E reads their rows.
constexpr bool kEStream = MK_E_STREAM && MK_P == 1 && WeightFormat::kTiles &&
                          DownFormat::kTiles && SE::GROUPS == 1 && late_cols<DownFormat>() > 0;
static_assert(kEStream == (MK_E_STREAM != 0),
              "MK_E_STREAM: 1 exactly where E's input can stream (build.py down_input_streamed)");
using GateUpOrder =
    std::conditional_t<kEStream, TilesTailsLast<SE::S, (SE::KP - late_cols<DownFormat>()) / 8>,
                       TilesInOrder>;
template <class Src>
using EInput = TileInputsStreamed<DownFormat, SE::KP, late_cols<DownFormat>(), Src>;
// D's buffers: a gate row and an up row, or a tile format's first batch (and no up row).
constexpr int kPreG = WeightFormat::kTiles ? SD::Shape::B : GateUp::B;
constexpr int kPreU = WeightFormat::kTiles ? 1 : GateUp::B;
using WeightLoad = WeightFormat::Load;
using QkvLoad = QkvFormat::Load;
using DownLoad = DownFormat::Load;
using HeadLoad = HeadFormat::Load;
// A buffer issued on one path only would stay live through every layer and spill: the LM
// head's first row goes into A's buffer (its first entries where its rows are shorter; the
// buffer is the longer of the two where the head's format differs). Where the two formats'
// loads differ in type (a tile format's side data, a bf16 head), the head's 16-byte loads
// go into the entries' weight words (.w) and are copied out in the head (lm_head).
constexpr bool kSharedPreAF = std::is_same_v<QkvLoad, HeadLoad>;
constexpr int kPreAF = cmax(SA::Shape::B, SF::Shape::B);
static_assert(std::is_same_v<HeadLoad, uint4>, "a head format's load is its 16 bytes");

// A load's 16 bytes of weights: the load itself, or a tile format's weight words.
template <class L>
__device__ __forceinline__ uint4& weight_words(L& u) {
  if constexpr (std::is_same_v<L, uint4>)
    return u;
  else
    return u.w;
}

// The sampler's scratch in this CTA's shared memory (layout.cuh's carve-up) and the grid's.
__device__ __forceinline__ SampleScratch sample_scratch(float* smem, const Params& p) {
  SampleScratch ss;
  ss.h64 = reinterpret_cast<unsigned long long*>(smem + kSmemSample);
  ss.h32 = reinterpret_cast<unsigned*>(ss.h64 + 256);
  ss.misc = reinterpret_cast<int*>(ss.h32 + 256);
  ss.red = smem + kSmemRed;
  ss.part = p.sample_part;
  ss.barrier = p.barrier;
  return ss;
}

struct Cta {
  // Shared memory.
  float* xs;     // the current stage's input vector (a GEMV input: swizzled, common.cuh)
  float* xres;   // [H] the residual after attention, from D to E
  float* att;    // stage B's scratch; the split-K partials (part) between attention units
  float* red;    // [64] reductions
  float* xd;     // [H] stage D's normalised input: E's slices overwrite xs while D reads this
  float* gn;     // [H] the next norm's gain, staged at the end of the stage before it
  float* kvwin;  // the K/V window ring (attention_window.cuh)
  SampleScratch ss;
  // Ranks.
  int t, lane, warp;
  int gw;     // this warp's first gate/up pair in stage D, then every tw-th
  int tw;     // warps in the grid
  int c_cta;  // this CTA's rank in stage C's row order
  // Choices of the launch, the same for every step.
  bool greedy;    // temperature 0
  bool host_cta;  // the CTA that talks to the host (cancel word, token words)
  bool flow;      // hand-offs as tagged data (flow.cuh); else a grid barrier each
  bool filtered;  // top-k / top-p / min_p / logprobs: the grid draws from the whole distribution
  bool words;     // the step ends on token words (token_words.cuh), not a grid barrier
  // Counters every CTA advances alike.
  unsigned bar;        // grid barriers passed (the monotonic counter's target)
  unsigned attn_done;  // attention ranges finished so far, per head and per KV head group
  unsigned attn_done_g;
  unsigned attn_done_q[MK_P];  // a pass build's (head units): per query of the pass
  // First batches held in registers across hand-offs, one buffer per stage shape.
  QkvLoad preAF[kPreAF];
  WeightLoad preC[SC::Shape::B];
  DownLoad preE[SE::Shape::B];
  WeightLoad preG[kPreG], preU[kPreU];

  __device__ __forceinline__ QkvLoad (&preA())[SA::Shape::B] {
    return *reinterpret_cast<QkvLoad(*)[SA::Shape::B]>(&preAF);
  }
  // The head's first batch where its loads are A's type (kSharedPreAF).
  template <bool kShared = kSharedPreAF>
  __device__ __forceinline__ HeadLoad (&preF())[SF::Shape::B] {
    static_assert(kShared, "the head's loads sit in A's weight words (head_first)");
    return *reinterpret_cast<HeadLoad(*)[SF::Shape::B]>(&preAF);
  }
  // The split-K partial sums [WARPS, SLOTS]: the attention scratch is idle during the GEMVs.
  __device__ __forceinline__ float* part() const { return att; }

  __device__ __forceinline__ void init(const Params& p, float* smem) {
    xs = smem + kSmemXs;
    xres = smem + kSmemXres;
    att = smem + kSmemAtt;
    red = smem + kSmemRed;
    xd = att + kAttXd;
    gn = att + kAttGain;
    kvwin = smem + kSmemWindow;  // 16-byte aligned: every region above is 4k floats
    ss = sample_scratch(smem, p);

    t = threadIdx.x, lane = t & 31, warp = t >> 5;
    // Ranks across CTAs first, so a last, partial round of pairs (Qwen2.5-1.5B: 8,960 pairs
    // on 2,112 warps) spreads over every SM instead of filling the first CTAs.
    gw = warp * gridDim.x + blockIdx.x;
    tw = gridDim.x * kWarps;
    // Rows numbered from the last CTA: the units with a row more sit on the CTAs without an
    // attention unit (the first ones), which reach C's input first.
    c_cta = (int)gridDim.x - 1 - (int)blockIdx.x;
    greedy = p.temperature == 0.f;
    // The last CTA has the fewest LM-head and QKV rows (they go out CTA by CTA), so it has
    // the slack to absorb the host's PCIe round trips.
    host_cta = blockIdx.x == gridDim.x - 1;
    flow = flow_possible<SC::GROUPS, SE::GROUPS, WeightFormat::kTileRows>();
    filtered = Net::filtered(p, greedy);
    words = kTokenWords && !filtered;
    bar = 0;
    attn_done = 0, attn_done_g = 0;
#pragma unroll
    for (int q = 0; q < MK_P; ++q) attn_done_q[q] = 0;
  }
};

// One layer of one step: its weights (a reference into global memory, re-read at each use:
// fewer live registers than holding the pointers) and the tags of its hand-offs (flow.cuh).
struct Layer {
  const LayerWeights& w;
  int index;
  unsigned tag;    // this layer's outputs
  unsigned tag_x;  // the residual x as this layer reads it (the previous layer's, or the embedding)
  unsigned red;    // the generation of this layer's first all-reduce (tensor parallelism)
};

// One decode step. Its position and input token are derived where used, not held across
// the layer loop, where each would take a register. In a pass build (MK_P > 1) a step is a
// verify pass over `count` positions from pos(): the inputs are the forced tokens
// (Params::forced, count a pass).
struct Step {
  int index;
  int start;  // Params::start_pos
  int token;  // the last token drawn (Params::first_token before the first step)
  int count = 1;           // positions of this pass (1 in a step build)
  int pos0 = 0;            // a pass's first position
  const int* in = nullptr;  // a pass's input tokens (shared memory), where not forced
  // The position of this step's (first) input token.
  __device__ __forceinline__ int pos() const { return MK_P == 1 ? start + index : pos0; }
  // This step's input token (position q of a pass): the last one drawn, or the one the host
  // forces (debug runs); a pass's drafted ones after its first.
  __device__ __forceinline__ int input(const Params& p, int q = 0) const {
    if constexpr (MK_P == 1) return p.forced ? p.forced[index] : token;
    return p.forced ? p.forced[index * count + q] : in[q];
  }
};

// A clock64 mark of one layer's stage in the profiled step (probes.cuh).
__device__ __forceinline__ void mark(const Params& p, const Step& s, const Layer& l, LayerMark m) {
  mark(p, s.index, mark_slot(m, l.index));
}

// The hand-off from a stage to the next (flow.cuh): `next` issues the next stage's first
// loads between the arrival and the wait, so HBM streams while this CTA waits for its input.
// The stage's marks: `work` once those loads are out, `wait` once its successor may start.
template <class Next>
__device__ __forceinline__ void hand_off(const Params& p, Cta& c, const Step& s, const Layer& l,
                                         LayerMark work, LayerMark wait, Next next) {
  handoff_arrive(c.flow, p.barrier, c.bar);
  next();
  mark(p, s, l, work);
  handoff_wait(c.flow, p.barrier, c.bar);
  mark(p, s, l, wait);
}
