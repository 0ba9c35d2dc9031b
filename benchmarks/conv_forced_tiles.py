"""Forced register tiles on one conv + bias + ReLU layer: each variant built with its tile forced
into ``contraction._choose_tile`` (the rule's own choice for ``default``), checked against ONNX
Runtime (rtol 1e-4, atol 1e-5), then all timed with ORT in interleaved rounds (thread CPU time,
medians; ``conv_layers.interleaved``), 1 thread.

    python benchmarks/conv_forced_tiles.py CI,HW,CO,K,STRIDE,BATCH "default;NJ,NI,HI;..." [ROUNDS] [JSONL]

``NJ,NI,HI``: channel vectors, pixels of the output row, rows of the output height (HI > 1 blocks
the height). One JSON line per call is appended to JSONL
(default benchmarks/results/session18_intel/conv18/forced_tiles.jsonl). Exploration only: the
rules' figures quoted in docstrings come from it, before a rule fixes the tile.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import conv_layers as CL  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402

from backends.tvm.executable import configure_threads  # noqa: E402
from backends.tvm.schedules import contraction as C  # noqa: E402
from backends.tvm.target import resolve_target  # noqa: E402

_real_choose_tile = C._choose_tile
FORCE: dict = {}


def _forced(stmt, exts, s_idx, r_idx, vec_pos, lanes, *rest):  # noqa: ANN001, ANN002, ANN202
    """The rules' tile, or (for a direct conv) the one in ``FORCE["tile"]``."""
    out = _real_choose_tile(stmt, exts, s_idx, r_idx, vec_pos, lanes, *rest)
    if FORCE.get("tile") and len(r_idx) == 3:
        vec, nj, row_pos, ni, col_pos, hi = out
        fnj, fni, fhi = FORCE["tile"]
        if fhi > 1 and col_pos is None:
            col_pos = C._shared_outer_axis(stmt, C.ivs_of(stmt), s_idx, row_pos, vec_pos, exts)
        out = (vec, fnj, row_pos, fni, col_pos if fhi > 1 else None, fhi)
    return out


def main() -> None:
    layer = [int(v) for v in sys.argv[1].split(",")]  # ci,hw,co,k,s,batch
    variants = sys.argv[2].split(";")  # "nj,ni,hi" or "default"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    ci, hw, co, k, s, batch = layer
    target = resolve_target(None)
    configure_threads(1)
    m = CL.layer_model(ci, hw, co, k, s, batch)
    x = np.random.default_rng(1).standard_normal((batch, ci, hw, hw)).astype(np.float32)
    so = ort.SessionOptions(); so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    tx = tvm.runtime.tensor(x)
    fns = {"ort": lambda: sess.run(None, {"x": x})}
    for v in variants:
        FORCE["tile"] = None if v == "default" else tuple(int(a) for a in v.split(","))
        f = CL.tvm_build(m, target, "direct")
        got = f(tx); got = (got if isinstance(got, tvm.runtime.Tensor) else got[0]).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
        fns[v] = lambda f=f: f(tx)
    FORCE["tile"] = None
    t = CL.interleaved(fns, repeats)
    flops = 2.0 * batch * ((hw + 2 * ((k - 1) // 2) - k) // s + 1) ** 2 * co * ci * k * k
    print(sys.argv[1], open("/proc/loadavg").read().split()[:3],
          "  ".join(f"{n}={t[n]*1e6:.1f}us({flops/t[n]/1e9:.0f}GF,x{t[n]/t['ort']:.2f})" for n in fns), flush=True)
    out = sys.argv[4] if len(sys.argv) > 4 else ROOT / "benchmarks/results/session18_intel/conv18/forced_tiles.jsonl"
    with open(out, "a") as fh:
        fh.write(json.dumps({"layer": layer, "us": {n: t[n]*1e6 for n in fns}, "load": open("/proc/loadavg").read().split()[:3]}) + "\n")

if __name__ == "__main__":
    C._choose_tile = _forced
    main()
