"""The physical limit of one core, measured through TVM: fp32 FMA peak and triad bandwidth.

    python benchmarks/peak.py [--quick] [--loaded]
    python benchmarks/peak.py --markdown [--json FILE]      # render the saved table

Runs :func:`backends.tvm.peak.measure_peak` on one thread (the FMA loop at 8..24 accumulators
and the triad over arrays each 2x the last-level cache), and puts next to it what the CPU model
predicts: FMA units x fp32 lanes per unit x 2 x clock, from ``lscpu`` (the clock is the
maximum MHz when lscpu reports one, else the current MHz of /proc/cpuinfo). Results:
``benchmarks/results/peak.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "peak.json"

# fp32 FLOP per cycle per core for CPU families whose FMA datapath we know (2 x FMA x lanes):
# Zen 4 runs AVX-512 on two 256-bit FMA pipes (32); Zen 5 (its EPYC parts) on two 512-bit FMA
# pipes (64: session 27 measured 271 GFLOP/s, 4.2 GHz implied); Skylake-SP/Ice Lake/Sapphire
# Rapids server parts have two 512-bit FMA units (64); Haswell..Zen 3 two 256-bit FMA units (32).
FLOP_PER_CYCLE = {"znver5": 64, "znver4": 32, "znver3": 32, "znver2": 32, "haswell": 32, "skylake-avx512": 64,
                  "icelake-server": 64, "sapphirerapids": 64}


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def _clock_mhz(info: dict[str, str]) -> float | None:
    for key in ("CPU max MHz", "CPU MHz"):
        if key in info:
            try:
                return float(info[key])
            except ValueError:
                pass
    try:
        m = re.search(r"cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text())
        return float(m.group(1)) if m else None
    except OSError:
        return None


def run(quick: bool) -> dict[str, Any]:
    import tvm

    from backends.tvm.executable import configure_threads
    from backends.tvm.peak import measure_peak
    from backends.tvm.target import detect_host_target, resolve_target

    configure_threads(1)
    tdict = detect_host_target()
    peak = measure_peak(resolve_target(tdict), quick=quick)
    info = _lscpu()
    mhz = _clock_mhz(info)
    fpc = FLOP_PER_CYCLE.get(str(tdict.get("mcpu")))
    flags = set(info.get("Flags", "").split())
    model = {"cpu": info.get("Model name", platform.processor()), "mcpu": tdict.get("mcpu"),
             "isa": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other",
             "clock_mhz": mhz, "flop_per_cycle": fpc,
             "predicted_flops": fpc * mhz * 1e6 if fpc and mhz else None}
    if model["predicted_flops"]:
        model["implied_clock_mhz"] = peak.fma_flops_best / fpc / 1e6
    return {"machine": {"platform": platform.platform(), "cores": __import__("os").cpu_count()},
            "versions": {"tvm": tvm.__version__}, "peak": peak.to_json(), "cpu_model": model}


def markdown(data: dict[str, Any]) -> str:
    p, c = data["peak"], data["cpu_model"]
    pred = f"{c['predicted_flops'] / 1e9:.0f}" if c.get("predicted_flops") else "?"
    return "\n".join([
        "| measured on one core | value |", "|---|---:|",
        f"| fp32 FMA peak (TVM loop, {p['accumulators']} x {p['lanes']}-lane accumulators), median | "
        f"{p['fma_flops'] / 1e9:.1f} GFLOP/s |",
        f"| fp32 FMA peak, fastest call | {p['fma_flops_best'] / 1e9:.1f} GFLOP/s |",
        f"| CPU model: {c['flop_per_cycle'] or '?'} FLOP/cycle x {c['clock_mhz'] or '?'} MHz "
        f"({c['isa']}, {c['mcpu']}) | {pred} GFLOP/s |",
        *([f"| clock implied by the fastest call (boost; lscpu gives the base clock) | "
           f"{c['implied_clock_mhz']:.0f} MHz |"] if c.get("implied_clock_mhz") else []),
        f"| triad bandwidth | {p['bandwidth'] / 1e9:.1f} GB/s |",
    ]) + ("\n\nMeasured on a loaded machine." if data.get("loaded") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter probes")
    ap.add_argument("--loaded", action="store_true", help="mark the figures as measured on a shared machine")
    ap.add_argument("--markdown", action="store_true", help="print the saved table as markdown")
    ap.add_argument("--json", default=str(RESULTS), help=f"results file (default {RESULTS.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    path = Path(args.json)
    if args.markdown:
        if not path.exists():
            print(f"peak: no results at {path}; run benchmarks/peak.py first", file=sys.stderr)
            return 2
        print(markdown(json.loads(path.read_text())))
        return 0
    data = run(args.quick)
    data["loaded"] = bool(args.loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(markdown(data))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
