#!/usr/bin/env python3
"""Print an adapter directory's files and each safetensors tensor's name, dtype and shape
(runs of per-expert keys are folded), plus kt_adapter_manifest.json without its digests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from safetensors import safe_open


def main(path: str) -> int:
    root = Path(path)
    for f in sorted(root.iterdir()):
        print(f"{f.name}\t{f.stat().st_size}")
    for f in sorted(root.glob("*.safetensors")):
        print(f"\n# {f.name}")
        folded: dict[str, list] = {}
        with safe_open(f, framework="pt") as st:
            print("metadata:", st.metadata())
            for k in st.keys():
                s = st.get_slice(k)
                key = re.sub(r"\.experts\.\d+\.", ".experts.{E}.", k)
                entry = folded.setdefault(key, [s.get_dtype(), list(s.get_shape()), 0])
                entry[2] += 1
        for k, (dtype, shape, n) in sorted(folded.items()):
            print(f"{k}\t{dtype}\t{shape}" + (f"\tx{n}" if n > 1 else ""))
    manifest = root / "kt_adapter_manifest.json"
    if manifest.exists():
        doc = json.loads(manifest.read_text())
        for rec in doc.get("artifacts", {}).values():
            if isinstance(rec, dict) and "tensors" in rec:
                rec["tensors"] = f"<{len(rec['tensors'])} entries>"
        print("\n# kt_adapter_manifest.json\n" + json.dumps(doc, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
