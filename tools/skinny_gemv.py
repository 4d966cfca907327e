"""How fast do weights stream through the tensor cores? (GPU machine)

    PYTHONPATH=src python3 tools/skinny_gemv.py [--k 2048,4096,8192] [--mb 256]

The skinny-GEMV benchmark (kernels/csrc/skinny_gemv_bench.cu): y[n] = W x[n] for N = 1, 2, 4,
8, 16 vectors in one pass over W, bf16, FP8 (E4M3, a scale a row) and 4-bit (groups of 128)
weights, the products on the tensor cores. For each format, K and N: µs a pass, the weight
bytes' rate against the copy bandwidth measured in the same run, and the relative L2 error
against the fp64 product on the same (dequantised) weights. The decode kernel's CUDA-core
GEMV streams bf16 at 90-96% of the copy bandwidth, FP8 at 69-82% and 4-bit at 52-58%
(docs/benchmarks.md); a verify pass of N positions costs it ~N times the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from monokernel.kernels import skinny_gemv as sk


def copy_bandwidth(mb: int = 1024) -> float:
    """Bytes/s of a device-to-device copy (read + write), median of 5."""
    a = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / sorted(times[1:])[2]


CHECKED_ROWS = 2048  # rows compared with the fp64 product


def operands(fmt: str, rows: int, k: int, gen: torch.Generator):
    """(packed bytes, pairs or None, the first CHECKED_ROWS rows of the fp32 matrix they
    stand for, weight bytes), on the GPU."""
    dev = "cuda"
    if fmt == "bf16":
        w = (torch.randn(rows, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        return sk.pack_bf16(w), None, w[:CHECKED_ROWS].float(), rows * k * 2
    if fmt == "fp8":
        w = torch.randn(rows, k, generator=gen, device=dev) * 0.02
        scale = w.abs().amax(1) / 448.0
        w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
        ref = w8[:CHECKED_ROWS].float() * scale[:CHECKED_ROWS, None]
        return sk.pack_fp8(w8), scale.contiguous(), ref, rows * k + rows * 4
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8, device=dev)
    a = torch.rand(rows, k // sk.GROUP, generator=gen, device=dev) * 0.004 + 0.001
    b = -8 * a + torch.randn(rows, k // sk.GROUP, generator=gen, device=dev) * 1e-3
    packed, pairs = sk.pack_int4(q, a, b)
    m = CHECKED_ROWS
    return packed, pairs, sk.dequant_int4(q[:m], a[:m], b[:m]), rows * k // 2 + pairs.numel() * 4


def run(fmt: str, n: int, rows: int, k: int, cubin, sms: int, reps: int) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(rows + k + n)
    packed, pairs, ref_w, nbytes = operands(fmt, rows, k, gen)
    xd = torch.randn(n, k, generator=gen, device="cuda")
    y = torch.zeros(n, rows, device="cuda")
    ks = sk.slice_for(k, n, fmt)
    grid, per = sk.grid_for(k, ks, sms)
    kern = sk.SkinnyGemv(cubin, torch.cuda.current_device(), fmt, n, ks)
    p = sk.params(packed, pairs, xd, y, ks, per)
    stream = torch.cuda.current_stream().cuda_stream
    kern.launch(grid, p, stream)
    torch.cuda.synchronize()
    want = xd.double() @ ref_w.double().T  # [n, CHECKED_ROWS]
    err = float((y[:, : ref_w.shape[0]].double() - want).norm() / want.norm())
    del ref_w
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        kern.launch(grid, p, stream)
    e.record()
    e.synchronize()
    kern.unload()
    sec = s.elapsed_time(e) / 1e3 / reps
    return {"format": fmt, "n": n, "rows": rows, "k": k, "ks": ks, "grid": grid,
            "us": round(sec * 1e6, 2), "gb_s": round(nbytes / sec / 1e9, 1),
            "rel_l2": float(f"{err:.2e}")}  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", default="2048,4096,8192", help="columns of W (comma-separated)")
    ap.add_argument("--mb", type=int, default=256, help="weight bytes of W (sets its rows)")
    ap.add_argument("--n", default=",".join(map(str, sk.NS)))
    ap.add_argument("--formats", default=",".join(sk.FORMATS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args(argv)
    cubin = sk.build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {copy / 1e12:.2f} TB/s")
    rows_out = []
    for fmt in args.formats.split(","):
        for k in map(int, args.k.split(",")):
            per_row = {"bf16": 2 * k, "fp8": k}.get(fmt, k // 2 + (k // sk.GROUP) * 8)
            rows = max(16, (args.mb << 20) // per_row // 16 * 16)
            base = None
            for n in map(int, args.n.split(",")):
                r = run(fmt, n, rows, k, cubin, sms, args.reps)
                base = base or float(r["us"])  # type: ignore[arg-type]
                r["of_copy"] = round(float(r["gb_s"]) * 1e9 / copy, 3)  # type: ignore[arg-type]
                r["vs_n1"] = round(float(r["us"]) / base, 3)  # type: ignore[arg-type]
                rows_out.append(r)
                print(json.dumps(r), flush=True)
    print("\nformat  K      N   us/pass  GB/s    of copy  vs N=1  rel L2")
    row = (
        "{format:6}  {k:<5}  {n:<2}  {us:8.1f}  {gb_s:6.0f}  {of_copy:7.1%}  {vs_n1:6.2f}  {rel_l2}"
    )
    for r in rows_out:
        print(row.format(**r))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"copy_bytes_s": copy, "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
