#!/usr/bin/env python3
"""Two training runs' losses, step by step: the multi-GPU check of issue "KT SFT on several GPUs".

    compare_losses.py A/trainer_log.jsonl B/trainer_log.jsonl [--labels "1 GPU" "2 GPUs"] [--json OUT]

Prints one row per logged step (both losses, their difference) and the largest difference with its step;
``--json`` writes the same. Standard library only: it runs on the GPU host's python3 and here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def losses(trainer_log: Path) -> dict[int, float]:
    """``current_steps -> loss`` of LlamaFactory's trainer_log.jsonl (the last record of a step wins: a
    resumed run logs the steps after its checkpoint again)."""
    out: dict[int, float] = {}
    for line in Path(trainer_log).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("loss") is not None:
            out[int(record["current_steps"])] = float(record["loss"])
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    steps = sorted(set(a) & set(b))
    rows = [{"step": s, "a": a[s], "b": b[s], "diff": b[s] - a[s]} for s in steps]
    worst = max(rows, key=lambda r: abs(r["diff"]), default=None)
    return {"steps": len(rows), "only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a)), "rows": rows,
            "max_abs_diff": abs(worst["diff"]) if worst else None, "max_abs_diff_step": worst["step"] if worst else None,
            "first": rows[0] if rows else None, "last": rows[-1] if rows else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--labels", nargs=2, default=("a", "b"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = compare(losses(args.a), losses(args.b))
    result["labels"] = list(args.labels)
    la, lb = args.labels
    print(f"{'step':>5} {la:>12} {lb:>12} {'difference':>12}")
    for r in result["rows"]:
        print(f"{r['step']:>5} {r['a']:>12.4f} {r['b']:>12.4f} {r['diff']:>+12.4f}")
    print(f"{result['steps']} common steps; largest |difference| {result['max_abs_diff']} at step "
          f"{result['max_abs_diff_step']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
