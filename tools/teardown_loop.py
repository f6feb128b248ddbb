#!/usr/bin/env python
"""Run the README's first example N times under torchrun (2 gloo ranks) and count the runs that
did not end with status 0 (torch 2.13's gloo teardown can abort a rank with SIGABRT after
``destroy_process_group``; the example ends with ``oktopk_triton.shutdown(exit_code=0)``).

    python -m tools.teardown_loop [--runs 50] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_example() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- first-example[^>]*-->\s*```python\n(.*?)```", text, re.S)
    if not m:
        raise SystemExit("README.md has no marked first example")
    return m.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    codes = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "first_example.py")
        with open(path, "w") as f:
            f.write(first_example())
        for i in range(args.runs):
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node", "2", path], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=300)
            codes.append(p.returncode)
            aborted = "SIGABRT" in p.stderr or "terminate called" in p.stderr
            print(f"run {i + 1}/{args.runs}: status {p.returncode}"
                  f"{' (abort)' if aborted else ''}", flush=True)
    failed = sum(c != 0 for c in codes)
    print(f"{failed} of {len(codes)} runs ended with a non-zero status")
    if args.json:
        from oktopk_triton.bench import records
        records.write(args.json, {**records.header("teardown-loop", args),
                                  "what": "README first example under torchrun, 2 gloo ranks",
                                  "cpus": os.cpu_count(), "runs": len(codes), "nonzero": failed,
                                  "codes": codes})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
