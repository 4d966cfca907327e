// Stage B: qk-norm, RoPE, the KV-cache append of the new position and decode attention, one
// CTA per unit of this step's plan -> attn_out [Q] (or partials stage C merges). The parts:
// attention_window.cuh (the plan and the K/V window, filled a stage ahead), attention.cuh
// (head units: one query head over a range that fits the window), attention_group.cuh (group
// units: a KV head's query group over a range of any length, for long context).
#pragma once
#include "attention_pass.cuh"
#include "cta.cuh"
#include "stage_o_proj.cuh"

__device__ __forceinline__ void attention(const Params& p, Cta& c, const Step& s,
                                          const Layer& l) {
  if constexpr (MK_P > 1)
    attention_stage_pass(p, l.w, l.index, s.pos(), s.count, c.attn_done_q, l.tag, c.att, c.red,
                         c.kvwin);
  else
    attention_stage(p, l.w, l.index, s.pos(), c.attn_done, c.attn_done_g, l.tag, c.att, c.red,
                    c.kvwin);
  skew(p, s.index, l.index, kSkewAttentionDone);
  hand_off(p, c, s, l, kMarkAttentionWork, kMarkAttentionWait,
           [&] { o_proj_first(p, c, l.w); });
}
