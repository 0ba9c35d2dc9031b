"""Spatial and hybrid partitioning through TVM, 2 ranks under mpiexec, checked with ``run --check``.

``--check`` compares every output with ONNX Runtime on the unpartitioned source model (rtol 1e-4,
atol 1e-5). The model is the zoo resnet at its smallest (image 32, width 4, batch 2) so the two
TVM builds fit the fast suite: spatial splits the image rows over the ranks and exchanges halos
around each 3x3 convolution; hybrid on 2 ranks runs the convolutions data-parallel and splits the
classifier's weight (an AllGather of the batch before it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner import cli


def small_cnn(batch: int = 2, image: int = 16, channels: int = 4, classes: int = 4) -> onnx.ModelProto:
    """x[B,3,H,W] -> Conv3x3 -> Relu -> Conv3x3 -> Relu -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [w("w1", channels, 3, 3, 3), w("b1", channels), w("w2", channels, channels, 3, 3), w("b2", channels),
             w("fc_w", channels, classes), w("fc_b", classes)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], name="fc")]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, image, image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cnn") / "small_cnn.onnx"
    onnx.save(small_cnn(), path)
    return path


def _comm_ops(art: Path) -> set[str]:
    progs = [onnx.load(art / f"rank{r}.onnx") for r in range(2)]
    return {n.op_type for p in progs for n in p.graph.node if n.domain == "partitioner.comm"}


@pytest.mark.parametrize("strategy", ["spatial", "hybrid"])
def test_tvm_two_ranks_under_mpi_matches_onnxruntime(cnn: Path, tmp_path: Path, strategy: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / strategy
    assert cli.main(["compile", str(cnn), "-o", str(art), "--devices", "2", "--strategy", strategy,
                     "--backend", "tvm", "--jobs", "1"]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["plan_summary"]["strategy"] == strategy and manifest["backend"] == "tvm"
    assert manifest["fallback"] is None and manifest["world_size"] == 2
    assert all((art / f"rank{r}.so").is_file() for r in range(2))
    comm = _comm_ops(art)
    if strategy == "spatial":
        assert {"Send", "Recv"} <= comm, comm  # the halo rows of each 3x3 convolution
    else:
        assert "AllGather" in comm, comm  # the batch gathered before the split classifier
    capsys.readouterr()
    rc = cli.main(["run", str(art), "--check", "--json", "--timeout", "300"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["check"]["ok"], doc["check"]
    assert len(doc["timings"]["ranks"]) == 2
