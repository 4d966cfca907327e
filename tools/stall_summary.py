"""Where the decode kernel's warps wait, from Nsight Compute's per-instruction source page.

    ncu --clock-control none -k mk_decode -c 1 --section WarpStateStats \
        --section SourceCounters -o rep python3 -m monokernel.bench ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz
    python3 tools/stall_summary.py src.csv.gz

(`scripts/gpu_check.sh` runs all three as its `stalls` stage.) Prints the sampled warp states
over the whole kernel, the machine code executed at all (the instruction caches' working
set), the warp states of each loop body (instructions grouped by how often they ran: a
stage's row loop runs a count of its own), and the instructions with the most samples, the
most instruction-fetch stalls and the most shared-memory bank conflicts.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

INSTR_BYTES = 16  # every Hopper instruction
STALL_PREFIX = "stall_"
EXCESS = "L1 Wavefronts Shared Excessive"  # column absent from pages without memory metrics


@dataclass(frozen=True, slots=True)
class Instr:
    offset: int  # bytes from the kernel's first instruction
    sass: str
    executed: int  # warp-level executions
    stalls: dict[str, int]  # sampled warp states, by reason
    smem_excess: int  # shared-memory wavefronts beyond the ideal (bank conflicts)


def _int(s: str) -> int:
    return int(s.replace(",", "")) if s.strip() not in ("", "-") else 0


def read_source_page(text: str) -> list[Instr]:
    """The rows of ``ncu --page source --csv --print-source sass`` (a kernel-name line, then
    the header, then one row per instruction)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[start], [r for r in rows[start + 1 :] if len(r) == len(rows[start])]
    if not data:
        raise ValueError("no instruction rows under the header: not an ncu source page")
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith(STALL_PREFIX) and "Not Issued" not in h]
    base = int(data[0][ix["Address"]], 16)
    return [
        Instr(
            offset=int(r[ix["Address"]], 16) - base,
            sass=r[ix["Source"]].strip(),
            executed=_int(r[ix["Instructions Executed"]]),
            stalls={h[len(STALL_PREFIX) :]: _int(r[ix[h]]) for h in reasons},
            smem_excess=_int(r[ix[EXCESS]]) if EXCESS in ix else 0,
        )
        for r in data
    ]


def _shares(c: Counter[str], n: int = 5) -> str:
    total = sum(c.values()) or 1
    return "  ".join(f"{k} {100 * v / total:.0f}%" for k, v in c.most_common(n))


def summarize(instrs: list[Instr], top: int = 10) -> str:
    out: list[str] = []
    total: Counter[str] = Counter()
    for ins in instrs:
        total.update(ins.stalls)
    samples = sum(total.values())
    out.append(
        f"{len(instrs)} instructions ({len(instrs) * INSTR_BYTES / 1024:.1f} KB), "
        f"{samples} warp samples"
    )
    out.append("warp states: " + _shares(total, 8))
    ran = [i for i in instrs if i.executed]
    lines = {i.offset // 128 for i in ran}
    out.append(
        f"code executed: {len(ran) * INSTR_BYTES / 1024:.1f} KB in "
        f"{len(lines)} 128-byte lines ({len(lines) * 128 / 1024:.1f} KB)"
    )

    by_count: dict[int, Counter[str]] = defaultdict(Counter)
    for ins in ran:
        by_count[ins.executed].update(ins.stalls)
    out.append("loop bodies (instructions run the same number of times), most samples first:")
    for count, c in sorted(by_count.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        out.append(f"  ran {count:>11,}  samples {sum(c.values()):>9,}  {_shares(c)}")

    def listing(title: str, key: Callable[[Instr], int]) -> None:
        out.append(title)
        for ins in sorted(instrs, key=key)[:top]:
            worst = max(ins.stalls, key=ins.stalls.get) if ins.stalls else "-"
            out.append(
                f"  +{ins.offset:<7d} samples {sum(ins.stalls.values()):>8,} "
                f"({worst})  no_inst {ins.stalls.get('no_inst', 0):>6,}  "
                f"smem excess {ins.smem_excess:>11,}  {ins.sass[:56]}"
            )

    listing("most samples:", lambda i: -sum(i.stalls.values()))
    listing("most instruction-fetch stalls (no_inst):", lambda i: -i.stalls.get("no_inst", 0))
    listing("most shared-memory bank conflicts:", lambda i: -i.smem_excess)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu source page as CSV (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        print(summarize(read_source_page(f.read()), args.top))


if __name__ == "__main__":
    main()
