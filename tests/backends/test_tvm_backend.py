"""TVM backend: per-rank programs with comm ops compiled to .so and run in threads over LocalWorld.

Every numeric check compares against ONNX Runtime on an unpartitioned equivalent model, or
against hand-computed numpy, with seeded inputs (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm  # noqa: E402,F401  (a broken install fails, never skips)

import backends.tvm as bt  # noqa: E402
from backends.tvm.progress import BuildProgress  # noqa: E402
from backends.tvm.target import cpu_from_cpuinfo, detect_host_target, target_dict  # noqa: E402
from partitioner.core.comm_ops import make_node, opset_import  # noqa: E402
from partitioner.core.errors import BackendError, RunFailed  # noqa: E402
from partitioner.core.files import sha256_file  # noqa: E402
from partitioner.runtime.comm_local import LocalWorld  # noqa: E402

F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5


def vi(name: str, shape: list[int], dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def model(nodes, name, inputs, outputs, inits=(), value_info=(), comm=True) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits), value_info=list(value_info))
    opsets = [helper.make_opsetid("", 17)] + ([opset_import()] if comm else [])
    return helper.make_model(g, opset_imports=opsets)


def ort_run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def run_ranks(programs, paths, feeds, timeout_s: float = 20.0):
    """Run every rank in its own thread; an exception on one rank aborts the world."""
    world = LocalWorld(len(programs), timeout_s=timeout_s)
    results: list[object] = [None] * len(programs)

    def worker(r: int) -> None:
        try:
            ex = bt.load(programs[r], paths[r])
            results[r] = ex.run(feeds[r], world.communicator(r))
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            world.abort(f"rank {r}: {e}")
            results[r] = e

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return results


def ok(results):
    for r, res in enumerate(results):
        if isinstance(res, BaseException):
            raise AssertionError(f"rank {r} failed: {res!r}") from res
    return results


# -- programs ------------------------------------------------------------------------------------

RNG = np.random.default_rng(1234)
W0 = RNG.standard_normal((4, 6)).astype(np.float32)
W1 = RNG.standard_normal((4, 6)).astype(np.float32)
X = RNG.standard_normal((2, 4)).astype(np.float32)


def send_recv_programs() -> list[onnx.ModelProto]:
    """Row-sum of a split MatMul: rank r holds W_r; AllReduce; rank 0 sends relu to rank 1."""
    progs = []
    for r, w in enumerate((W0, W1)):
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
            make_node("AllReduce", ["y"], ["ys"], name="ar", group=[0, 1], reduction="sum", tag=1),
            helper.make_node("Relu", ["ys"], ["z"], name="relu"),
        ]
        if r == 0:
            nodes.append(make_node("Send", ["z"], [], name="snd", peer=1, tag=2))
            outs = [vi("ys", [2, 6])]
        else:
            nodes.append(make_node("Recv", [], ["r"], name="rcv", peer=0, tag=2, shape=[2, 6], dtype=F))
            nodes.append(helper.make_node("Add", ["r", "z"], ["out"], name="add"))
            outs = [vi("out", [2, 6])]
        progs.append(model(nodes, f"rank{r}", [vi("x", [2, 4])], outs, [numpy_helper.from_array(w, "W")],
                           [vi("ys", [2, 6]), vi("r", [2, 6])]))
    return progs


def send_recv_reference() -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["a"]),
        helper.make_node("MatMul", ["x", "W1"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["ys"]),
        helper.make_node("Relu", ["ys"], ["z"]),
        helper.make_node("Add", ["z", "z"], ["out"]),
    ]
    inits = [numpy_helper.from_array(W0, "W0"), numpy_helper.from_array(W1, "W1")]
    return model(nodes, "full", [vi("x", [2, 4])], [vi("ys", [2, 6]), vi("out", [2, 6])], inits, comm=False)


def allgather_programs() -> list[onnx.ModelProto]:
    """Column-parallel MatMul (rank r holds columns r*3:(r+1)*3), AllGather, then Gemm + Relu."""
    wfull = np.concatenate([W0[:, :3], W1[:, 3:]], axis=1)
    v = RNG.standard_normal((6, 5)).astype(np.float32)
    c = RNG.standard_normal((5,)).astype(np.float32)
    progs = []
    for r in range(2):
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
            make_node("AllGather", ["y"], ["yg"], name="ag", group=[0, 1], axis=1, tag=7),
            helper.make_node("Gemm", ["yg", "V", "C"], ["g"], name="gemm"),
            helper.make_node("Relu", ["g"], ["out"], name="relu"),
        ]
        inits = [numpy_helper.from_array(np.ascontiguousarray(wfull[:, 3 * r:3 * r + 3]), "W"),
                 numpy_helper.from_array(v, "V"), numpy_helper.from_array(c, "C")]
        progs.append(model(nodes, f"rank{r}", [vi("x", [2, 4])], [vi("out", [2, 5])], inits, [vi("yg", [2, 6])]))
    ref_nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Gemm", ["y", "V", "C"], ["g"]),
                 helper.make_node("Relu", ["g"], ["out"])]
    ref = model(ref_nodes, "full", [vi("x", [2, 4])], [vi("out", [2, 5])],
                [numpy_helper.from_array(wfull, "W"), numpy_helper.from_array(v, "V"), numpy_helper.from_array(c, "C")],
                comm=False)
    return progs + [ref]


def conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    wc = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    bc = rng.standard_normal((4,)).astype(np.float32)
    wg = rng.standard_normal((10, 4 * 8 * 8)).astype(np.float32) * 0.1
    bg = rng.standard_normal((10,)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "wc", "bc"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], axis=1, name="flat"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["logits"], transB=1, name="fc"),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((wc, "wc"), (bc, "bc"), (wg, "wg"), (bg, "bg"))]
    return model(nodes, "convnet", [vi("x", [2, 3, 8, 8])], [vi("logits", [2, 10])], inits, comm=False)


# -- tests ---------------------------------------------------------------------------------------

def test_send_recv_allreduce_two_ranks_match_ort(tmp_path: Path) -> None:
    progs = send_recv_programs()
    facts = bt.build_all(progs, tmp_path, progress=False, jobs=1)
    assert [f["comm_ops"] for f in facts] == [2, 2]
    res = ok(run_ranks(progs, [tmp_path / f["file"] for f in facts], [{"x": X}, {"x": X}]))
    ref = ort_run(send_recv_reference(), {"x": X})
    np.testing.assert_allclose(res[0]["ys"], ref["ys"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(res[1]["out"], ref["out"], rtol=RTOL, atol=ATOL)
    assert set(res[0]) == {"ys"} and set(res[1]) == {"out"}


def test_pipeline_rank_without_outputs(tmp_path: Path) -> None:
    """Rank 0: MatMul -> Send (no graph outputs, plus a dead node); rank 1: Recv -> Add."""
    b = RNG.standard_normal((2, 6)).astype(np.float32)
    p0 = model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
                helper.make_node("Neg", ["x"], ["dead"], name="dead"),
                make_node("Send", ["y"], [], name="snd", peer=1, tag=5)],
               "rank0", [vi("x", [2, 4])], [], [numpy_helper.from_array(W0, "W")])
    p1 = model([make_node("Recv", [], ["r"], name="rcv", peer=0, tag=5, shape=[2, 6], dtype=F),
                helper.make_node("Add", ["r", "b"], ["out"], name="add")],
               "rank1", [], [vi("out", [2, 6])], [numpy_helper.from_array(b, "b")], [vi("r", [2, 6])])
    facts = bt.build_all([p0, p1], tmp_path, progress=False, jobs=1)
    res = ok(run_ranks([p0, p1], [tmp_path / f["file"] for f in facts], [{"x": X}, {}]))
    assert res[0] == {}
    ref = model([helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["y", "b"], ["out"])], "full",
                [vi("x", [2, 4])], [vi("out", [2, 6])], [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(b, "b")],
                comm=False)
    np.testing.assert_allclose(res[1]["out"], ort_run(ref, {"x": X})["out"], rtol=RTOL, atol=ATOL)


def test_allgather_in_the_middle_matches_ort(tmp_path: Path) -> None:
    *progs, ref_model = allgather_programs()
    facts = bt.build_all(progs, tmp_path, progress=False, jobs=1)
    res = ok(run_ranks(progs, [tmp_path / f["file"] for f in facts], [{"x": X}, {"x": X}]))
    ref = ort_run(ref_model, {"x": X})["out"]
    for r in range(2):
        np.testing.assert_allclose(res[r]["out"], ref, rtol=RTOL, atol=ATOL)


def test_other_collectives_and_unread_comm_output(tmp_path: Path) -> None:
    """Broadcast, ReduceScatter and AllToAll against numpy. Rank 0 never reads its AllReduce
    result while rank 1 returns it: if rank 0's library dropped the call, rank 1 would time out."""
    a = [np.arange(8, dtype=np.float32).reshape(2, 4) + 10 * r for r in range(2)]
    progs = []
    for r in range(2):
        bcast_in = ["a"] if r == 0 else []
        nodes = [
            make_node("Broadcast", bcast_in, ["b"], name="bc", group=[0, 1], root=0, tag=1, shape=[2, 4], dtype=F),
            make_node("ReduceScatter", ["a"], ["rs"], name="rs", group=[0, 1], axis=1, reduction="max", tag=2),
            make_node("AllToAll", ["a"], ["t"], name="a2a", group=[0, 1], split_axis=1, concat_axis=0, tag=3),
            make_node("AllReduce", ["a"], ["unused"], name="ar", group=[0, 1], reduction="sum", tag=4),
            helper.make_node("Mul", ["b", "b"], ["b2"], name="sq"),
        ]
        outs = [vi("b2", [2, 4]), vi("rs", [2, 2]), vi("t", [4, 2])] + ([vi("unused", [2, 4])] if r == 1 else [])
        progs.append(model(nodes, f"rank{r}", [vi("a", [2, 4])], outs, value_info=[vi("b", [2, 4]), vi("unused", [2, 4])]))
    facts = bt.build_all(progs, tmp_path, progress=False, jobs=1)
    res = ok(run_ranks(progs, [tmp_path / f["file"] for f in facts], [{"a": a[0]}, {"a": a[1]}], timeout_s=5))
    np.testing.assert_array_equal(res[1]["unused"], a[0] + a[1])
    mx = np.maximum(a[0], a[1])
    for r in range(2):
        np.testing.assert_allclose(res[r]["b2"], a[0] * a[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(res[r]["rs"], mx[:, 2 * r:2 * r + 2])
        np.testing.assert_array_equal(res[r]["t"], np.concatenate([a[0][:, 2 * r:2 * r + 2], a[1][:, 2 * r:2 * r + 2]], 0))


def test_importer_helper_functions_do_not_clash_across_segments(tmp_path: Path) -> None:
    """Clip imports as helper PrimFuncs named maximum/minimum; two segments both have them."""
    lo = numpy_helper.from_array(np.array(-0.5, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(0.5, np.float32), "hi")
    nodes = [
        helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip1"),
        make_node("AllReduce", ["c"], ["s"], name="ar", group=[0, 1], reduction="sum", tag=1),
        helper.make_node("Clip", ["s", "lo", "hi"], ["y"], name="clip2"),
    ]
    progs = [model(nodes, f"rank{r}", [vi("x", [2, 4])], [vi("y", [2, 4])], [lo, hi], [vi("s", [2, 4])]) for r in range(2)]
    ref_nodes = [helper.make_node("Clip", [f"x{r}", "lo", "hi"], [f"c{r}"]) for r in range(2)] + [
        helper.make_node("Add", ["c0", "c1"], ["s"]), helper.make_node("Clip", ["s", "lo", "hi"], ["y"])]
    ref = model(ref_nodes, "full", [vi("x0", [2, 4]), vi("x1", [2, 4])], [vi("y", [2, 4])], [lo, hi], comm=False)
    xs = [np.random.default_rng(r).standard_normal((2, 4)).astype(np.float32) for r in range(2)]
    facts = bt.build_all(progs, tmp_path, progress=False, jobs=1)
    assert facts[1]["same_as"] == 0  # byte-identical programs: one compile
    res = ok(run_ranks(progs, [tmp_path / f["file"] for f in facts], [{"x": xs[0]}, {"x": xs[1]}]))
    expected = ort_run(ref, {"x0": xs[0], "x1": xs[1]})["y"]
    for r in range(2):
        np.testing.assert_allclose(res[r]["y"], expected, rtol=RTOL, atol=ATOL)


def test_pure_conv_model_matches_ort(tmp_path: Path) -> None:
    m = conv_model()
    facts = bt.build(m, tmp_path / "rank0.so")
    assert facts["comm_ops"] == 0 and facts["segments"] == 1
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    out = bt.load(m, tmp_path / "rank0.so").run({"x": x}, LocalWorld(1).communicator(0))
    np.testing.assert_allclose(out["logits"], ort_run(m, {"x": x})["logits"], rtol=RTOL, atol=ATOL)


def test_gather_takes_are_bounded_and_silent(tmp_path: Path, capfd) -> None:
    """lower.py ``_bounded_takes``: the importer's ``take`` in mode "fast" becomes "clip", so
    building logs no "Fast mode segfaults" line, in-range and negative indices match ONNX
    Runtime, and an out-of-range index reads the edge row instead of memory past the table."""
    table = np.random.default_rng(5).standard_normal((50, 8)).astype(np.float32)
    m = model([helper.make_node("Gather", ["W", "ids"], ["y"], axis=0)], "emb",
              [vi("ids", [2, 3], TensorProto.INT64)], [vi("y", [2, 3, 8])],
              [numpy_helper.from_array(table, "W")], comm=False)
    capfd.readouterr()
    bt.build(m, tmp_path / "rank0.so")
    assert "Fast mode" not in capfd.readouterr().err
    ex = bt.load(m, tmp_path / "rank0.so")
    ids = np.array([[0, 7, 49], [-1, -50, 3]], dtype=np.int64)
    out = ex.run({"ids": ids}, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_allclose(out, ort_run(m, {"ids": ids})["y"], rtol=RTOL, atol=ATOL)
    far_ids = np.array([[50, 10**6, 0], [-51, 2, 1]], dtype=np.int64)
    far = ex.run({"ids": far_ids}, LocalWorld(1).communicator(0))["y"]
    np.testing.assert_array_equal(far[0, 0], table[49])
    np.testing.assert_array_equal(far[0, 1], table[49])
    np.testing.assert_array_equal(far[1, 0], table[0])


def test_failure_on_one_rank_aborts_the_other(tmp_path: Path) -> None:
    progs = send_recv_programs()
    facts = bt.build_all(progs, tmp_path, progress=False, jobs=1)
    t0 = time.monotonic()
    res = run_ranks(progs, [tmp_path / f["file"] for f in facts], [{}, {"x": X}], timeout_s=30)
    assert time.monotonic() - t0 < 20, "the waiting rank should be woken by abort, not by its 30 s timeout"
    assert "missing input" in str(res[0])
    assert isinstance(res[1], RunFailed) and "aborted" in str(res[1])


def test_unsupported_ops_listed_at_once(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("FancyOp", ["x"], ["a"], name="n_fancy"),
        helper.make_node("Relu", ["a"], ["b"], name="n_relu"),
        helper.make_node("WeirdOp", ["b"], ["c"], name="n_weird"),
        helper.make_node("FusedThing", ["c"], ["y"], name="n_ms", domain="com.microsoft"),
    ]
    m = model(nodes, "bad", [vi("x", [2])], [vi("y", [2])], value_info=[vi("a", [2]), vi("b", [2]), vi("c", [2])])
    with pytest.raises(BackendError) as e:
        bt.build(m, tmp_path / "bad.so")
    msg = str(e.value)
    for needle in ("n_fancy (FancyOp)", "n_weird (WeirdOp)", "n_ms (com.microsoft::FusedThing)"):
        assert needle in msg
    assert "n_relu" not in msg and "\n" not in msg
    assert not (tmp_path / "bad.so").exists()


def test_identical_programs_compiled_once(tmp_path: Path) -> None:
    m = conv_model()
    twin = onnx.ModelProto()
    twin.CopyFrom(m)
    twin.graph.name = "another_name"
    other = send_recv_programs()[0]
    facts = bt.build_all([m, twin, other, m], tmp_path, progress=False, jobs=1)
    assert [f["compiled"] for f in facts] == [True, False, True, False]
    assert facts[1]["same_as"] == 0 and facts[3]["same_as"] == 0
    assert sha256_file(tmp_path / "rank1.so") == sha256_file(tmp_path / "rank0.so") == facts[1]["sha256"]
    assert facts[2]["sha256"] != facts[0]["sha256"]


def test_builds_are_byte_reproducible(tmp_path: Path) -> None:
    m = send_recv_programs()[1]
    a = bt.build(m, tmp_path / "a" / "rank1.so")
    b = bt.build(m, tmp_path / "b" / "other.so")
    assert a["sha256"] == b["sha256"]
    assert a["reproducible"] is True


def test_detected_host_target_is_an_llvm_cpu_and_compiles(tmp_path: Path) -> None:
    from tvm.target import codegen

    t = detect_host_target()
    assert t["kind"] == "llvm" and t["mcpu"] not in ("native", "")
    assert codegen.llvm_is_valid_cpu(t["mcpu"], codegen.llvm_get_system_triple())
    m = conv_model()
    facts = bt.build(m, tmp_path / "t.so", target=t)
    assert facts["target"] == t
    x = np.ones((2, 3, 8, 8), np.float32)
    out = bt.load(m, tmp_path / "t.so").run({"x": x}, LocalWorld(1).communicator(0))
    np.testing.assert_allclose(out["logits"], ort_run(m, {"x": x})["logits"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("model_name", "flags", "vendor", "machine", "expected"),
    [
        ("AMD EPYC 9654", {"avx2", "avx512f", "avx512_bf16"}, "AuthenticAMD", "x86_64", "znver4"),
        ("AMD EPYC 7742", {"avx2", "fma"}, "AuthenticAMD", "x86_64", "znver2"),
        ("Intel Xeon Platinum 8480", {"avx2", "avx512f", "amx_tile"}, "GenuineIntel", "x86_64", "sapphirerapids"),
        ("Intel Xeon Gold 6148", {"avx2", "avx512f"}, "GenuineIntel", "x86_64", "skylake-avx512"),
        ("Intel Core i7-4770", {"avx2"}, "GenuineIntel", "x86_64", "haswell"),
        ("QEMU Virtual CPU", {"sse2"}, "GenuineIntel", "x86_64", "x86-64"),
        ("", {"asimd", "atomics"}, "", "aarch64", "neoverse-n1"),
        ("", {"fp"}, "", "aarch64", "generic"),
    ],
)
def test_cpuinfo_mapping(model_name, flags, vendor, machine, expected) -> None:
    assert cpu_from_cpuinfo(model_name, flags, vendor, machine) == expected


def test_target_specs() -> None:
    assert target_dict("znver4") == {"kind": "llvm", "mcpu": "znver4"}
    assert target_dict('{"kind": "llvm", "mcpu": "haswell"}') == {"kind": "llvm", "mcpu": "haswell"}
    assert target_dict(None) == target_dict("host") == detect_host_target()
    for bad in ("not-a-target", "{broken json", '{"mcpu": "x"}', '{"kind": "llvm", "mcpu": "native"}'):
        with pytest.raises(BackendError):
            target_dict(bad)
    if not bt.target.cuda_available():  # plain "cuda" takes its arch from a GPU; without one, name it
        with pytest.raises(BackendError, match="no arch given"):
            target_dict("cuda")


def test_progress_prints_lines_when_forced_on_non_tty() -> None:
    out = io.StringIO()
    bar = BuildProgress([0, 3], enabled=True, stream=out)
    bar.update(0, "import")
    bar.update(3, "build")
    bar.update(3, "build")  # repeated stage: no new line
    bar.update(0, "done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("rank0: [#####") and "import" in lines[0]
    assert lines[2].startswith("rank0: [" + "#" * 20 + "]") and "done" in lines[2]
    silent = io.StringIO()
    BuildProgress([0], stream=silent).update(0, "import")  # auto mode, not a TTY
    assert silent.getvalue() == ""


@pytest.mark.slow
def test_parallel_subprocess_build_matches_serial(tmp_path: Path) -> None:
    progs = send_recv_programs()
    serial = bt.build_all(progs, tmp_path / "serial", progress=False, jobs=1)
    parallel = bt.build_all(progs, tmp_path / "parallel", progress=False, jobs=2)
    assert [f["sha256"] for f in parallel] == [f["sha256"] for f in serial]
    res = ok(run_ranks(progs, [tmp_path / "parallel" / f["file"] for f in parallel], [{"x": X}, {"x": X}]))
    np.testing.assert_allclose(res[1]["out"], ort_run(send_recv_reference(), {"x": X})["out"], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_parallel_build_reports_a_failing_rank(tmp_path: Path) -> None:
    bad = model([helper.make_node("FancyOp", ["x"], ["y"], name="n_fancy")], "bad", [vi("x", [2])], [vi("y", [2])], comm=False)
    with pytest.raises(BackendError, match=r"n_fancy \(FancyOp\)"):
        bt.build_all([conv_model(), bad], tmp_path, progress=False, jobs=2)


@pytest.mark.slow
def test_small_resnet_compiles_quickly_and_matches_ort(tmp_path: Path) -> None:
    import models_zoo

    m = models_zoo.build("resnet", depth=18, image=32, width=16, classes=10)
    t0 = time.perf_counter()
    bt.build(m, tmp_path / "resnet.so")
    assert time.perf_counter() - t0 < 60
    name = m.graph.input[0].name
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = bt.load(m, tmp_path / "resnet.so").run({name: x}, LocalWorld(1).communicator(0))
    ref = ort_run(m, {name: x})
    for k, v in ref.items():
        np.testing.assert_allclose(out[k], v, rtol=RTOL, atol=ATOL)
