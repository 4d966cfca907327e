// The monokernel: one persistent CTA per SM runs every decode step of a request.
//
// A step is the model, stage by stage (one file each): per layer, attention RMSNorm + QKV,
// attention (qk-norm, RoPE, KV append), O projection, MLP norm + gate/up + SiLU·mul, MLP
// down + residual; then the final norm + LM head and the token. Stages hand their outputs
// over as tagged data (flow.cuh): the next stage's readers spin on the values themselves, no
// grid barrier; before waiting for its input, each warp issues the first loads of its next
// stage (cta.cuh hand_off), so HBM keeps streaming meanwhile. Tensor parallelism differs only
// inside Net (tp.cuh); the buffers shared with the host are described in layout.cuh.
#include "stage_attention.cuh"
#include "stage_attn_norm_qkv.cuh"
#include "stage_lm_head.cuh"
#include "stage_mlp_down.cuh"
#include "stage_mlp_gate_up.cuh"
#include "stage_o_proj.cuh"
#include "stage_sample.cuh"
#include "verify_passes.cuh"

// The step build's loop: one token a step.
__device__ __forceinline__ void decode_steps(const Params& p, Cta& c) {
  int token = p.first_token;
  for (int step = 0; step < p.n_steps; ++step) {
    const Step s{step, p.start_pos, token};
    debug_stall(p, step);
    mark_ns(p, step, kMarkStepStartNs);
    mark(p, step, kMarkStepStart);
    for (int layer = 0; layer < MK_L; ++layer) {
      const Layer l{p.layers[layer], layer, flow_tag(step, layer), flow_tag(step, layer - 1),
                    Net::reduce_tag(p, step, layer)};
      attn_norm_qkv(p, c, s, l);  // A: RMSNorm + QKV projection -> qkv
      attention(p, c, s, l);      // B: qk-norm + RoPE + KV append + attention -> attn_out
      o_proj(p, c, s, l);         // C: O projection -> delta
      mlp_gate_up(p, c, s, l);    // D: x + delta, RMSNorm, gate/up, SiLU·mul -> act
      mlp_down(p, c, s, l);       // E: down projection + residual -> x
    }
    const uint32_t key = lm_head(p, c, s);  // F: final norm + LM head -> each CTA's best
    const Sampled next = sample(p, c, s, key);
    token = next.next;
    if (next.done) break;
  }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) mk_decode(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) float smem[];
  Cta c;
  c.init(p, smem);
  attn_norm_qkv_first(p, c, p.layers[0]);
  attention_window_init(c.kvwin);
  attention_prefetch(p, 0, p.start_pos, c.kvwin);

  if constexpr (MK_P > 1) {
    verify_passes(p, c);  // a pass build's loop (verify_passes.cuh)
  } else {
    decode_steps(p, c);
  }
  cp_async_wait_all();  // the next step's gain, staged for a step that will not run
  attention_window_drain(c.kvwin);
}
