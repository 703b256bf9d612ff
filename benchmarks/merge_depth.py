"""The merge's time against the model's depth: a MoE layer must cost the same at any depth.

Command (from the repository root):

    .venv/bin/python benchmarks/merge_depth.py
    # options: [--depths 1,2,4,8] [--experts 384] [--hidden 128] [--moe-intermediate 128] [--workers N]
    #          [--workdir DIR] [--json PATH]

What it does, per depth (MoE layers): builds a tiny Kimi-K2.5 checkpoint (``make_fixture``, kind kimi-k2.5: Kimi's
INT4 experts, its 384 routed experts a MoE layer by default, tiny widths so the per-weight work dominates, not the
arithmetic) and a converted adapter of random LoRA on the attention and every expert (the GPU host's
``random_converted_adapter``), then times ``merge_adapter(..., method="RAWINT4")`` in its own child process
(``fsync`` off). The adapter grows with the depth, as the whole model's does: 2,304 expert LoRA matrices a MoE layer.

It prints each depth's seconds a MoE layer and their ratio to the shallowest depth's, measured in the same run
(target: within 1.2x at every depth; a cost that grows with the adapter shows as a ratio that grows with the depth).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import RESULT_PREFIX, host_info  # noqa: E402

TARGET = 1.2

_CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gpu_host"]
from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture
from ktflow.stages.merge import merge_adapter
from merged_serving import random_converted_adapter

work, moe_layers, experts, hidden, inter = Path(sys.argv[2]), *map(int, sys.argv[3:7])
workers = int(sys.argv[7]) or None
spec = FixtureSpec(kind="kimi-k2.5", layers=moe_layers + 1, experts=experts, hidden=hidden, moe_intermediate=inter)
base = make_fixture(spec, work / "base")
adapter = random_converted_adapter(base, work / "adapter")
started = time.perf_counter()
result = merge_adapter(base, adapter, work / "merged", method="RAWINT4", workers=workers, fsync=False)
seconds = time.perf_counter() - started
print(PREFIX + json.dumps({"moe_layers": moe_layers, "seconds": seconds, "tensors_merged": result.tensors_merged,
                           "adapter_bytes": (adapter / "adapter_model.safetensors").stat().st_size}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="1,2,4,8", help="MoE layers, comma-separated (default 1,2,4,8)")
    parser.add_argument("--experts", type=int, default=384, help="routed experts a MoE layer (Kimi-K2.5: 384)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--moe-intermediate", type=int, default=128)
    parser.add_argument("--workers", type=int, default=0, help="merge workers (default: the stage's, a core each)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".ktflow" / "bench")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    depths = sorted({int(d) for d in args.depths.split(",")})
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    for depth in depths:
        work = Path(tempfile.mkdtemp(prefix=f"merge-depth-{depth}-", dir=args.workdir))
        try:
            child = _CHILD.replace("PREFIX", repr(RESULT_PREFIX))
            argv = [sys.executable, "-c", child, str(REPO), str(work), str(depth), str(args.experts), str(args.hidden),
                    str(args.moe_intermediate), str(args.workers)]
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_PREFIX)), None)
            if done.returncode or line is None:
                print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
                return 1
            runs.append(json.loads(line.removeprefix(RESULT_PREFIX)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    reference = runs[0]["seconds"] / runs[0]["moe_layers"]
    for run in runs:
        run["seconds_a_moe_layer"] = run["seconds"] / run["moe_layers"]
        run["over_shallowest"] = run["seconds_a_moe_layer"] / reference
    host = host_info(("torch", "safetensors"))
    print(f"host: {host['cpu']} ({host['physical_cores']} cores); {args.experts} experts a MoE layer, "
          f"hidden {args.hidden}, moe_intermediate {args.moe_intermediate}")
    print("| MoE layers | weights merged | adapter MB | merge s | s a MoE layer | a MoE layer / the shallowest's |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run['moe_layers']} | {run['tensors_merged']} | {run['adapter_bytes'] / 1e6:.1f} | "
              f"{run['seconds']:.1f} | {run['seconds_a_moe_layer']:.2f} | {run['over_shallowest']:.2f} |")
    worst = max(run["over_shallowest"] for run in runs)
    print(f"worst ratio {worst:.2f} (target <= {TARGET}): {'ok' if worst <= TARGET else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"host": host, "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs, "target": TARGET, "worst": worst}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
