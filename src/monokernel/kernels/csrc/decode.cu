// The monokernel: one persistent CTA per SM runs every decode step of a request.
//
// A step is the model, stage by stage (one file each): per layer, attention RMSNorm + QKV,
// attention (qk-norm, RoPE, KV append), O projection, MLP norm + gate/up + SiLU·mul, MLP
// down + residual; then the final norm + LM head and the token. Stages hand their outputs
// over as tagged data (flow.cuh): the next stage's readers spin on the values themselves, no
// grid barrier; before waiting for its input, each warp issues the first loads of its next
// stage (cta.cuh hand_off), so HBM keeps streaming meanwhile. Tensor parallelism differs only
// inside Net (tp.cuh); the buffers shared with the host are described in layout.cuh.
#include "layers.cuh"
#include "stage_lm_head.cuh"
#include "stage_sample.cuh"
#include "verify_passes.cuh"

// The step build's loop: one token a step.
__device__ __forceinline__ void decode_steps(const Params& p, Cta& c) {
  int token = p.first_token;
  for (int step = 0; step < p.n_steps; ++step) {
    const Step s{step, p.start_pos, token};
    run_layers(p, c, s);
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
