"""The pipeline stage cut by measured time: each forward node's forward+backward seconds, profiled.

The stage DP (:func:`partitioner.training.pipeline.stage_cut`) balances the stages' work. With
the cost model's prices (forward FLOPs x 3) the cut is as good as those prices: the zoo resnet's
FLOPs-balanced cut left its last stage 2.1-2.4x the first on ONNX Runtime (layer3-4 at
micro-batch 2 run on 4x4 and 2x2 maps far below the GEMM rate), and the mlp's 5:6 GEMM stages
are what FLOPs predict. This module measures the work instead.

Rules:

1. What is measured: the 1-rank training step at the micro-batch size, gradients only (forward,
   loss, backward; no update: the update runs once per step, outside the micro-batch loop), on
   ONNX Runtime with 1 intra-op thread and its default graph optimisations (as a training rank
   runs), node profiler on, one warm-up run and :data:`RUNS` timed runs. Data inputs are seeded
   normal floats, integer inputs zeros (valid indices and labels for any model).
2. Attribution: every step node carries the forward node it belongs to
   (``training.forward_node``, autodiff rule); a profiled kernel is charged to the forward node
   of the step node it is named after (ORT names a fused kernel ``<first node>/<fusion>``). The
   loss's nodes are charged to the last forward node (the loss is always in the last stage);
   the optimizer has none (gradients only); kernels that name no step node (ORT's inserted
   casts, reorders) are spread over the nodes in proportion to their measured time.
3. Which backend: the profile is ONNX Runtime's, for ONNX Runtime and TVM plans alike. TVM
   compiles each stage program as a whole (fused kernels named by their ops, not by ONNX
   nodes), so its kernels cannot be charged to forward nodes; ONNX Runtime's relative node
   costs are still far closer to TVM's than FLOPs are where FLOPs mislead (measured, zoo resnet
   at batch 16, 64x64, micro-batch 2, each TVM stage alone, CPU per step, load 7-8: the
   cost-model cut 330 : 920 ms, this cut 483 : 697 ms; the slower stage 24% faster). The plan
   says ``"cut": "measured (onnxruntime per-node profile)"`` on both.
4. The DP is then the cost-model DP with these seconds in place of the FLOPs, and each cut's
   bytes priced at the same relative weight as there (a byte as a thousand FLOPs' time, at the
   measured step's mean seconds per FLOP), so only the node prices change.
5. Fallback: when the step cannot be profiled (no node names to charge to, ORT refusing it) the
   cost-model cut is used and the plan says so.
6. One profile per (model, micro-batch, loss, ONNX Runtime version, rule 7's ``M``) on a machine: the seconds
   are kept in this machine's cache (``<cache>/measured_cut/<key>.npy``, beside the calibration),
   so the planner (``train --plan``, the bench's prediction) and every rank use the same cut. On
   MPI ranks, rank 0 reads or measures them and sends them to the others
   (:func:`shared_node_seconds`): ranks that measured apart could cut differently. A profile costs
   about a few training steps at the micro-batch size. A profile taken while other work loaded
   the machine stays until its file is deleted (``$PARTITIONER_CACHE_DIR``, the calibration's).
7. Deferred weight gradients (pipeline rule 10, :mod:`partitioner.training.deferred_wgrad`):
   when the plan's last stage defers (``micro_batches`` > 1, no ``--memory-limit``), its
   weight gradients run once per step at the whole batch, not once per micro-batch, and cost
   differently there (the zoo resnet's last stage, layer4 at 2x2: its weight-gradient-only
   kernels 19 ms per step at 16 images against 50 ms as 8 calls at 2). Two rows of prices are then measured in the same interleaved ORT runs (a load
   change moves them alike; profiled apart at different loads, they had cut the resnet into a
   575 / 4 ms split): rule 1's, for the stages that do not defer, and the deferring stage's: the
   step as that stage runs it, one stage holding every node (its per-micro-batch program at the
   micro-batch, plus its weight-gradient program at the whole batch divided by ``M``), so a
   node's price is its share of that stage's work per micro-batch; a third row holds that
   weight-gradient share alone. The rows are one cache entry; without a deferrable weight the
   second row is the first and the third zero. When the last stage defers (deferred_wgrad rule
   6), the cut takes the second row for it (:func:`partitioner.training.pipeline.deferred_cut`);
   otherwise the first row is rule 1's prices. ONNX Runtime plans only: a
   TVM plan's last stage defers too, but its cut keeps rule 1's prices (ORT's whole-batch
   weight-gradient GEMMs priced the zoo mlp's last-stage nodes up to 2.3x its per-micro-batch
   ones, and the cut they gave left the TVM stages at 242 / 98 ms against 163 / 193 without),
   so TVM plans do not defer the whole batch's weight gradients (only the tail's, deferred_wgrad
   rule 7, with rule 1's cut).
8. TVM plans (``stages`` given, no ``--memory-limit``): rule 3's ORT prices, rescaled per stage by
   the TVM stages' own times. The plan is built with rule 1's cut, each stage's
   :class:`~partitioner.training.pipeline_runner.PipelineRunner` is built on TVM over a
   communicator that returns at once (no waiting on a peer), and :data:`TVM_ROUNDS` interleaved
   steps after a warm-up give each stage's median thread CPU per step ``T_s``; every node of stage
   ``s`` is priced ``t_node x (T_s / M) / sum(t over stage s)``, and the DP cuts again on those prices.
   What it is for: TVM's relative costs differ from ORT's by region of the network, and outside
   kernels (the zoo resnet at micro-batch 2: ORT's cut left TVM's stem-to-layer3.0 stage at
   295.6 ms against 191.4 ms for layer3-4, quiet, each stage alone; the stage that runs the large
   maps also does the input-buffer copies of its large stashed activations). Measured, paired
   (``benchmarks/pipeline_stages.py --model resnet --backend tvm --rounds 5 --baseline
   partitioner.training.measured_cut.TVM_STAGE_SCALED=False``, load 3.9 -> 8.3): the cut moved from
   after layer3.1.conv2 to after layer3.1.conv1, stages 277.7 / 220.7 -> 256.5 / 232.7 ms per step
   against a 326.7 ms 1-rank step (the 1F1B bound 1.05x -> 1.13x); a second paired run (same
   command, same cached prices, load 4.9 -> 6.1): 258.4 / 183.6 -> 263.4 / 207.3 ms against 327.6
   (bound 1.13x -> 1.11x), and the MPI step was within noise (docs/training.md, session 12).
   Session 15 (on by default since; env ``PARTITIONER_TRAIN_TVM_STAGE_SCALED=0`` off): with
   session 14's code the ORT cut (after layer3.1.conv2) left TVM's stage 0 1.64x stage 1
   (221.4 / 134.9 ms, thread CPU, load 6-9): ORT prices layer4's 4x4 and 2x2 convs (micro-batch
   2) at about 1.6x TVM's relative to the larger maps, so the ORT-balanced cut puts too much of
   the network on stage 0. Rule 8 then cut after layer3.0.conv2 or layer3.0.downsample (two
   timings), within the half block where the stages alone are most even (docs/training.md,
   "Session 15 (TVM resnet cut)": each cut's stages alone and the MPI step, paired). Conv nets
   only (:data:`TVM_SCALED_OPS`: the zoo mlp and bert, GEMM-only, keep rule 1's cut, whose TVM
   stages ORT's GEMM prices rank as TVM does), and only when the rescaled cut's slower stage is
   :data:`TVM_MIN_GAIN` below rule 1's cut's by the rescaled prices (rule 1's cut's stages at
   their measured times): a noise-sized imbalance keeps rule 1's cut, so a rerun at another
   load does not flip it. The other MPI ranks wait up to :data:`TVM_CUT_WAIT_S` for rank 0's
   prices (the first plan on a machine builds and times the stages first). One rescaling, not a
   fixed point: the moved nodes keep their old stage's ratio (about 40 s of TVM builds for the
   zoo resnet on this machine, once per machine: the scaled row is kept in rule 6's cache under
   its own key, and rank 0 measures it for every rank). Only for steps of at least
   :data:`TVM_MIN_STEP_S` by rule 1's prices (their sum x ``M``): below that the builds cost more
   than any cut could save (the tests' small models). Any failure: rule 1's prices.
9. Rule 8's cached row is keyed also by the TVM backend's sources (:func:`tvm_sources_hash`): a
   row timed on other kernels is not reused.
10. Neighbour cuts, timed (2-stage TVM plans that rule 8 timed; :data:`TVM_NEIGHBOUR_CUTS`): rule
   8 rescales once, so the cut its prices give is one estimate, not a measurement. Three plans
   are then built and their stages timed alone in :data:`TVM_ROUNDS` interleaved rounds (as rule
   8, thread CPU per step, each plan's cut forced by ``pipeline.CUT_AFTER``): rule 8's cut, the
   cut one conv earlier (the last ``Conv`` of stage 0 and what follows it move to stage 1) and one
   conv later (the first ``Conv`` of stage 1 moves to stage 0). A neighbour whose slower stage is
   :data:`TVM_NEIGHBOUR_GAIN` below rule 8's cut's replaces it; its prices are rule 8's with each
   stage scaled to the two stages' mean sum (:func:`forced_prices`), so that the DP cuts there
   (a candidate the DP would not cut at, for its cut bytes, is not timed). What it is for: the
   zoo resnet at micro-batch 2 (session 26, ``benchmarks/pipeline_stages.py --cuts``, quiet):
   rule 8 cut after layer2.1.conv2, stages 433.9 / 365.3 ms per step (1F1B bound 1.56x against
   the 840.8 ms 1-rank step); one conv earlier, after layer2.1.conv1.relu, 384.3 / 406.2 (bound
   1.67x); two convs earlier 347.9 / 445.2 (1.52x). Session 27 (Zen 5, quiet; README "Session
   27"): rule 8 cut after layer3.0.conv1, its stages 272.4 / 238.4 ms; one conv earlier (after
   layer2.1.relu) 244.8 / 236.5, taken; one conv later 285.1 / 202.6. The 2-rank MPI step, 3
   rounds paired against rule 10 off (``train_step.py --paired-env
   PARTITIONER_TRAIN_TVM_NEIGHBOUR_CUTS=0``): medians 281.2 against 289.9 ms, 2 pairs of 3 won.
   Cost: three TVM plans built and timed (about 2 minutes for the zoo resnet on Zen 5), once per
   machine: the row is cached under rule 8's key (rule 10 off: its own key), and rank 0 times it
   for every rank; the timings are kept beside it (``<key>.json``) and printed on stderr. Conv
   nets and 2 stages only (more stages: the neighbours of every cut multiply the builds).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from partitioner.core.errors import UsageError

#: rules 1-6 on (module constant; off: every pipeline cut is the cost model's)
MEASURED_CUT = True
RUNS = 3
PROFILED_FOR = ("onnxruntime", "tvm")  # rule 3: the backends whose plans take the ORT profile
COST_MODEL = "cost model"
MEASURED = "measured (onnxruntime per-node profile)"
CUT_TAG = 25000
PROFILE_VERSION = 2  # part of the cache key: bump when the measurement or its aggregation changes
#: rule 8 on (module constant; off: TVM plans cut on rule 3's ORT prices as they are). On since
#: session 15 (rule 8's docstring: the zoo resnet's stages alone and its 2-rank MPI step, paired);
#: the environment's ``PARTITIONER_TRAIN_TVM_STAGE_SCALED=0`` turns it off, in MPI ranks too
TVM_STAGE_SCALED = os.environ.get("PARTITIONER_TRAIN_TVM_STAGE_SCALED", "1") == "1"
TVM_ROUNDS = 5
TVM_MIN_STEP_S = 0.05  # rule 8: the smallest step (ORT seconds) worth timing the TVM stages for
#: rule 8: the op types a forward graph must hold for its TVM stages to be timed (conv nets, whose
#: ORT and TVM conv prices differ by map size; GEMM-only models such as the zoo mlp and bert keep
#: rule 1's cut)
TVM_SCALED_OPS = ("Conv",)
#: rule 8: the least share of the slower stage the rescaled cut must save by its own prices;
#: a smaller predicted gain keeps rule 1's cut (a noise-sized imbalance does not move it)
TVM_MIN_GAIN = 0.05
TVM_VERSION = 3  # rule 8's part of its cache key: bump when its measurement or choice changes (3: rule 10)
#: rule 10 on (module constant; the environment's ``PARTITIONER_TRAIN_TVM_NEIGHBOUR_CUTS=0`` turns it off)
TVM_NEIGHBOUR_CUTS = os.environ.get("PARTITIONER_TRAIN_TVM_NEIGHBOUR_CUTS", "1") == "1"
#: rule 10: the least share of rule 8's cut's slower stage a neighbour must save, measured
TVM_NEIGHBOUR_GAIN = 0.03
#: rule 8 on MPI ranks: how long the other ranks wait for rank 0's prices (it builds and times the
#: TVM stages first: about 40 s for the zoo resnet on a quiet machine, 245 s at load 6-9)
TVM_CUT_WAIT_S = 1800.0


def _key(proto: onnx.ModelProto, loss: str, deferred: int = 0) -> str:
    import onnxruntime as ort

    h = hashlib.sha1(proto.SerializeToString())
    h.update(f"{loss}|{ort.__version__}|{RUNS}|{PROFILE_VERSION}{f'|deferred {deferred}' if deferred else ''}".encode())
    return h.hexdigest()


def _cache_file(key: str) -> Path:
    from partitioner.calibrate_cache import cache_dir

    return cache_dir() / "measured_cut" / f"{key}.npy"


def node_seconds(fwd: ir.Model, loss: str, backend: str, whole: ir.Model | None = None,
                 micro_batches: int = 1, stages: int = 0) -> np.ndarray | None:
    """Rules 1-2 and 6: measured forward+backward seconds per node of ``fwd`` (the forward model
    at the micro-batch size, as the stage DP sees it), or None (rules 3 and 5). ``whole``: the
    forward model at the whole batch when the plan's last stage defers its weight gradients
    (rule 7): then two rows, rule 1's prices and the deferring stage's, measured together.
    ``stages`` (a TVM plan's stage count, 0: none): rule 8's prices, rescaled by the TVM stages."""
    t = _ort_node_seconds(fwd, loss, backend, whole, micro_batches)
    if t is None or t.ndim != 1 or backend != "tvm" or stages < 2 or not TVM_STAGE_SCALED:
        return t
    if float(t.sum()) * micro_batches < TVM_MIN_STEP_S or not any(n.op_type in TVM_SCALED_OPS for n in fwd.graph):
        return t
    proto = ir.serde.serialize_model(fwd)
    off = "" if TVM_NEIGHBOUR_CUTS else "n0"  # rule 10 off: rule 8's row, under its own key
    key = _key(proto, loss) + f"-tvm{stages}x{micro_batches}v{TVM_VERSION}{off}-{tvm_sources_hash()}"
    report = _cache_file(key).with_suffix(".json")  # rule 10's timings
    scaled = _cached(key, (len(t),), lambda: tvm_scaled(fwd, t, loss, stages, micro_batches, report))
    return t if scaled is None else scaled


def tvm_sources_hash() -> str:
    """Rule 9: the part of rule 8's cache key that names the TVM kernels the stages were timed
    with, a hash of the TVM backend's Python sources (``backends/tvm``: lowering, fusion,
    schedules). A kernel change re-times the stages on the next TVM pipeline plan, instead of
    keeping a cut made on the old kernels (session 26: the zoo resnet's row had been timed
    before session 25's stem-copy change; re-timed under this key it chose the same cut, after
    layer2.1.conv2)."""
    import backends.tvm

    root = Path(backends.tvm.__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _cached(key: str, shape: tuple[int, ...], measure: Any) -> np.ndarray | None:
    """Rule 6: the cached array under ``key`` if it has ``shape``, else ``measure()`` (kept in the
    cache when not None)."""
    path = _cache_file(key)
    try:
        t = np.load(path)
        if t.shape == shape:
            return t
    except (OSError, ValueError):
        pass
    t = measure()
    if t is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{id(t)}.tmp.npy")
            np.save(tmp, t)
            tmp.replace(path)
        except OSError:
            pass
    return t


def _ort_node_seconds(fwd: ir.Model, loss: str, backend: str, whole: ir.Model | None,
                      micro_batches: int) -> np.ndarray | None:
    """Rules 1-7 (ONNX Runtime's profile, cached)."""
    from partitioner.training import deferred_wgrad

    if not MEASURED_CUT or backend not in PROFILED_FOR:
        return None
    names = [n.name for n in fwd.graph]
    if not all(names) or len(set(names)) != len(names):
        return None
    proto = ir.serde.serialize_model(fwd)
    deferred = micro_batches if whole is not None and micro_batches > 1 and deferred_wgrad.DEFER_WEIGHT_GRADIENTS else 0

    def measure() -> np.ndarray | None:
        try:
            return _profile_deferred(proto, whole, names, loss, deferred) if deferred else _profile(proto, names, loss)
        except Exception:  # noqa: BLE001 - rule 5: any failure to profile falls back to the cost model
            return None

    return _cached(_key(proto, loss, deferred), (3, len(names)) if deferred else (len(names),), measure)


def tvm_scaled(fwd: ir.Model, t: np.ndarray, loss: str, stages: int, micro_batches: int,
               report: Path | None = None) -> np.ndarray | None:
    """Rule 8: ``t`` (rule 1's prices) with each stage's nodes scaled by its TVM stage's measured
    CPU per step over its summed prices, the stages those of rule 1's cut; None on any failure.
    Then rule 10 (its timings written to ``report``, JSON, when given)."""
    from partitioner.training.pipeline import stage_ends

    try:
        ends = stage_ends(fwd.graph, stages, seconds=t)
        times = tvm_stage_times(fwd, loss, stages, micro_batches)
    except Exception:  # noqa: BLE001 - rule 8: any failure keeps rule 1's prices
        return None
    scaled = rescaled(t, ends, [x / micro_batches for x in times])  # per micro-batch, as ``t``
    if scaled is None:
        return None
    prices = worth_moving(fwd.graph, t, scaled, ends, stages)
    if not TVM_NEIGHBOUR_CUTS or stages != 2:
        return prices
    try:
        return neighbour_checked(fwd, loss, micro_batches, prices, report)
    except Exception:  # noqa: BLE001 - rule 10: a failed timing keeps rule 8's prices
        return prices


def neighbour_checked(fwd: ir.Model, loss: str, micro_batches: int, prices: np.ndarray,
                      report: Path | None = None) -> np.ndarray:
    """Rule 10: ``prices`` (rule 8's), or the prices of the neighbour cut whose stages, timed with
    rule 8's cut's in interleaved rounds, have a slower stage :data:`TVM_NEIGHBOUR_GAIN` below.
    The timings go to stderr (one line) and, as JSON, to ``report`` when given."""
    import sys

    from partitioner.training.pipeline import stage_ends

    nodes = list(fwd.graph)
    first = stage_ends(fwd.graph, 2, seconds=prices)[0]
    rows = {first: prices}
    for e in neighbour_ends(nodes, first):
        row = forced_prices(prices, e)
        if row is not None and stage_ends(fwd.graph, 2, seconds=row)[0] == e:
            rows[e] = row
    if len(rows) == 1:
        return prices
    cuts = list(rows)
    names = [nodes[e].name for e in cuts]
    sys.stderr.write(f"pipeline cut: timing the TVM stages of {len(cuts)} cuts (once per machine, model)\n")
    times = tvm_cut_times(fwd, loss, micro_batches, names)
    slowest = [max(ts) for ts in times]
    best = min(range(len(cuts)), key=slowest.__getitem__)
    best = best if slowest[best] <= (1.0 - TVM_NEIGHBOUR_GAIN) * slowest[0] else 0
    timed = ", ".join(f"after {n} {' / '.join(f'{x * 1e3:.1f}' for x in ts)} ms"
                      for n, ts in zip(names, times))
    sys.stderr.write(f"pipeline cut: {timed} (stage CPU per step): cut after {names[best]}\n")
    if report is not None:
        try:
            doc = {"rule": "measured_cut rule 10", "cuts": names, "stage_seconds": times,
                   "chosen": names[best]}
            report.write_text(json.dumps(doc, indent=1))
        except OSError:
            pass
    return rows[cuts[best]] if best else prices


def neighbour_ends(nodes: list[ir.Node], end: int) -> list[int]:
    """Rule 10's candidates around a 2-stage cut after node ``end``: the cut just before the last
    ``Conv`` of stage 0, and the cut just after the first ``Conv`` of stage 1 (each kept when both
    stages still hold a node)."""
    convs = [i for i, n in enumerate(nodes) if n.op_type in TVM_SCALED_OPS]
    before = [i - 1 for i in convs if i <= end and i >= 1]
    after = [i for i in convs if end < i < len(nodes) - 1]
    return before[-1:] + after[:1]


def forced_prices(prices: np.ndarray, end: int) -> np.ndarray | None:
    """Rule 10: ``prices`` with stage 0 (nodes ``0..end``) and stage 1 each scaled to their mean
    sum, so that a 2-stage DP on them cuts after ``end`` (every other cut moves a priced node onto
    one stage); None when a stage has no price."""
    out = np.asarray(prices, dtype=np.float64).copy()
    a, b = float(out[:end + 1].sum()), float(out[end + 1:].sum())
    if a <= 0 or b <= 0:
        return None
    out[:end + 1] *= (a + b) / (2 * a)
    out[end + 1:] *= (a + b) / (2 * b)
    return out


def worth_moving(graph: ir.Graph, t: np.ndarray, scaled: np.ndarray, ends: list[int], stages: int) -> np.ndarray:
    """Rule 8's choice: ``scaled`` when the cut it gives has a slower stage at least
    :data:`TVM_MIN_GAIN` below rule 1's cut's (``ends``), both priced by ``scaled`` (rule 1's cut's
    stages at their measured times); else ``t``, rule 1's prices and cut."""
    from partitioner.training.pipeline import stage_ends

    def slowest(e: list[int]) -> float:
        starts = [0] + [x + 1 for x in e[:-1]]
        return max(float(scaled[a:b + 1].sum()) for a, b in zip(starts, e))

    moved = stage_ends(graph, stages, seconds=scaled)
    return scaled if slowest(moved) <= (1.0 - TVM_MIN_GAIN) * slowest(ends) else np.asarray(t, dtype=np.float64)


def rescaled(t: np.ndarray, ends: list[int], times: list[float]) -> np.ndarray | None:
    """Rule 8's prices: stage s (nodes ``ends[s-1]+1 .. ends[s]``) scaled by ``times[s]`` over its
    summed prices (None when a stage has no price or no time: nothing to scale by)."""
    out = np.asarray(t, dtype=np.float64).copy()
    start = 0
    for end, sec in zip(ends, times):
        part = float(out[start:end + 1].sum())
        if part <= 0 or not sec > 0:
            return None
        out[start:end + 1] *= sec / part
        start = end + 1
    return out


def tvm_stage_times(fwd: ir.Model, loss: str, stages: int, micro_batches: int) -> list[float]:
    """Rule 8's measurement: each stage of the plan built with rule 1's cut, run on TVM alone
    (:class:`~partitioner.training.overheads._Instant`), median thread CPU seconds per step."""
    return _timed_plans(fwd, loss, stages, micro_batches, [None])[0]


def tvm_cut_times(fwd: ir.Model, loss: str, micro_batches: int, cuts: list[str]) -> list[list[float]]:
    """Rule 10's measurement: per cut (the name of the node stage 0 ends with), the 2-stage plan's
    stage times as rule 8 takes them, the plans' stages interleaved in each round."""
    return _timed_plans(fwd, loss, 2, micro_batches, [(c,) for c in cuts])


def _timed_plans(fwd: ir.Model, loss: str, stages: int, micro_batches: int,
                 cuts: list[tuple[str, ...] | None]) -> list[list[float]]:
    """Rules 8 and 10: one TVM plan per forced cut (None: rule 1's), every stage run alone
    (:class:`~partitioner.training.overheads._Instant`) in :data:`TVM_ROUNDS` interleaved rounds
    after a warm-up; per plan, each stage's median thread CPU seconds per step."""
    import statistics
    import time

    from partitioner.training.bench import _with_settings
    from partitioner.training.optimizers import SGD
    from partitioner.training.overheads import _Instant
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner

    feeds = _feeds(_gradients_step(ir.serde.serialize_model(fwd), loss))
    micro = len(feeds["labels"])

    def plan() -> Any:
        return build_pipeline(fwd, loss, SGD(lr=0.0), batch=micro * micro_batches, stages=stages,
                              micro_batches=micro_batches, backend="tvm")

    rule1 = {f"{__name__}.TVM_STAGE_SCALED": False}
    plans = [_with_settings({**rule1, "partitioner.training.pipeline.CUT_AFTER": cut}, plan) for cut in cuts]
    labels = np.concatenate([feeds.pop(plans[0].labels)] * micro_batches)
    data = {k: np.concatenate([v] * micro_batches) for k, v in feeds.items()}
    with tempfile.TemporaryDirectory() as tmp:
        runners = [[PipelineRunner(p, s, comm=_Instant(s), backend="tvm", workdir=str(Path(tmp) / f"plan{i}"))
                    for s in range(stages)] for i, p in enumerate(plans)]
        times: list[list[list[float]]] = [[[] for _ in rs] for rs in runners]
        for i in range(TVM_ROUNDS + 1):
            for rs, plan_times in zip(runners, times):
                for r, ts in zip(rs, plan_times):
                    c = time.thread_time()
                    r.step(data, labels)
                    if i:  # the first round warms up
                        ts.append(time.thread_time() - c)
    return [[statistics.median(ts) for ts in plan_times] for plan_times in times]


def shared_node_seconds(fwd: ir.Model, loss: str, backend: str, comm: Any, ranks: list[int],
                        whole: ir.Model | None = None, micro_batches: int = 1, stages: int = 0) -> np.ndarray | None:
    """Rule 6 on MPI ranks: ``ranks[0]`` reads or measures the seconds and sends them to the others
    (all -1: the cost-model cut), so that every rank cuts the same way (rule 8's too)."""
    if comm is None or not MEASURED_CUT or backend not in PROFILED_FOR:
        return node_seconds(fwd, loss, backend, whole, micro_batches, stages)
    n = len(list(fwd.graph))
    shape = (3, n) if whole is not None and micro_batches > 1 else (n,)
    if comm.rank == ranks[0]:
        t = node_seconds(fwd, loss, backend, whole, micro_batches, stages)
        msg = np.full(shape, -1.0) if t is None or t.shape != shape else np.asarray(t, dtype=np.float64)
        for r in ranks[1:]:
            comm.send(msg, r, CUT_TAG)
        if hasattr(comm, "flush"):
            comm.flush()
        return t if t is None or t.shape == shape else None
    msg = _patient_recv(comm, ranks[0], shape, TVM_CUT_WAIT_S if backend == "tvm" and stages >= 2 else 0.0)
    return None if (msg < 0).any() else msg


def _patient_recv(comm: Any, peer: int, shape: tuple[int, ...], wait_s: float) -> np.ndarray:
    """Rule 8 on MPI ranks: the cut's prices from ``peer``, waiting at least ``wait_s`` (the
    communicator's own deadline when longer): the first plan on a machine times the TVM stages
    before it sends (minutes), longer than a step's message deadline."""
    old = getattr(comm, "timeout_s", None)
    if old is not None and wait_s > old:
        comm.timeout_s = wait_s
    try:
        return comm.recv(peer, CUT_TAG, shape, np.float64)
    finally:
        if old is not None:
            comm.timeout_s = old


def _profile_deferred(model: onnx.ModelProto, whole: ir.Model, names: list[str], loss: str,
                      micro_batches: int) -> np.ndarray | None:
    """Rule 7: rule 1's prices and, measured in the same interleaved runs, the per-micro-batch
    program's seconds plus the whole-batch weight-gradient program's divided by
    ``micro_batches`` (rule 1's twice when nothing is deferrable)."""
    from partitioner.training.optimizers import SGD
    from partitioner.training.pipeline import Defer, _stage
    from partitioner.training.step import default_trainable

    whole_proto = ir.serde.serialize_model(whole)
    trainable = list(default_trainable(whole.graph))
    last = len(model.graph.node) - 1
    args = ({}, 1, trainable, loss, SGD(lr=0.0), "labels", False)
    big = _stage(whole_proto, 0, 0, last, *args, Defer(None, micro_batches)).fused
    stage = _stage(model, 0, 0, last, *args, Defer(big, micro_batches))
    programs = [_gradients_step(model, loss)] + ([stage.fused, stage.weight_grad] if stage.weight_grad else [])
    t = _run_profiles(programs, names)
    if any(x is None for x in t):
        return None
    if len(t) < 3:
        return np.stack([t[0], t[0], np.zeros_like(t[0])])
    return np.stack([t[0], t[1] + t[2] / micro_batches, t[2] / micro_batches])


def _gradients_step(model: onnx.ModelProto, loss: str) -> onnx.ModelProto:
    from partitioner.training.step import build_training_graph

    return ir.serde.serialize_model(build_training_graph(model, loss=loss, gradients_only=True))


def _profile(model: onnx.ModelProto, names: list[str], loss: str) -> np.ndarray | None:
    return _run_profiles([_gradients_step(model, loss)], names)[0]


def _run_profiles(steps: list[onnx.ModelProto], names: list[str]) -> list[np.ndarray | None]:
    """Rules 1-2 on each program: ORT's node profile, each kernel charged to its forward node;
    the programs run in interleaved rounds (a load change moves them alike)."""
    import onnxruntime as ort

    owners = [{n.name: next((p.value for p in n.metadata_props if p.key == "training.forward_node"), n.name)
               for n in step.graph.node} for step in steps]
    feeds = [_feeds(step) for step in steps]
    if any(f is None for f in feeds):
        return [None] * len(steps)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        sessions = []
        for i, step in enumerate(steps):
            so.profile_file_prefix = str(Path(tmp) / f"cut{i}")
            sessions.append(ort.InferenceSession(step.SerializeToString(), so, providers=["CPUExecutionProvider"]))
        for _ in range(RUNS + 1):
            for sess, f in zip(sessions, feeds):
                sess.run(None, f)
        events = [json.loads(Path(sess.end_profiling()).read_text()) for sess in sessions]
    return [charged(e, o, names) for e, o in zip(events, owners)]


def charged(events: list[dict[str, Any]], owner: dict[str, str], names: list[str]) -> np.ndarray | None:
    """Rule 2 over ORT profile events: the median over runs of the seconds charged to each forward
    node (the first run, a warm-up, dropped; a median, so a run another process preempted does
    not move the cut)."""
    index = {n: i for i, n in enumerate(names)}
    runs: list[np.ndarray] = []
    spread: list[float] = []
    seen: set[str] = set()
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        kernel = e["name"][:-len("_kernel_time")]
        if kernel in seen or not runs:  # a kernel seen again: the next run starts
            runs.append(np.zeros(len(names)))
            spread.append(0.0)
            seen = set()
        seen.add(kernel)
        fwd = owner.get(kernel.split("/")[0])
        i = index.get(fwd) if fwd != "loss" else len(names) - 1
        if i is None:
            spread[-1] += e["dur"] * 1e-6
        else:
            runs[-1][i] += e["dur"] * 1e-6
    if len(runs) < 2:
        return None
    t, rest = np.median(runs[1:], axis=0), float(np.median(spread[1:]))
    if t.sum() <= 0:
        return None
    return t * (1.0 + rest / t.sum())


def _feeds(step: onnx.ModelProto) -> dict[str, np.ndarray] | None:
    """Seeded feeds for the step (``models_zoo.sample_inputs``: labels and ids in range); None
    when an input's shape is symbolic (no profile: the cost-model cut is used)."""
    from models_zoo.sample_inputs import sample_inputs

    try:
        return sample_inputs(step, 0)
    except UsageError:
        return None
