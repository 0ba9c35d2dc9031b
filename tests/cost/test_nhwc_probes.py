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
