"""What each sampling setting costs the monokernel: decode µs/token for greedy, temperature,
the penalties and logit_bias, min_p, top-k, top-p and logprobs, one after another in one
process on the same backend (random weights in the named shape, a 64-token prompt, 256
tokens timed on the host between the first and the last, median of 5 rounds).

    PYTHONPATH=src python3 tools/sampling_cost.py [SHAPE]     (default llama-3.2-1b)
"""

import statistics
import sys
import time

import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel import MonokernelBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.random_weights import random_weights

shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
cfg = SHAPES[shape]
dev = torch.device("cuda", 0)
tokens = 256
mk = MonokernelBackend(cfg, random_weights(cfg, device=dev, seed=0), 64 + tokens + 1, dev)
prompt = torch.randint(0, 3000, (64,), generator=torch.Generator().manual_seed(1)).tolist()
CASES = {
    "plain": SamplingParams(temperature=0.0),
    "penalties": SamplingParams(
        temperature=0.0,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.2,
        logit_bias={5: 1.0},
    ),
    "logprobs5": SamplingParams(temperature=0.0, logprobs=5),
    "min_p": SamplingParams(temperature=0.8, seed=1, min_p=0.05),
    "top_p": SamplingParams(temperature=0.8, seed=1, top_p=0.9),
    "top_k": SamplingParams(temperature=0.8, seed=1, top_k=50),
    "sampled": SamplingParams(temperature=0.8, seed=1),
}


def run(sp: SamplingParams) -> float:
    lps = [] if sp.logprobs is not None else None
    req = DecodeRequest(tuple(prompt), sp, tokens, frozenset(), None, lps)
    stamps = [time.perf_counter() for _ in mk.stream(req, CancelToken())]
    assert len(stamps) == tokens, len(stamps)
    return (stamps[-1] - stamps[0]) / (tokens - 1) * 1e6


for sp in CASES.values():
    run(sp)
res = {k: [] for k in CASES}
for _ in range(5):
    for k, sp in CASES.items():
        res[k].append(run(sp))
base = statistics.median(res["plain"])
print(f"{shape} {torch.cuda.get_device_name()} ({tokens} tokens after 64, median of 5):")
for k, v in res.items():
    m = statistics.median(v)
    print(f"  {k:10} {m:8.1f} µs/token  {m / base:.3f}x  {[round(x, 1) for x in v]}")
