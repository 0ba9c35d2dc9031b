"""The depthwise probe timed on TVM in NHWC (``calibrate.nhwc_model``, ``NHWC_PROBES``): the
wrapped model computes the same values, its roof is the NCHW model's, and on TVM the timed build
has one layout kernel fewer than the NCHW build (the conv's output transforms fused away)."""

from __future__ import annotations

import numpy as np
import pytest


def _probe():
    from partitioner.calibrate import micro_kernels

    (k,) = [k for k in micro_kernels(True) if k.op_class == "depthwise_conv"]
    return k


def test_nhwc_model_computes_the_same_values_on_onnxruntime() -> None:
    """Transposed feeds in, transposed outputs out: equal to the NCHW model's (ONNX Runtime runs
    both as written, Transposes included)."""
    import onnxruntime as ort

    from partitioner.calibrate import _feeds, _nhwc_feeds, kernel_model, nhwc_model

    k = _probe()
    assert k.nhwc
    m = kernel_model(k)
    w = nhwc_model(m)
    assert [v.name for v in w.graph.input] == ["x.nhwc"]
    assert [d.dim_value for d in w.graph.input[0].type.tensor_type.shape.dim] == [1, 28, 28, 128]
    feeds = _feeds(k)
    (a,) = ort.InferenceSession(m.SerializeToString()).run(None, feeds)
    (b,) = ort.InferenceSession(w.SerializeToString()).run(None, _nhwc_feeds(feeds, w))
    assert b.shape == (1, 28, 28, 128)
    np.testing.assert_array_equal(a.transpose(0, 2, 3, 1), b)


