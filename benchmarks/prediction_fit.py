"""Re-predict every row of the runtime table with the current cost model and compare it with the
step times those rows measured (``benchmarks/results/runtime_*.json``), without running anything
but the planner: the check that a cost-model change moves every row towards its measurement
(issue 13: within 25%), not one row at the others' expense.

Per row it plans the row's model, strategy and micro-batches on ``cpu:2`` with this machine's
calibration (the per-machine cache, as ``bench_runtime.py`` does) and prints the simulated step
and the search estimate beside the prediction stored in the JSON ("before") and the measured step
(the median over the row's interleaved rounds, and its min–max). ``--comm-op-us`` overrides the
calibrated per-comm-op overhead (a cache written before probe 3c has none), ``--call-us`` the
per-call one. Writes ``benchmarks/results/prediction_fit.json`` with ``--write``.

    .venv/bin/python benchmarks/prediction_fit.py [--comm-op-us X] [--call-us X] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cluster(comm_op_us: float | None, call_us: float | None) -> Any:
    from partitioner.cluster import Cluster, cpu_cluster

    c = cpu_cluster(2, "tvm")
    changes: dict[str, float] = {}
    if comm_op_us is not None:
        changes["comm_op_overhead_s"] = comm_op_us * 1e-6
    if call_us is not None:
        changes["call_overhead_s"] = call_us * 1e-6
    if not changes:
        return c
    return Cluster(c.name, tuple(dataclasses.replace(d, **changes) for d in c.devices), c.nodes, c.levels, c.notes)


def _model(case: dict[str, Any]) -> Any:
    from models_zoo import build

    kw = {k: v for k, v in case.items() if k in ("batch", "layers", "hidden", "in_features", "out_features")}
    return build(case["model"], **kw)


def fit_row(path: Path, cluster: Any) -> dict[str, Any] | None:
    """One row: the stored prediction, the new one (simulated and estimated) and the measurement."""
    from partitioner.compiler import prepare
    from partitioner.partition import partition

    doc = json.loads(path.read_text())
    case, st = doc.get("case") or {}, doc["settings"]
    if "model" not in case:
        return None
    rounds = (doc.get("rounds") or {}).get("median_s", {}).get("partitioned")
    measured = rounds or {"median": doc["results"]["partitioned"]["median_s"],
                          "min": doc["results"]["partitioned"]["median_s"],
                          "max": doc["results"]["partitioned"]["median_s"]}
    mb = int(st.get("microbatches") or 1)
    res = partition(prepare(_model(case))[0], cluster, strategy=st["strategy"], microbatches=mb if mb > 1 else None)
    sim = res.prediction["simulated"]["step_latency_s"]
    est = res.prediction["search_estimate"]["latency_s"]
    before = doc["prediction"]["predicted_step_s"]
    return {"row": path.stem, "strategy": st["strategy"], "microbatches": mb, "measured_median_s": measured["median"],
            "measured_min_s": measured["min"], "measured_max_s": measured["max"], "before_s": before,
            "simulated_s": sim, "estimate_s": est, "before_error": before / measured["median"] - 1,
            "after_error": sim / measured["median"] - 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comm-op-us", type=float, default=None)
    ap.add_argument("--call-us", type=float, default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    cluster = _cluster(args.comm_op_us, args.call_us)
    d = cluster.devices[0]
    print(f"cluster: {cluster.notes}; call {d.call_overhead_s * 1e6:.1f} us, comm op "
          f"{d.comm_op_overhead_s * 1e6:.1f} us, launch {d.launch_overhead_s * 1e6:.2f} us")
    rows = [r for p in sorted(Path(args.results).glob("runtime_*.json")) if (r := fit_row(p, cluster))]
    print(f"{'row':<26}{'measured ms (min-max)':>26}{'before':>9}{'err':>7}{'simulated':>11}{'err':>7}{'estimate':>10}")
    for r in rows:
        ms = lambda x: f"{x * 1e3:.3f}"  # noqa: E731
        print(f"{r['row']:<26}{ms(r['measured_median_s']) + ' (' + ms(r['measured_min_s']) + '-' + ms(r['measured_max_s']) + ')':>26}"
              f"{ms(r['before_s']):>9}{r['before_error'] * 100:>+6.0f}%{ms(r['simulated_s']):>11}"
              f"{r['after_error'] * 100:>+6.0f}%{ms(r['estimate_s']):>10}")
    if args.write:
        out = Path(args.results) / "prediction_fit.json"
        out.write_text(json.dumps({"device": d.to_json(), "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
