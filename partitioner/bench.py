"""Benchmark an artifact against ONNX Runtime (and a 1-rank build): the library under
``partitioner bench DIR`` and ``benchmarks/``.

Rules:
1. Every measurement runs ``--warmup`` untimed steps, then ``--repeat`` timed ones, and reports the
   median. A partitioned step is timed on rank 0 between barriers (all micro-batches of one batch),
   inside one mpiexec run, so process start-up is not counted.
2. The ONNX Runtime baseline runs the artifact's ``source.onnx`` in one process with the same total
   thread count as the partitioned run (ranks x threads per rank).
3. ``--baseline single`` also compiles the source model for 1 rank with the same backend and target
   (in a temporary directory) and runs it with all the threads (``single``, the same cores), and
   also with one rank's share of threads (``single_<t>thread``, the same per-process resources).
4. Throughput is samples/s: the batch (axis 0 of the first input) over the median step time.
5. The JSON holds the machine (CPU model, cores, memory), versions, settings, medians and ratios;
   with a cost-model prediction in the manifest, the predicted step time stands beside the measured.
6. The partitioned run is profiled (worker ``--profile``): ``breakdown`` gives, per rank, the
   median per-step seconds of compute (kernels), comm (inside comm ops: posting sends, waiting
   for receives/collectives), flush (completing sends), idle (barrier: waiting for the slowest
   rank) and wrapper (the backend's per-call argument/result handling), beside the cost model's
   per-device prediction; and each rank's core affinity and thread variables.
7. ``per_microbatch``: with p pipeline stages and m micro-batches a step is about (m + p - 1)
   slots, so slot = step / (m + p - 1); the runtime overhead per micro-batch is the slot minus the
   slowest rank's kernel compute per micro-batch (launch, copies, comm bookkeeping and waiting).
8. ``memory``: per rank, the predicted peak memory (the manifest's simulated per-rank peak) beside
   the measured one: the rank's RSS high-water mark (``VmHWM``) minus its baseline, the RSS once the
   backend's runtime is imported and just before its program loads (the worker resets the mark there).
   A rank whose build facts give the library's constants (``constant_bytes``, TVM) is priced with
   them (:func:`built_memory_terms`): the plan is made before the build chooses each conv's
   algorithm, and a Winograd conv holds 4x its weights. ``plan_predicted_bytes`` keeps the plan's
   figure beside it.
9. ``prediction.built``: for the same reason, a TVM artifact whose build chose conv algorithms
   by measurement (build facts ``conv_choices``) gets its step re-simulated with each such conv
   at the seconds the build measured for the chosen algorithm (this machine's conv-algorithm
   cache, ``backends/tvm/conv_algorithms.py`` rule 6) instead of the roofline's direct-conv
   price (:func:`built_step`: ``step_s`` and the convs priced so per rank);
   ``predicted_step_s`` then holds it, and ``plan_predicted_step_s`` the plan's figure. None
   otherwise (other backends, ``direct`` builds, convs not in the cache).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from partitioner.core.errors import UsageError
from partitioner.core.machine import machine_info


def _median_ort(path: Path, feeds: Mapping[str, np.ndarray], threads: int, warmup: int, repeat: int) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    feed = {k: v for k, v in feeds.items() if k in wanted}
    times = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _predicted_step(prediction: Mapping[str, Any] | None) -> float | None:
    if not prediction:
        return None
    for key in ("step_latency_s", "step_s", "latency_s", "makespan_s", "time_s"):
        v = prediction.get(key)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return None


def predicted_memory(prediction: Mapping[str, Any] | None) -> dict[int, float]:
    """Per rank, the cost model's peak memory in bytes: the simulation of the lowered programs
    when the manifest has it (the prediction ``plan`` shows), else the analytical estimate."""
    if not prediction:
        return {}
    sim = prediction.get("simulated") or {}
    rows = sim.get("ranks") or prediction.get("per_device") or []
    return {int(d.get("rank", i)): float(d["peak_memory_bytes"]) for i, d in enumerate(rows)
            if d.get("peak_memory_bytes") is not None}


def predicted_memory_terms(prediction: Mapping[str, Any] | None) -> dict[int, dict[str, float]]:
    """Per rank, the terms of the simulated peak (``cost/memory.py``, ``rank_peak``), when the
    manifest has them."""
    sim = (prediction or {}).get("simulated") or {}
    return {int(d.get("rank", i)): d["memory_terms"] for i, d in enumerate(sim.get("ranks") or [])
            if d.get("memory_terms")}


def built_memory_terms(manifest: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """Rule 8: per rank whose build facts give ``constant_bytes`` (the library's constants,
    ``backends/tvm/build.py`` rule 7), the plan's terms re-priced with them by the backend's rule
    (``cost/memory.py``, :func:`~partitioner.cost.memory.with_library_constants`); other ranks, and
    every rank with ``PRICE_LIBRARY_CONSTANTS`` off, are absent (the plan's figure stands)."""
    from partitioner.cost.memory import runtime_memory, with_library_constants

    terms = predicted_memory_terms(manifest.get("prediction"))
    rule = runtime_memory(manifest.get("backend"))
    out = {}
    for i, r in enumerate(manifest.get("ranks") or []):
        built = (r.get("build") or {}).get("constant_bytes")
        rank = int(r.get("rank", i))
        priced = with_library_constants(terms[rank], rule, built) if built is not None and rank in terms else None
        if priced is not None:
            out[rank] = {**priced.to_json(), "library_constant_bytes": float(built)}
    return out


def built_step(art: Any, batch: int) -> dict[str, Any] | None:
    """Rule 9: the step re-simulated with the convs each TVM rank's build measured; None when
    no conv was priced so."""
    m = art.manifest
    choices = [(r.get("build") or {}).get("conv_choices") or [] for r in m.get("ranks") or []]
    if m.get("backend") != "tvm" or not any(choices) or not m.get("cluster"):
        return None
    import tvm

    from backends.tvm.conv_algorithms import machine_cache_file, measured_conv_seconds
    from backends.tvm.target import target_dict
    from partitioner.cluster import Cluster
    from partitioner.partition import simulate_programs

    cache = machine_cache_file(tvm.target.Target(target_dict(m.get("target"))))
    programs = art.programs
    seconds = [measured_conv_seconds(p, c, cache) for p, c in zip(programs, choices)]
    if not any(seconds):
        return None
    sim = simulate_programs(programs, Cluster.from_json(m["cluster"]), int(m["microbatches"]), batch,
                            node_seconds=seconds)
    return {"step_s": float(sim.step_latency), "measured_convs_per_rank": [len(s) for s in seconds]}


def memory_rows(timings: Mapping[str, Any], prediction: Mapping[str, Any] | None,
                manifest: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rule 8: per rank, predicted peak bytes beside the measured one (VmHWM minus the process
    baseline the worker took just before loading its program, ``runtime/worker.py``), with the
    predicted terms; priced with the library's constants where ``manifest`` gives them."""
    plan = predicted_memory(prediction)
    built = built_memory_terms(manifest) if manifest else {}
    terms = {**predicted_memory_terms(prediction), **built}
    rows = []
    for rep in timings.get("ranks") or []:
        mem = rep.get("memory") or {}
        measured = mem.get("peak_over_baseline_bytes")
        rank = int(rep["rank"])
        pred = built[rank]["peak_bytes"] if rank in built else plan.get(rank)
        rows.append({"rank": rep["rank"], "predicted_bytes": pred, "measured_bytes": measured,
                     "plan_predicted_bytes": plan.get(rank),
                     "library_constant_bytes": built[rank]["library_constant_bytes"] if rank in built else None,
                     "baseline_rss_bytes": mem.get("baseline_rss_bytes"), "peak_rss_bytes": mem.get("peak_rss_bytes"),
                     "peak_reset": mem.get("peak_reset"),
                     "predicted_over_measured": pred / measured if pred and measured else None,
                     "predicted_terms": terms.get(int(rep["rank"]))})
    return rows


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def breakdown(timings: Mapping[str, Any], prediction: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Per rank: median per-step seconds of each part (rule 6), the predicted parts beside them."""
    predicted = {int(d.get("rank", i)): d for i, d in enumerate((prediction or {}).get("per_device") or [])}
    rows = []
    for rep in timings.get("ranks") or []:
        prof = rep.get("profile") or []
        row: dict[str, Any] = {"rank": rep["rank"], "affinity": rep.get("affinity"), "threads": rep.get("threads"),
                               "env": rep.get("env"), "imported_before_pin": rep.get("imported_before_pin")}
        for key in ("step_s", "compute_s", "comm_s", "flush_s", "idle_s", "wrapper_s"):
            vals = [p[key] for p in prof if p.get(key) is not None]
            row[key] = _median(vals) if vals else None
        pred = predicted.get(int(rep["rank"]))
        row["predicted"] = ({k: pred.get(k) for k in ("compute_s", "comm_s", "idle_s")} if pred else None)
        rows.append(row)
    return rows


def per_microbatch(step_s: float, microbatches: int, stages: int, ranks: list[dict[str, Any]],
                   best_step_s: float | None = None) -> dict[str, Any]:
    """Rule 7: the slot per micro-batch and the runtime overhead inside it (from the median step,
    and from the fastest step: the one least disturbed by other load on shared cores)."""
    slots = microbatches + max(1, stages) - 1
    slot = step_s / slots
    compute = max((r["compute_s"] or 0.0 for r in ranks), default=0.0) / microbatches
    doc = {"microbatches": microbatches, "stages": stages, "slot_s": slot, "compute_s": compute,
           "overhead_s": max(0.0, slot - compute)}
    if best_step_s is not None:
        doc["best_slot_s"] = best_step_s / slots
        doc["best_overhead_s"] = max(0.0, best_step_s / slots - compute)
    return doc


def bench_artifact(directory: str | os.PathLike[str], *, baseline: str = "onnxruntime", repeat: int = 10,
                   warmup: int = 2, inputs: str | None = None, ranks_per_host: int | None = None,
                   single_dir: str | os.PathLike[str] | None = None, single_threads: int | None = None,
                   ort: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document (see the module rules)."""
    from partitioner.compiler import compile as compile_artifact
    from partitioner.compiler import load_artifact
    from partitioner.core.bindings import seeded_inputs
    from partitioner.runtime.launch import load_inputs, run_artifact
    from partitioner.runtime.worker import read_npz
    if repeat < 1 or warmup < 0:
        raise UsageError("--repeat must be at least 1 and --warmup at least 0")
    art = load_artifact(directory)
    feeds = load_inputs(art, read_npz(inputs) if inputs else seeded_inputs(art.bindings))
    batch = int(art.bindings.inputs[0].shape[0]) if art.bindings.inputs and art.bindings.inputs[0].shape else 1

    res = run_artifact(art, feeds, warmup=warmup, repeat=repeat, ranks_per_host=ranks_per_host,
                       extra_worker_args=["--profile"])
    timings = res.timings or {}
    part_s = float(timings.get("median_s", res.wall_s))
    threads = int(timings.get("threads_per_rank", 1)) * art.world_size
    rows: dict[str, dict[str, Any]] = {
        "partitioned": {"ranks": art.world_size, "threads": threads, "median_s": part_s,
                        "throughput_per_s": batch / part_s, "times_s": timings.get("times_s"),
                        "per_rank_peak_rss_bytes": [r.get("peak_rss_bytes") for r in timings.get("ranks") or []]},
    }
    from partitioner.artifact import source_model_path

    if not art.manifest["source_model"].get("file"):  # a large model kept by reference: one process
        ort = False  # would hold every weight (docs/large_models.md), so no in-process ORT baseline
    if ort:
        ort_s = _median_ort(source_model_path(art.root, art.manifest), feeds, threads, warmup, repeat)
        rows["onnxruntime"] = {"ranks": 1, "threads": threads, "median_s": ort_s, "throughput_per_s": batch / ort_s}
    if baseline == "single":
        with tempfile.TemporaryDirectory(prefix="partitioner-bench-") as tmp:
            if single_dir is not None:
                single = load_artifact(single_dir)
            else:
                single = compile_artifact(str(source_model_path(art.root, art.manifest)), "cpu:1",
                                          strategy="single", backend=art.backend, target=art.manifest.get("target"),
                                          out_dir=Path(tmp) / "single", progress=False)
            env_threads = ["--ranks-per-host", str(max(1, threads // single_threads))] if single_threads else []
            r1 = run_artifact(single, feeds, warmup=warmup, repeat=repeat, extra_worker_args=env_threads)
            s1 = float((r1.timings or {}).get("median_s", r1.wall_s))
            rows["single"] = {"ranks": 1, "threads": int((r1.timings or {}).get("threads_per_rank", 1)),
                              "backend": single.backend, "median_s": s1, "throughput_per_s": batch / s1,
                              "times_s": (r1.timings or {}).get("times_s")}
            if rows["single"]["threads"] > 1 and not single_threads:  # also 1 rank at 1 rank's threads
                per_rank = max(1, threads // art.world_size)
                r2 = run_artifact(single, feeds, warmup=warmup, repeat=repeat,
                                  extra_worker_args=["--ranks-per-host", str(max(1, rows["single"]["threads"] // per_rank))])
                s2 = float((r2.timings or {}).get("median_s", r2.wall_s))
                rows[f"single_{per_rank}thread"] = {"ranks": 1, "threads": int((r2.timings or {}).get("threads_per_rank", 1)),
                                                    "backend": single.backend, "median_s": s2,
                                                    "throughput_per_s": batch / s2, "times_s": (r2.timings or {}).get("times_s")}
    ratios = {f"{name}_over_partitioned": row["median_s"] / part_s for name, row in rows.items() if name != "partitioned"}
    m = art.manifest
    ranks = breakdown(timings, m.get("prediction"))
    memory = memory_rows(timings, m.get("prediction"), m)
    stages = int(m["plan_summary"].get("num_stages") or m["plan_summary"].get("stages") or 1) \
        if not isinstance(m["plan_summary"].get("stages"), list) else len(m["plan_summary"]["stages"])
    return {
        "artifact": str(directory),
        "machine": machine_info(),
        "versions": m["toolchain"],
        "settings": {"world_size": m["world_size"], "microbatches": m["microbatches"], "backend": m["backend"],
                     "target": m.get("target"), "strategy": m["plan_summary"].get("strategy"), "batch": batch,
                     "repeat": repeat, "warmup": warmup, "baseline": baseline, "ranks_per_host": ranks_per_host,
                     "inputs": {b.name: {"shape": list(b.shape), "dtype": b.dtype} for b in art.bindings.inputs}},
        "results": rows,
        "ratios": ratios,
        "breakdown": ranks,
        "per_microbatch": per_microbatch(part_s, int(m["microbatches"]), stages, ranks,
                                         min(timings["times_s"]) if timings.get("times_s") else None),
        "memory": memory,
        "prediction": _prediction(art, batch, part_s, memory),
    }


def _prediction(art: Any, batch: int, part_s: float, memory: list[dict[str, Any]]) -> dict[str, Any]:
    """Rules 5, 8 and 9: the predicted step (re-priced with the build's conv times where it
    measured them) and memory beside the measured ones."""
    plan = _predicted_step(art.manifest.get("prediction"))
    built = built_step(art, batch) if plan else None
    predicted = built["step_s"] if built else plan
    return {"predicted_step_s": predicted, "measured_step_s": part_s,
            "predicted_over_measured": predicted / part_s if predicted else None,
            "plan_predicted_step_s": plan, "built": built,
            **_memory_summary(memory), "manifest": art.manifest.get("prediction")}


def _memory_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fullest rank's predicted and measured peak (the figure a memory limit is about)."""
    pred = [r["predicted_bytes"] for r in rows if r["predicted_bytes"] is not None]
    meas = [r["measured_bytes"] for r in rows if r["measured_bytes"] is not None]
    p, q = (max(pred) if pred else None), (max(meas) if meas else None)
    return {"predicted_peak_memory_bytes": p, "measured_peak_memory_bytes": q,
            "memory_predicted_over_measured": p / q if p and q else None}


def format_table(doc: Mapping[str, Any]) -> str:
    lines = [f"{'run':<12} {'ranks':>5} {'threads':>7} {'median ms':>10} {'samples/s':>10} {'vs partitioned':>15}"]
    part = doc["results"]["partitioned"]["median_s"]
    for name, row in doc["results"].items():
        lines.append(f"{name:<12} {row['ranks']:>5} {row['threads']:>7} {row['median_s'] * 1e3:>10.2f} "
                     f"{row['throughput_per_s']:>10.1f} {row['median_s'] / part:>14.2f}x")
    for r in doc.get("breakdown") or []:
        if r.get("compute_s") is not None:
            lines.append(f"rank {r['rank']}: compute {r['compute_s'] * 1e3:.2f} ms, comm {r['comm_s'] * 1e3:.2f} ms, "
                         f"flush {r['flush_s'] * 1e3:.2f} ms, idle {r['idle_s'] * 1e3:.2f} ms per step "
                         f"(cores {r['affinity']}, TVM_NUM_THREADS={(r.get('env') or {}).get('TVM_NUM_THREADS')})")
    mb = doc.get("per_microbatch")
    if mb:
        lines.append(f"per micro-batch: slot {mb['slot_s'] * 1e6:.1f} us, compute {mb['compute_s'] * 1e6:.1f} us, "
                     f"runtime overhead {mb['overhead_s'] * 1e6:.1f} us"
                     + (f" (fastest step: {mb['best_overhead_s'] * 1e6:.1f} us)" if "best_overhead_s" in mb else ""))
    p = doc["prediction"]
    if p["predicted_step_s"]:
        built = p.get("built")
        how = (f" with {'/'.join(str(n) for n in built['measured_convs_per_rank'])} convs per rank at their build's "
               f"measured time (plan: {p['plan_predicted_step_s'] * 1e3:.2f} ms)") if built else ""
        lines.append(f"step time: predicted {p['predicted_step_s'] * 1e3:.2f} ms{how}, measured "
                     f"{p['measured_step_s'] * 1e3:.2f} ms (predicted/measured {p['predicted_over_measured']:.2f})")
    for r in doc.get("memory") or []:
        pred = "-" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / 2**20:.1f} MiB"
        meas = "-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / 2**20:.1f} MiB"
        ratio = f" (predicted/measured {r['predicted_over_measured']:.2f})" if r["predicted_over_measured"] else ""
        plan = r.get("plan_predicted_bytes")
        if plan and r.get("library_constant_bytes") is not None and plan != r["predicted_bytes"]:
            pred += f" with the library's {r['library_constant_bytes'] / 2**20:.1f} MiB of constants (plan: {plan / 2**20:.1f} MiB)"
        lines.append(f"rank {r['rank']} peak memory: predicted {pred}, measured {meas} above the process "
                     f"baseline{ratio}{_terms_text(r.get('predicted_terms'))}")
    return "\n".join(lines)


def _terms_text(terms: Mapping[str, float] | None) -> str:
    """The predicted peak's terms in MiB, the non-zero ones (``cost/memory.py``)."""
    if not terms:
        return ""
    names = (("runtime_bytes", "runtime"), ("weight_bytes", "weights"), ("activation_bytes", "activations"),
             ("input_bytes", "inputs"), ("output_bytes", "outputs"), ("send_bytes", "sends"),
             ("receive_bytes", "receives"))
    parts = [f"{label} {terms[k] / 2**20:.1f}" for k, label in names if terms.get(k)]
    return f"; predicted: {', '.join(parts)} MiB, load peak {terms.get('load_peak_bytes', 0) / 2**20:.1f} MiB"
