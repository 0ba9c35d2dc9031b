"""The differential oracle: one fuzzed graph + plan, partitioned, run, and compared with an
unpartitioned ONNX Runtime run of the same model on the same seeded inputs.

Outcomes (:class:`Outcome.status`):
- ``ok``: every output matches within the tolerance below;
- ``not_applicable``: the strategy raised :class:`StrategyNotApplicable` (a one-line reason);
- ``mismatch``: some output differs (shape, NaN placement, or beyond the tolerance);
- ``crash``: any other exception anywhere (load, passes, partition, lowering, verify, build, run).

Tolerance (float32, summation order differs between a split and a whole reduction):
``|got - want| <= atol + rtol * |want|`` elementwise with ``rtol = 1e-4`` and
``atol = 1e-5 * max(1, max|want|) * max(1, sqrt(L / 16))`` where ``L`` is the longest reduction in
the graph (MatMul/Gemm K, Conv C/g*kh*kw, pooling window, Softmax/LayerNorm axis length). For the
small graphs fuzzed here (L <= 2048) atol stays at or below ~1.1e-4 x the output scale.
"""

from __future__ import annotations

import math
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx

from partitioner.core.errors import StrategyNotApplicable

from .graph_strategy import FuzzGraph, FuzzPlan

RTOL = 1e-4
ATOL = 1e-5


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | not_applicable | mismatch | crash
    strategy: str
    devices: int
    microbatches: int | None
    chosen: str = ""  # the strategy auto picked (or the one asked for)
    detail: str = ""
    world_size: int = 0  # ranks of the plan that ran (1: not split, e.g. auto chose single); 0: none ran


def seeded_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def ort_outputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, dict(feeds))))


def tolerance(want: np.ndarray, reduction: int) -> tuple[float, float]:
    scale = max(1.0, float(np.nanmax(np.abs(want)))) if want.size else 1.0
    return RTOL, ATOL * scale * max(1.0, math.sqrt(max(1, reduction) / 16))


def compare(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], reduction: int) -> str:
    """'' when every output matches, else a one-line description of the first difference."""
    for name, w in want.items():
        if name not in got:
            return f"output {name!r} missing"
        g = np.asarray(got[name])
        if g.shape != w.shape:
            return f"output {name!r}: shape {list(g.shape)} != {list(w.shape)}"
        rtol, atol = tolerance(w, reduction)
        if not np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
            err = np.abs(g.astype(np.float64) - w.astype(np.float64))
            return (f"output {name!r}: max |diff| {float(np.nanmax(err)):.3g} > atol {atol:.3g} + rtol {rtol:g}*|want| "
                    f"(max |want| {float(np.nanmax(np.abs(w))):.3g})")
    return ""


def partition_graph(fg: FuzzGraph, fp: FuzzPlan) -> Any:
    """Load (validation), default passes, then partition: the path ``partitioner compile`` takes."""
    from partitioner.cluster import Cluster
    from partitioner.load import load
    from partitioner.partition import partition
    from passes import run_pipeline

    model = run_pipeline(load(fg.model))
    return partition(model, Cluster.resolve(f"cpu:{fp.devices}"), strategy=fp.strategy,
                     microbatches=fp.microbatches, degree=fp.devices)


def _one_line(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{where}: {msg}"[:400]


def check_reference(fg: FuzzGraph, fp: FuzzPlan) -> Outcome:
    """Partition and run with the reference backend (ONNX Runtime per segment, LocalWorld comms)."""
    from partitioner.lowering.lower import check_programs, verify_programs
    from partitioner.runtime.in_process import run_reference

    base = (fp.strategy, fp.devices, fp.microbatches)
    try:
        res = partition_graph(fg, fp)
    except StrategyNotApplicable as exc:
        return Outcome("not_applicable", *base, detail=str(exc))
    except Exception as exc:  # noqa: BLE001 - anything else is a bug the fuzzer reports
        return Outcome("crash", *base, detail="partition: " + _one_line(exc))
    chosen = res.plan.strategy
    feeds = seeded_feeds(fg.model)
    want = ort_outputs(fg.model, feeds)
    try:
        check_programs(res.programs)
        verify_programs(res.programs, res.bindings)
        got = run_reference(res.programs, res.bindings, feeds, timeout_s=30)
    except Exception as exc:  # noqa: BLE001
        return Outcome("crash", *base, chosen=chosen, detail="run_reference: " + _one_line(exc))
    diff = compare(got, want, fg.reduction)
    return Outcome("mismatch" if diff else "ok", *base, chosen=chosen, detail=diff, world_size=res.plan.world_size)


def run_tvm_ranks(programs: Any, bindings: Any, feeds: Mapping[str, np.ndarray], build_dir: Path) -> dict[str, np.ndarray]:
    """Build every rank with TVM into ``build_dir`` and run the ranks as threads (LocalWorld)."""
    from backends.tvm import build_all, load
    from partitioner.core.bindings import gather_outputs, scatter_inputs
    from partitioner.runtime.comm_local import LocalWorld
    from partitioner.runtime.schedule import run_step

    build_all(list(programs), build_dir, jobs=1, progress=False)
    exes = [load(p, build_dir / f"rank{i}.so") for i, p in enumerate(programs)]
    per_rank = scatter_inputs(bindings, feeds)
    world = LocalWorld(bindings.world_size, timeout_s=60)
    results: list[Any] = [None] * len(programs)
    errors: list[str] = []

    def one(r: int) -> None:
        try:
            results[r] = run_step(exes[r], per_rank[r], world.communicator(r))
        except BaseException as exc:  # noqa: BLE001 - wake the other ranks, report below
            errors.append(f"rank {r}: {_one_line(exc)}")
            world.abort(f"rank {r} failed")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    if errors or any(t.is_alive() for t in threads):
        direct = [e for e in errors if "abort" not in e]
        raise RuntimeError((direct or errors or ["ranks did not finish in 90 s"])[0])
    return gather_outputs(bindings, results)


def check_tvm(fg: FuzzGraph, fp: FuzzPlan) -> Outcome:
    """Partition, build every rank with TVM, run, and compare with unpartitioned ONNX Runtime."""
    base = (fp.strategy, fp.devices, fp.microbatches)
    try:
        res = partition_graph(fg, fp)
    except StrategyNotApplicable as exc:
        return Outcome("not_applicable", *base, detail=str(exc))
    except Exception as exc:  # noqa: BLE001
        return Outcome("crash", *base, detail="partition: " + _one_line(exc))
    feeds = seeded_feeds(fg.model)
    want = ort_outputs(fg.model, feeds)
    try:
        with tempfile.TemporaryDirectory(prefix="fuzz-tvm-") as tmp:
            got = run_tvm_ranks(res.programs, res.bindings, feeds, Path(tmp))
    except Exception as exc:  # noqa: BLE001
        return Outcome("crash", *base, chosen=res.plan.strategy, detail="tvm: " + _one_line(exc))
    diff = compare(got, want, fg.reduction)
    return Outcome("mismatch" if diff else "ok", *base, chosen=res.plan.strategy, detail=diff,
                   world_size=res.plan.world_size)
