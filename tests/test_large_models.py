"""Models larger than memory (issue 14): external weights stay lazy from load to plan.

- A model whose external data is a 3 GiB sparse file loads, inspects and plans in a subprocess
  whose peak RSS stays far below one weight (so no weight was read); with ``--shapes-only`` the
  data file may be absent, without it an absent file is one line and exit 2.
- Lowering a lazily loaded model gives each rank references, not bytes; reading those
  references back (:func:`with_shards_read`) and running the ranks matches ONNX Runtime on the
  original model, for a tensor split (non-contiguous column slices) and a pipeline split.
- Constant folding does not read a large lazy weight; once read in, it folds as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.load import INLINE_EXTERNAL_BYTES, load
from partitioner.lowering.lazy_weights import SLICE_KEY, read_in_external, with_shards_read
from partitioner.partition import partition
from passes import run_pipeline
from tests.bench_scripts import load as load_script

ROOT = Path(__file__).resolve().parents[1]


def _external(name: str, dims: list[int], location: str, offset: int) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(4 * int(np.prod(dims))))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def sparse_model(folder: Path, hidden: int = 8192, layers: int = 6) -> Path:
    """``layers`` MatMul+Relu blocks whose weights (alternately hidden x 2*hidden and 2*hidden x
    hidden, 512 MiB each at hidden 8192) live in one sparse file: 3 GiB of data, no disk used."""
    nodes, inits, x, offset = [], [], "x", 0
    for i in range(layers):
        dims = [hidden, 2 * hidden] if i % 2 == 0 else [2 * hidden, hidden]
        inits.append(_external(f"w{i}", dims, "weights.data", offset))
        offset += 4 * dims[0] * dims[1]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    with open(folder / "weights.data", "wb") as f:
        f.truncate(offset)
    return folder / "model.onnx"


_MEASURE = """
import sys
from partitioner.cli import main
from partitioner.core.machine import peak_rss_bytes
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
sys.stdout.flush()
print("MAXRSS_KIB", peak_rss_bytes() // 1024, file=sys.stderr)
sys.exit(rc)
"""


def _cli(*args: str) -> tuple[int, str, str, int]:
    """Run the CLI in a fresh interpreter; (exit code, stdout, stderr without the RSS line, peak RSS bytes)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    lines = proc.stderr.splitlines()
    rss = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MAXRSS_KIB")]
    rest = "\n".join(line for line in lines if not line.startswith("MAXRSS_KIB"))
    return proc.returncode, proc.stdout, rest, rss[0] if rss else -1


def test_sparse_3gib_model_inspects_and_plans_without_reading_weights(tmp_path: Path) -> None:
    path = sparse_model(tmp_path / "m")
    assert (tmp_path / "m" / "weights.data").stat().st_size == 3 * 2**30
    rc, out, err, rss = _cli("inspect", str(path), "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["param_bytes"] == 3 * 2**30
    # one weight is 512 MiB: a process that read any would peak above it (the interpreter,
    # numpy, onnx and onnxruntime take about 150 MiB here)
    assert rss < 450 * 2**20, f"inspect peaked at {rss / 2**20:.0f} MiB"
    rc, out, err, rss = _cli("plan", str(path), "--cluster", "cpu:4", "--memory-limit", "1GiB", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["prediction"]["fits_memory"] is True
    assert plan["plan"]["world_size"] >= 4  # 3 GiB of weights under 1 GiB per device needs every device
    assert rss < 450 * 2**20, f"plan peaked at {rss / 2**20:.0f} MiB"


def test_absent_data_file_needs_shapes_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = sparse_model(tmp_path / "m", hidden=1024, layers=2)
    (tmp_path / "m" / "weights.data").unlink()
    from partitioner.cli import main

    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "weights.data" in err and "no such file" in err, err
    assert main(["plan", str(path), "--shapes-only", "--cluster", "cpu:2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["world_size"] >= 1


def test_shapes_only_still_refuses_unsafe_paths(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    path = sparse_model(folder, hidden=1024, layers=1)
    model = onnx.load(str(path), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../outside.data"
    path.write_bytes(model.SerializeToString())
    from partitioner.core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="'..' is refused"):
        load(str(path), shapes_only=True)


def _saved_with_external_data(folder: Path, proto: onnx.ModelProto) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)  # onnx.save moves the data of the proto it is given out to the file
    onnx.save(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="w.data",
              size_threshold=0)
    return path


def _mlp(hidden: int = 256, seed: int = 0) -> onnx.ModelProto:
    """x[8,hidden] -> MatMul W1[hidden,2h] + b1 -> Relu -> MatMul W2[2h,hidden] (weights over 64 KiB)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(hidden)).astype(np.float32)
    b1 = rng.standard_normal(2 * hidden).astype(np.float32)
    w2 = (rng.standard_normal((2 * hidden, hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, hidden])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                               numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_large_initializers_load_lazily_small_ones_in_memory(tmp_path: Path) -> None:
    proto = _mlp()
    model = load(str(_saved_with_external_data(tmp_path / "m", proto)))
    kinds = {name: type(v.const_value) for name, v in model.graph.initializers.items()}
    assert kinds["w1"] is ir.ExternalTensor and kinds["w2"] is ir.ExternalTensor  # 512 KiB each
    assert kinds["b1"] is not ir.ExternalTensor  # 2 KiB: read in for data propagation
    assert 512 * 4 < INLINE_EXTERNAL_BYTES < 256 * 512 * 4
    want = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for name, v in model.graph.initializers.items():
        np.testing.assert_array_equal(v.const_value.numpy(), want[name])
    prepared = run_pipeline(model)
    assert type(prepared.graph.initializers["w1"].const_value) is ir.ExternalTensor


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_lazy_shards_read_back_match_onnxruntime(tmp_path: Path, strategy: str) -> None:
    from partitioner.runtime.in_process import run_reference

    proto = _mlp()
    folder = tmp_path / "m"
    model = run_pipeline(load(str(_saved_with_external_data(folder, proto))))
    res = partition(model, "cpu:2", strategy=strategy)
    lazy = [t for p in res.programs for t in p.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert lazy and all(not t.raw_data for t in lazy)
    if strategy == "tensor":  # W1 split by columns: a non-contiguous slice, recorded for the reader
        assert any(e.key == SLICE_KEY for t in lazy for e in t.metadata_props)
    programs = with_shards_read(res.programs, folder)
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    got = run_reference(programs, res.bindings, {"x": x})
    want = _ort(proto, {"x": x})[0]
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)


def test_constant_folding_leaves_large_lazy_weights_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB, over the folding pass's lazy limit
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1024])],
                              [numpy_helper.from_array(w.T.copy(), "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = _saved_with_external_data(tmp_path / "m", proto)
    lazy = run_pipeline(load(str(path)))
    assert [n.op_type for n in lazy.graph] == ["Transpose", "MatMul"]
    assert type(lazy.graph.initializers["w"].const_value) is ir.ExternalTensor
    eager = run_pipeline(read_in_external(load(str(path))))
    assert [n.op_type for n in eager.graph] == ["MatMul"]
    x = rng.standard_normal((2, 512)).astype(np.float32)
    want = _ort(proto, {"x": x})[0]
    got = _ort(ir.serde.serialize_model(eager), {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_compile_of_an_in_memory_model_over_2gb_is_refused_in_one_line(tmp_path: Path) -> None:
    """An ``ir.Model`` has no path to refer to, so its source would be serialised whole: over
    2 GiB of lazy weights that is refused before a byte is read (a path compiles: streamed)."""
    from partitioner.compiler import compile as compile_artifact
    from partitioner.core.errors import ModelLoadError

    model = load(str(sparse_model(tmp_path / "m")))
    with pytest.raises(ModelLoadError, match=r"3\.00 GiB of external weights.*pass the model's path"):
        compile_artifact(model, "cpu:4", backend="onnxruntime", out_dir=tmp_path / "a")


# per-rank data files in the artifact ------------------------------------------------------------

@pytest.fixture
def tensor_artifact(tmp_path: Path):
    from partitioner.compiler import compile as compile_artifact

    proto = _mlp()
    path = _saved_with_external_data(tmp_path / "m", proto)
    art = compile_artifact(str(path), "cpu:2", strategy="tensor", backend="onnxruntime", out_dir=tmp_path / "art")
    return art, proto


def test_each_rank_gets_a_data_file_with_only_its_weights(tensor_artifact) -> None:
    import hashlib

    art, proto = tensor_artifact
    weights = sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer if t.name in ("w1", "w2"))
    for r in range(2):
        data = art.root / f"rank{r}.data"
        # W1 split by columns and W2 by rows: each rank holds half of each, nothing else that large
        assert weights // 2 <= data.stat().st_size < weights // 2 + 4096
        assert (art.root / f"rank{r}.onnx").stat().st_size < 64 * 1024
        entry = art.manifest["files"][f"rank{r}.data"]
        assert entry["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
        assert art.manifest["ranks"][r]["data"] == f"rank{r}.data"
    x = np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32)
    got = art.run({"x": x}, in_process=True).outputs["y"]
    np.testing.assert_allclose(got, _ort(proto, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_a_changed_data_file_is_refused_before_loading(tensor_artifact) -> None:
    from partitioner.compiler import load_artifact
    from partitioner.core.errors import ArtifactError

    art, _ = tensor_artifact
    data = art.root / "rank1.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"rank1\.data: sha256 does not match"):
        load_artifact(art.root)
    rc, _, err, _ = _cli("run", str(art.root))
    assert rc == 2 and "rank1.data" in err and len(err.strip().splitlines()) == 1


# compile streams; the source by reference; the worker maps its weights ------------------------------

def _artifact_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def test_compile_keeps_the_source_by_reference_not_a_copy(tensor_artifact, tmp_path: Path) -> None:
    import hashlib

    from partitioner.artifact import source_model_path

    art, proto = tensor_artifact
    entry = art.manifest["source_model"]
    assert entry["file"] is None and "source.onnx" not in art.manifest["files"]
    ref = entry["reference"]
    model_path = (tmp_path / "m" / "model.onnx").resolve()
    assert ref["path"] == str(model_path)
    assert ref["sha256"] == hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert [d["file"] for d in ref["data"]] == ["w.data"]
    assert ref["data"][0]["sha256"] == hashlib.sha256((model_path.parent / "w.data").read_bytes()).hexdigest()
    assert source_model_path(art.root, art.manifest) == model_path
    weights = sum(t.ByteSize() for t in proto.graph.initializer)
    assert _artifact_bytes(art.root) < 1.2 * weights + 64 * 1024  # each weight stored once, no source copy


def test_a_changed_referenced_source_is_refused_by_check(tensor_artifact, tmp_path: Path) -> None:
    from partitioner.core.errors import ArtifactError

    art, _ = tensor_artifact
    data = tmp_path / "m" / "w.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    x = np.zeros((8, 256), np.float32)
    with pytest.raises(ArtifactError, match=r"w\.data: the source model this artifact refers to has changed"):
        art.run({"x": x}, check=True, in_process=True)
    data.unlink()
    with pytest.raises(ArtifactError, match=r"w\.data: the source model this artifact refers to is missing"):
        art.run({"x": x}, check=True, in_process=True)


def test_a_malformed_source_reference_is_refused(tensor_artifact) -> None:
    from partitioner.artifact import manifest_checksum, verify_artifact
    from partitioner.core.errors import ArtifactError

    art, _ = tensor_artifact
    path = art.root / "manifest.json"
    for edit in ({"file": "../outside.data"}, {"path": "relative/model.onnx"}):
        m = json.loads(path.read_text())
        ref = m["source_model"]["reference"]
        if "file" in edit:
            ref["data"][0]["file"] = edit["file"]
        else:
            ref["path"] = edit["path"]
        m.pop("manifest_sha256")
        m["manifest_sha256"] = manifest_checksum(m)  # a crafted manifest, consistent with itself
        original = path.read_text()
        path.write_text(json.dumps(m))
        with pytest.raises(ArtifactError, match="source_model has neither a file nor a well-formed reference"):
            verify_artifact(art.root)
        path.write_text(original)


def test_mpi_ranks_map_their_weights_and_report_peak_rss(tensor_artifact) -> None:
    art, proto = tensor_artifact
    x = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    res = art.run({"x": x}, check=True, timeout=120)
    np.testing.assert_allclose(res.outputs["y"], _ort(proto, {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert res.check is not None and res.check.ok and not res.check.skipped
    rss = [r["peak_rss_bytes"] for r in res.timings["ranks"]]
    assert len(rss) == 2 and all(isinstance(v, int) and v > 20 * 2**20 for v in rss), rss


def test_a_rank_program_without_its_data_runs_on_mapped_weights(tensor_artifact) -> None:
    from backends import get_backend
    from partitioner.core.mapped_weights import map_rank_weights
    from partitioner.runtime.comm_local import LocalWorld
    from partitioner.runtime.in_process import run_ranks
    from partitioner.runtime.schedule import run_step
    from partitioner.core.bindings import gather_outputs, scatter_inputs

    art, proto = tensor_artifact
    lean = [art.program(r, load_data=False) for r in range(2)]
    for r, p in enumerate(lean):
        assert all(not t.raw_data for t in p.graph.initializer if t.data_location == TensorProto.EXTERNAL)
        mapped = map_rank_weights(p, art.root)
        assert mapped and all(isinstance(a, np.memmap) and not a.flags.writeable for a in mapped.values())
        full = {t.name: numpy_helper.to_array(t) for t in art.programs[r].graph.initializer}
        for name, a in mapped.items():
            np.testing.assert_array_equal(a, full[name])
    x = np.random.default_rng(6).standard_normal((8, 256)).astype(np.float32)
    feeds = scatter_inputs(art.bindings, {"x": x})
    backend = get_backend("onnxruntime")

    def one(rank: int, comm: object) -> list:
        return run_step(backend.load(lean[rank], art.backend_file(rank)), feeds[rank], comm)

    results, failed, _ = run_ranks(LocalWorld(2, timeout_s=30), one)
    assert not failed
    got = gather_outputs(art.bindings, results)["y"]
    np.testing.assert_allclose(got, _ort(proto, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_the_check_reference_runs_in_its_own_process_or_is_skipped(tensor_artifact,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import partitioner.runtime.reference as reference

    art, proto = tensor_artifact
    x = np.random.default_rng(7).standard_normal((8, 256)).astype(np.float32)
    calls: list[list[str]] = []
    real_run = subprocess.run

    def spy(cmd, *a, **k):  # noqa: ANN001, ANN002, ANN003
        calls.append(list(cmd))
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(reference, "IN_PROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(reference.subprocess, "run", spy)
    res = art.run({"x": x}, check=True, in_process=True)
    assert res.check.ok and len(res.check.outputs) == 1 and res.check.outputs[0].max_abs < 1e-4
    assert calls and "partitioner.runtime.reference" in calls[0]
    monkeypatch.setattr(reference, "available_bytes", lambda: 1024)
    res = art.run({"x": x}, check=True, in_process=True)
    assert res.check.outputs == () and res.check.skipped.startswith("check skipped: the source model")


# TVM accuracy at depth: the sums are right, only their order differs ------------------------------

def _large_model_script():  # noqa: ANN202 - a module loaded from its file
    return load_script("large_model")


def _in_order(a: np.ndarray, w: np.ndarray, fused: bool) -> np.ndarray:
    """``a @ w`` in float32 with each element summed in order k = 0..K-1: one fused multiply-add
    per term (the float32 product is exact in float64; the one rounding to float32 is the FMA's,
    bar double-rounding ties, none of which occur for this seed), or, ``fused=False``, a rounded
    product then a rounded add (a target without FMA)."""
    acc = np.zeros((a.shape[0], w.shape[1]), np.float32)
    for k in range(w.shape[0]):
        if fused:
            acc = (a[:, k:k + 1].astype(np.float64) * w[k].astype(np.float64) + acc).astype(np.float32)
        else:
            acc = acc + a[:, k:k + 1] * w[k]
    return acc


def _in_order_model(x: np.ndarray, weights: np.ndarray, axes: list[int], ranks: int, fused: bool) -> np.ndarray:
    """The tensor-split model summed the way the TVM ranks sum it: a column-split weight (axis 1)
    gives each rank whole in-order sums; a row-split one (axis 0) gives each rank an in-order sum
    over its contiguous rows, then the AllReduce adds the ranks' partial sums in float32."""
    a = x
    for w, axis in zip(weights, axes):
        if axis == 0:
            parts = [_in_order(a[:, rows], w[rows], fused) for rows in np.array_split(np.arange(w.shape[0]), ranks)]
            s = parts[0]
            for part in parts[1:]:
                s = s + part
        else:
            s = _in_order(a, w, fused)
        a = np.maximum(s, np.float32(0))
    return a


def test_tvm_tensor_split_matmuls_are_the_in_order_float32_sums(tmp_path: Path) -> None:
    """Why the 2.7 GB TVM row missed ``run --check``'s default atol by 1.75e-5 (docs/large_models.md):
    the benchmark's model at hidden 1024 (same form: MatMul+ReLU, He-initialised external weights),
    split over 2 ranks column/row/column and run under mpiexec on memory-mapped weight parameters,
    equals bit for bit the in-order float32 sums (so no shard, offset, dtype or transposition is
    wrong: any of those changes the result by O(1)). Its error against float64 is then rounding
    only, within the benchmark's stated bound ``6 u sqrt(K layers)``, and at K = 1024 it also
    meets ONNX Runtime at the default tolerance (the reference runs on the source model)."""
    from partitioner.compiler import compile as compile_artifact

    bench = _large_model_script()
    hidden, layers, ranks = 1024, 3, 2
    path = bench.make_model(tmp_path / "m", hidden, layers)
    art = compile_artifact(str(path), f"cpu:{ranks}", strategy="tensor", backend="tvm", out_dir=tmp_path / "art")
    plan = json.loads((art.root / "plan.json").read_text())
    axes = [plan["nodes"][f"mm{i}"]["inputs"][1]["axis"] for i in range(layers)]
    assert sorted(set(axes)) == [0, 1], axes  # both kinds of shard are exercised
    for r in range(ranks):  # the weights are parameters read from rank<i>.data, not constants in the library
        assert art.backend_file(r).stat().st_size < (art.root / f"rank{r}.data").stat().st_size / 4
    x = bench.seeded_input(hidden)
    res = art.run({"x": x}, check=True, timeout=300)
    got = res.outputs[f"r{layers - 1}"]
    weights = np.fromfile(path.parent / "big.data", dtype=np.float32).reshape(layers, hidden, hidden)
    exact = [_in_order_model(x, weights, axes, ranks, fused) for fused in (True, False)]
    assert any(np.array_equal(got, e) for e in exact), [float(np.abs(got - e).max()) for e in exact]
    truth = bench.float64_outputs(path.parent, x, hidden, layers)
    assert np.abs(got - truth).max() <= bench.stated_atol(hidden, layers)
    assert res.check is not None and res.check.ok and res.check.atol == 1e-5, res.check


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tvm", "onnxruntime"])
def test_a_2_7_gb_model_compiles_runs_and_matches_in_bounded_memory(tmp_path: Path, backend: str) -> None:
    """Issue 14's "Done when" row, through benchmarks/large_model.py (the same code as the README
    rows): ten 8192x8192 float32 weights (2.68 GB of external data) compile for 4 ranks under
    ``--memory-limit 1GiB`` with compile peak RSS at most 3 GB, run under mpiexec (``run`` starts
    ``mpiexec -n 4 python -m partitioner.runtime.worker``, the program ``partitioner worker`` is)
    with every rank under 1.5 GiB peak RSS, and match ONNX Runtime run on the whole model in a
    separate process, at the default rtol and the benchmark's stated atol ``6 u sqrt(K layers)``
    (1.0e-4: the in-order float32 sums of K = 8192 terms over ten layers have an error of about
    1.7e-5 where an output cancels to near zero; ``test_tvm_tensor_split_matmuls_are_the_in_order_
    float32_sums`` proves the order is the only difference). The run is also within that bound of a
    float64 evaluation. The artifact is at most 1.2x the weights plus code.
    Needs about 8 GB of free memory (4 ranks plus the reference) and 6 GB of disk."""
    from partitioner.runtime.reference import IN_PROCESS_MAX_BYTES

    out = tmp_path / "row.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "large_model.py"), "--hidden", "8192",
                           "--layers", "10", "--ranks", "4", "--memory-limit", "1GiB", "--repeat", "2",
                           "--backend", backend, "--out", str(out)],  # its temporary model is deleted
                          capture_output=True, text=True, timeout=3600, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["backend"] == backend and row["weight_bytes"] >= 2.5e9
    assert row["weight_bytes"] > IN_PROCESS_MAX_BYTES  # so the check's reference ran in its own process
    for step in ("inspect", "plan", "compile", "run_check", "bench"):
        assert row[f"{step}_ok"], (step, row.get(f"{step}_error"))
    bound = 6 * 2.0**-24 * np.sqrt(8192 * 10)
    assert row["check_rtol"] == 1e-4 and row["check_atol"] == pytest.approx(bound) and bound < 1.1e-4
    assert row["check_ok"] and row["check_max_abs"] <= bound
    assert row["run_vs_float64_max_abs"] <= bound and row["onnxruntime_vs_float64_max_abs"] <= bound
    assert row["compile_peak_rss_bytes"] <= 3e9
    assert len(row["per_rank_peak_rss_bytes"]) == 4 and row["max_rank_peak_rss_bytes"] < 1.5 * 2**30
    code = 64 * 2**20  # programs, manifest, plan, report (and libraries for tvm)
    assert row["artifact_bytes"] <= 1.2 * row["weight_bytes"] + code
