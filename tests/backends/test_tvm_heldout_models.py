"""The held-out architectures (benchmarks/heldout_models.py) compile with the default schedules
and match ONNX Runtime.

Each generator is built at its small :data:`TINY` size (the same ops and code paths as the
benchmark size: patch conv + attention + erf GELU; depthwise 3x3/5x5 + BN + ReLU6; asymmetric
1x7/7x1 convs + AveragePool DAG; ConvTranspose + bilinear Resize), batch 2, seeded random
weights and inputs, through the ``scheduled`` pipeline (:func:`backends.tvm.build.build`,
the benchmark's path), and compared with ONNX Runtime at rtol 1e-4, atol 1e-5. The two
conv DAGs are marked slow (compile time); the depthwise kernel has its own fast test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import models_zoo
from backends.tvm.build import build
from backends.tvm.executable import load
from partitioner.runtime.comm_local import LocalWorld
from tests.bench_scripts import load as load_script

RTOL, ATOL = 1e-4, 1e-5


def _heldout():
    return load_script("heldout_models")


H = _heldout()


# the two 100-conv DAGs take ~25 s each to compile on a loaded 2-core machine
SLOW = {"heldout_mbv2", "heldout_inception"}


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in H.HELDOUT])
def test_heldout_model_matches_ort(key: str, tmp_path: Path) -> None:
    m = H.build(key, 2, **H.TINY[key])
    feeds = models_zoo.sample_inputs(m, 0)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    build(m, tmp_path / "m.so", options={"pipeline": "scheduled"})
    got = load(m, tmp_path / "m.so").run(feeds, LocalWorld(1).communicator(0))
    for out, r in zip(m.graph.output, ref):
        np.testing.assert_allclose(got[out.name], r, rtol=RTOL, atol=ATOL, err_msg=f"{key}: {out.name}")


def test_per_device_lists_every_heldout_model() -> None:
    mod = load_script("per_device")
    assert mod.HELDOUT_KEYS == list(H.HELDOUT)
