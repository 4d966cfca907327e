// The model's layers for one step or one verify pass (s.count positions), stage by stage:
// the part of decode.cu's step loop and verify_passes.cuh's pass loop that is the same.
#pragma once
#include "stage_attention.cuh"
#include "stage_attn_norm_qkv.cuh"
#include "stage_mlp_down.cuh"
#include "stage_mlp_gate_up.cuh"
#include "stage_o_proj.cuh"

__device__ __forceinline__ void run_layers(const Params& p, Cta& c, const Step& s) {
  debug_stall(p, s.index);
  mark_ns(p, s.index, kMarkStepStartNs);
  mark(p, s.index, kMarkStepStart);
  for (int layer = 0; layer < MK_L; ++layer) {
    const Layer l{p.layers[layer], layer, flow_tag(s.index, layer), flow_tag(s.index, layer - 1),
                  Net::reduce_tag(p, s.index, layer)};
    attn_norm_qkv(p, c, s, l);  // A: RMSNorm + QKV projection -> qkv
    attention(p, c, s, l);      // B: qk-norm + RoPE + KV append + attention -> attn_out
    o_proj(p, c, s, l);         // C: O projection -> delta
    mlp_gate_up(p, c, s, l);    // D: x + delta, RMSNorm, gate/up, SiLU·mul -> act
    mlp_down(p, c, s, l);       // E: down projection + residual -> x
  }
}
