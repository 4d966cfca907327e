// The kernel's one argument. Mirrored field by field by monokernel/kernels/launcher.py
// (ctypes): pointers first, then 4-byte scalars, so both sides agree on the layout.
#pragma once
#include "common.cuh"

struct LayerWeights {               // one entry per layer, in a device array
  const bf16* wqkv;                 // [Q + 2*KV, H]  rows: q heads, k heads, v heads; attn_norm folded
  const float* bqkv;                // [Q + 2*KV]     or null
  const float* q_norm;              // [D]            or null
  const float* k_norm;              // [D]            or null
  const bf16* wo;                   // [H, Q]
  const float* bo;                  // [H]            or null
  const bf16* wgu;                  // [2*I, H]       row 2r = gate r, 2r+1 = up r; ffn_norm folded
  const bf16* wdown;                // [H, I]
  const float* attn_gain;           // [H] or null (null: folded into wqkv)
  const float* ffn_gain;            // [H] or null (null: folded into wgu)
};

struct Params {
  const LayerWeights* layers;       // [L]
  const bf16* embed;                // [V, H]   unfolded
  const bf16* lm_head;              // [V, H]   final norm folded (unless norm_gain)
  const float* norm_gain;           // [H] or null
  const float* rope_cos;            // [max_len, D/2]
  const float* rope_sin;            // [max_len, D/2]
  bf16* k_cache;                    // [L, NKV, max_len, D]
  bf16* v_cache;                    // [L, NKV, max_len, D]
  float* x;                         // [H]          residual stream
  float* qkv;                       // [Q + 2*KV]   projections before norm/RoPE
  float* attn;                      // [slots = NH * max(attn_splits, attn_group_splits), D]
                                    //   unnormalised partial attention outputs of ranges
  float* attn_ml;                   // [slots, 4] their running max and exp-sum: pairs for
                                    //   a unit's merge, (m, l, -, -) for stage C's (tagged)
  float* delta;                     // [H]          O-projection output (residual added in D)
  float* attn_out;                  // [Q]          merged attention output
  unsigned* attn_count;             // [NH + NKV] ranges finished per head, then per KV head
                                    // (group units); monotonic, zeroed per launch
  float* act;                       // [I]          silu(gate) * up
  float* logits;                    // [V]          this step's logits
  float* part_score;                // [2 * grid]   best (score, id) of each CTA: its score
  int* part_id;                     // [grid]       and id, or [grid] tagged 64-bit words
                                    //   (token_words.cuh); zeroed per launch
  int* flags;                       // [4]  [0] cancel seen (barrier path), [1] token from
                                    //   the slow sampler
  unsigned* barrier;                // [32 * (1 + WARPS)] zeroed per launch: [0] the monotonic
                                    //   grid-barrier counter; [32 * (1 + w)] warp slot w's
                                    //   LM-head tickets (drawn_rows.cuh)
  const int* forced;                // [n_steps] input token of each step (teacher forcing) or null
  float* debug_logits;              // [n_steps, V] or null
  const int* stop_ids;              // [n_stop]
  volatile int* host_out;           // host-mapped: [0] count, [1] done, [2 + i] token i + 1
  volatile int* host_cancel;        // host-mapped: nonzero asks the kernel to stop
  long long* timing;                // [10L + 6] clock64 stage marks of one step (decode.cu), or null
  int max_len;
  int first_token;
  int start_pos;                    // position of first_token
  int n_steps;                      // tokens to produce at most
  int n_stop;
  int top_k;                        // 0: off
  float temperature;                // 0: greedy
  float top_p;                      // 1: off
  unsigned seed_lo, seed_hi;
  float eps;
  int timing_step;                  // the step whose stages `timing` records
  int attn_splits;                  // head units: ranges per head at most (grid / NH; 0: none)
  int attn_group_splits;            // group units: ranges per KV head at most (grid / NKV)
  int attn_group_from;              // context length from which group units are used anyway
  int pad_;
#if MK_TP > 1
  // Tensor parallelism (tp.cuh). Receive buffer of each rank: [2 parities][MK_TP sources][H]
  // {value, tag} pairs for the two residual reductions per layer, then [2 parities][MK_TP]
  // 16-byte {score, tag, id*2 + cancel, tag} units for the token exchange.
  unsigned* tp_recv[MK_TP_MAX];     // rank k's receive buffer as seen from this GPU (peer ptrs)
  unsigned* tp_mine;                // this rank's own buffer (== tp_recv[tp_rank]; no dynamic index)
  int tp_rank;
  int vocab_start;                  // global id of this rank's first LM-head row
  unsigned tp_tag;                  // first generation of this launch; the host never reuses one
  int tp_pad_;
#endif
};
