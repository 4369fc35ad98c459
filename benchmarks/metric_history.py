"""A finished run's metric histories as JSON, for results the docs quote (docs/results/).

Run (from the repository root):

  .venv/bin/python benchmarks/metric_history.py --tracking-uri sqlite:///W/mlflow.db \
      --run-name demo-pico8-synthetic-mpp --key train/loss --key val/top1 --out FILE

Writes {"run_name", "run_id", "status", "histories": {key: [[step, value], ...]}}, each history in
step order, from the newest run of that name in any experiment of the store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tracking-uri", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--key", action="append", required=True, help="a metric key (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vitp.tracking.store import get_client

    client = get_client(args.tracking_uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, f"attributes.run_name = '{args.run_name}'", order_by=["attributes.start_time DESC"])
    if not runs:
        sys.exit(f"no run named {args.run_name!r} in {args.tracking_uri}")
    run = runs[0]
    histories = {k: sorted([m.step, m.value] for m in client.get_metric_history(run.info.run_id, k)) for k in args.key}
    with open(args.out, "w") as f:
        json.dump({"run_name": args.run_name, "run_id": run.info.run_id, "status": run.info.status,
                   "histories": histories}, f, indent=1)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} steps" for k, v in histories.items()))


if __name__ == "__main__":
    main()
