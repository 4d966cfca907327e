"""Time the first token's LM head (GPU machine): one hidden vector against the bf16 LM head,
the GEMV the prefill runs when it draws a request's first token, in the forms cuBLAS offers,
against the bytes it must read at the copy bandwidth measured here.

    PYTHONPATH=src python3 scripts/lm_head_gemv.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from monokernel.bench.measure import copy_bandwidth, graph_ms
from monokernel.runtime.prefill import gemm_bf16

SHAPES = {"llama-3.2-1b": (128256, 2048), "qwen2.5-coder-1.5b": (151936, 1536)}


def _forms(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    xb = x.to(torch.bfloat16)
    return {
        "mm(x, W^T) -> fp32 (prefill's)": lambda: gemm_bf16(x, w)[0],
        "mm(W, x^T) -> fp32": lambda: torch.mm(w, xb.t(), out_dtype=torch.float32)[:, 0],
        "mv(W, x) -> bf16": lambda: torch.mv(w, xb[0]),
        "mm(x, W^T) -> bf16": lambda: torch.mm(xb, w.t())[0],
    }


def main() -> int:
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name(dev)} | copy bw {bw / 1e9:.0f} GB/s")
    print(f"{'shape':<19} {'form':<34} {'ms':>7} {'GB/s':>6} {'max |diff|':>10}")
    for name, (vocab, hidden) in SHAPES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dev, torch.bfloat16)
        x = torch.randn(1, hidden, generator=g).to(dev)
        want = (x.to(torch.bfloat16).double() @ w.double().t())[0]
        nbytes = w.numel() * 2
        for form, fn in _forms(w, x).items():
            ms = graph_ms(fn)
            diff = float((fn().double() - want).abs().max())
            print(f"{name:<19} {form:<34} {ms:>7.3f} {nbytes / ms / 1e6:>6.0f} {diff:>10.2e}")
        print(f"{name:<19} {'floor at the copy bandwidth':<34} {nbytes / bw * 1e3:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
