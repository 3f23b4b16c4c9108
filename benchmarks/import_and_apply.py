"""What ``import dtensor_patches`` and the first ``apply_all()`` cost, for two checkouts side by
side (this one and another, e.g. the commit before a change), in one run.

Each round starts one fresh interpreter per checkout, in random order, with the checkout first
on ``sys.path``; the interpreter measures (wall and process CPU time) importing torch,
importing ``dtensor_patches`` (torch already imported), the first ``apply_all()`` (which
imports ``torch.distributed.tensor``) and a second ``apply_all()``, then ``revert_all()``.
Medians over the rounds, and the median of the per-round ratios (other / this)::

    python benchmarks/import_and_apply.py --other /path/to/other/checkout --rounds 15 \\
        --json docs/benchmarks/import_and_apply-<torch>.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

_PROBE = r"""
import json, sys, time
sys.path.insert(0, {root!r})
def clocks():
    return time.perf_counter(), time.process_time()
out = {{}}
w, c = clocks()
import torch
w1, c1 = clocks(); out["import torch"] = (w1 - w, c1 - c)
import dtensor_patches
w2, c2 = clocks(); out["import dtensor_patches"] = (w2 - w1, c2 - c1)
assert dtensor_patches.__file__.startswith({root!r}), dtensor_patches.__file__
dtensor_patches.apply_all()
w3, c3 = clocks(); out["first apply_all()"] = (w3 - w2, c3 - c2)
dtensor_patches.apply_all()
w4, c4 = clocks(); out["second apply_all()"] = (w4 - w3, c4 - c3)
dtensor_patches.revert_all()
w5, c5 = clocks(); out["revert_all()"] = (w5 - w4, c5 - c4)
print(json.dumps(out))
"""


def _run(root: Path) -> dict[str, list[float]]:
    code = _PROBE.format(root=str(root))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--other", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    roots = {"this": HERE, "other": args.other.resolve()}
    samples: dict[str, list[dict[str, list[float]]]] = {k: [] for k in roots}
    for _ in range(args.rounds):
        order = list(roots)
        random.shuffle(order)
        for key in order:
            samples[key].append(_run(roots[key]))
    rows = []
    for step in samples["this"][0]:
        row: dict[str, object] = {"step": step}
        for clock, index in (("wall", 0), ("cpu", 1)):
            for key in roots:
                row[f"{key} {clock} ms"] = round(
                    1e3 * statistics.median(s[step][index] for s in samples[key]), 2
                )
            ratios = [
                o[step][index] / t[step][index]
                for t, o in zip(samples["this"], samples["other"], strict=True)
                if t[step][index] > 0
            ]
            row[f"other/this {clock}"] = round(statistics.median(ratios), 3) if ratios else None
        rows.append(row)
    print(
        f"{'step':<22}{'this wall':>11}{'other wall':>12}{'o/t':>7}{'this cpu':>10}{'other cpu':>11}{'o/t':>7}"
    )
    for r in rows:
        print(
            f"{r['step']!s:<22}{r['this wall ms']:>11}{r['other wall ms']:>12}"
            f"{r['other/this wall']!s:>7}{r['this cpu ms']:>10}{r['other cpu ms']:>11}"
            f"{r['other/this cpu']!s:>7}"
        )
    if args.json:
        import torch

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "rounds": args.rounds,
                    "other": str(roots["other"]),
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