def _kernels(model) -> list[str]:
    """The PrimFuncs (kernels) of TVM's module of ``model``."""
    import tvm

    from backends.tvm.build import DEFAULT_PIPELINE, _cpu_module
    from backends.tvm.lower import lower_program
    from backends.tvm.schedules.threads import building_for
    from backends.tvm.target import target_dict

    with building_for(1):
        mod, _ = _cpu_module(lower_program(model).mod, tvm.target.Target(target_dict(None)), DEFAULT_PIPELINE,
                             {"threads": 1})
    return [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


def test_tvm_builds_the_wrapped_depthwise_conv_with_one_transform_fewer() -> None:
    """NCHW: the conv and a layout transform on each side (3 kernels). Wrapped: the output's
    transforms fused into the conv, the input's two transposes one identity copy (2 kernels)."""
    from partitioner.calibrate import kernel_model, nhwc_model

    m = kernel_model(_probe())
    nchw, nhwc = _kernels(m), _kernels(nhwc_model(m))
    assert len(nchw) == 3 and sum("transpose" in n and "conv" not in n for n in nchw) == 2, nchw
    assert len(nhwc) == 2 and sum("transpose" in n and "conv" not in n for n in nhwc) == 1, nhwc


@pytest.mark.parametrize("on", [True, False])
def test_time_kernels_builds_the_nhwc_form_and_prices_the_nchw_roof(monkeypatch, tmp_path, on) -> None:
    """``_time_kernels`` on TVM builds :func:`nhwc_model` of the probe (``NHWC_PROBES`` on) and
    feeds it NHWC arrays; the roof is :func:`kernel_roof` of the NCHW model either way."""
    import partitioner.calibrate as cal
    from partitioner.cluster import Device

    monkeypatch.setattr(cal, "NHWC_PROBES", on)
    built: list[list[str]] = []
    fed: list[tuple[int, ...]] = []

    def runner(backend, model, work, threads=1):
        built.append([v.name for v in model.graph.input])
        return lambda feeds: fed.append(next(iter(feeds.values())).shape)

    monkeypatch.setattr(cal, "_runner", runner)
    monkeypatch.setattr(cal, "probe_rounds", lambda: 1)
    k = _probe()
    dev = Device("probe", "cpu", {"float32": 1e11}, 1e9, 2e10)
    (row,) = cal._time_kernels([k], "tvm", tmp_path, True, dev)
    assert built == [["x.nhwc"] if on else ["x"]]
    assert set(fed) == {(1, 28, 28, 128) if on else (1, 128, 28, 28)}
    assert row["roof_s"] == pytest.approx(cal.kernel_roof(cal.kernel_model(k), dev)[0])


def test_thread_probe_times_the_same_form_in_interleaved_rounds(monkeypatch, tmp_path) -> None:
    """Probe 6 (``measure_threads``) builds each kernel as probe 4 does (the depthwise probe in
    NHWC on TVM, at the asked thread count) and interleaves its rounds: no kernel's second round
    before every kernel's first, and each kernel's figure is the best of its rounds."""
    import partitioner.calibrate as cal

    kernels = cal.micro_kernels(True)
    built: list[tuple[str, int]] = []
    order: list[str] = []
    calls: dict[str, int] = {}

    def runner(backend, model, work, threads=1):
        name = model.graph.name
        built.append((next(iter(v.name for v in model.graph.input)), threads))

        def run(feeds):
            order.append(name)
        return run

    def best_time(fn, runs):
        fn()
        n = calls[order[-1]] = calls.get(order[-1], 0) + 1
        return 1.0 / n  # each round of a kernel faster than its last: the best is the last round's

    monkeypatch.setattr(cal, "_runner", runner)
    monkeypatch.setattr(cal, "_best_time", best_time)
    out = cal.measure_threads("tvm", True, 2)
    assert len(built) == len(kernels) and {t for _, t in built} == {2}
    depthwise = [i for i, k in enumerate(kernels) if k.nhwc]
    assert depthwise and all(built[i][0] == "x.nhwc" for i in depthwise)
    assert all(built[i][0] != "x.nhwc" for i in range(len(kernels)) if i not in depthwise)
    names = [cal.kernel_model(k).graph.name for k in kernels]
    first_round = order[:len(kernels)]
    assert sorted(first_round) == sorted(names)  # every kernel once before any kernel twice
    assert set(out) == {k.name for k in kernels}
    assert set(out.values()) == {1.0 / 3}  # quick: 3 rounds, the best (last) one kept


def test_calibration_keeps_probe_6_per_kernel_times(monkeypatch) -> None:
    """``calibrate`` keeps each kernel's 1-thread and N-thread best times beside the class figures
    (``thread_kernels`` in ``calibrate --json``): the class efficiency is their geometric mean, so
    the evidence for a surprising class value is in the document. Probes stubbed: 1 thread 2 ms,
    2 threads 1 ms for the convs, 2 ms for the rest."""
    import partitioner.calibrate as cal

    kernels = cal.micro_kernels(True)

    def probe(quick, timeout, backend="tvm", threads=0):
        if threads == 0:
            return {"gemm_flops": 1e11, "gemm_n": 512, "memory_bandwidth": 2e10, "launch_overhead_s": 1e-6}
        return {k.name: (0.001 if threads == 2 and k.op_class == "conv" else 0.002) for k in kernels}

    monkeypatch.setattr(cal, "_run_probe", probe)
    monkeypatch.setattr(cal, "probe_threads", lambda: 2)
    monkeypatch.setattr(cal, "co_run_bandwidth", lambda threads, quick, moved=None: (0.8,))
    c = cal.calibrate(quick=True, backend="tvm", mpi=False, thread_probe=True)
    rows = {r["kernel"]: r for r in c.to_json()["thread_kernels"]}
    assert set(rows) == {k.name for k in kernels}
    conv = [r for r in rows.values() if r["class"] == "conv"]
    assert conv and all(r["one_s"] == 0.002 and r["many_s"] == 0.001 for r in conv)
    assert c.thread_efficiency_by_class["conv"] == pytest.approx(1.0)
    assert c.thread_efficiency_by_class["gemm"] == pytest.approx(0.0)
