"""The artifact directory: round trip, tamper detection, relocation, reproducibility, bad inputs.

These tests need no MPI: runs go through the in-process runtime (threads), and `run` refuses bad
artifacts and bad inputs before it would start mpiexec. Numbers are checked against ONNX Runtime
on the unpartitioned source model (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).parent / "runtime"))
import rank_programs as rp  # noqa: E402

from partitioner import cli  # noqa: E402
from partitioner.artifact import FORMAT_VERSION, manifest_checksum, verify_artifact  # noqa: E402
from partitioner.compiler import build_artifact, load_artifact  # noqa: E402
from partitioner.core.errors import ArtifactError, InputError  # noqa: E402


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.fixture
def tp_artifact(tmp_path: Path):
    src, progs, bind = rp.tensor_parallel()
    return build_artifact(tmp_path / "art", progs, bind, source=src, backend="onnxruntime",
                          plan={"strategy": "tensor", "world_size": 2}), src, progs


def _cli(*argv: str) -> int:
    return cli.main([*argv])


def test_round_trip(tp_artifact, tmp_path):
    art, src, progs = tp_artifact
    names = sorted(p.name for p in art.root.iterdir())
    assert names == ["manifest.json", "plan.json", "rank0.onnx", "rank1.onnx", "source.onnx"]
    loaded = load_artifact(art.root)
    assert loaded.world_size == 2 and loaded.backend == "onnxruntime" and loaded.microbatches == 1
    assert [p.SerializeToString() for p in loaded.programs] == [p.SerializeToString() for p in progs]
    assert loaded.source.SerializeToString() == src.SerializeToString()
    assert loaded.plan == {"strategy": "tensor", "world_size": 2}
    m = loaded.manifest
    assert m["format_version"] == FORMAT_VERSION and m["comm_groups"] == [[0, 1]]
    assert set(m["toolchain"]) >= {"partitioner", "onnx", "onnxruntime", "tvm", "numpy", "mpi4py", "python"}
    assert m["nondeterministic_files"] == []
    copy = loaded.save(tmp_path / "copy")
    assert verify_artifact(copy.root)["manifest_sha256"] == m["manifest_sha256"]


def test_in_process_run_matches_onnxruntime(tp_artifact):
    art, src, _ = tp_artifact
    feeds = rp.inputs()
    result = art.run(feeds, in_process=True, check=True)
    want = _ort(src, feeds)
    for name in ("y", "h"):
        np.testing.assert_allclose(result.outputs[name], want[name], rtol=1e-4, atol=1e-5)
    assert result.check.ok


def test_relocatable(tp_artifact, tmp_path):
    art, src, _ = tp_artifact
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(art.root, moved)
    shutil.rmtree(art.root)
    text = (moved / "manifest.json").read_text()
    assert str(tmp_path) not in text and "/tmp" not in text
    feeds = rp.inputs()
    out = load_artifact(moved).run(feeds, in_process=True).outputs
    np.testing.assert_allclose(out["y"], _ort(src, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_reproducible_hashes(tmp_path):
    digests = []
    for d in ("a", "b"):
        src, progs, bind = rp.pipeline(microbatches=2)
        art = build_artifact(tmp_path / d, progs, bind, source=src, backend="onnxruntime")
        digests.append({n: p.read_bytes() for n, p in art.files.items()})
    assert digests[0].keys() == digests[1].keys()
    for name in digests[0]:
        assert digests[0][name] == digests[1][name], name


def _flip_byte(path: Path, at: int = 40) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(root: Path, fn, *, fix_checksum: bool) -> None:
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    if fix_checksum:
        m["manifest_sha256"] = manifest_checksum(m)
    (root / "manifest.json").write_text(json.dumps(m))


TAMPERING = {
    "flipped byte in rank1.onnx": (lambda r: _flip_byte(r / "rank1.onnx"), "rank1.onnx"),
    "deleted plan.json": (lambda r: (r / "plan.json").unlink(), "plan.json"),
    "missing rank file": (lambda r: (r / "rank0.onnx").unlink(), "rank0.onnx"),
    "edited manifest": (lambda r: _edit_manifest(r, lambda m: m.update(world_size=3), fix_checksum=False),
                        "manifest.json"),
    "manifest hash of a file rewritten": (
        lambda r: _edit_manifest(r, lambda m: m["files"]["plan.json"].update(sha256="0" * 64), fix_checksum=True),
        "plan.json"),
    "wrong rank count": (lambda r: _edit_manifest(r, lambda m: m.update(world_size=3), fix_checksum=True),
                         "manifest.json"),
    "extra rank file": (lambda r: shutil.copyfile(r / "rank1.onnx", r / "rank2.onnx"), "rank2.onnx"),
    "deleted manifest": (lambda r: (r / "manifest.json").unlink(), "manifest.json"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampering_is_refused(case, tp_artifact, tmp_path, capsys):
    art, _, _ = tp_artifact
    damage, culprit = TAMPERING[case]
    damage(art.root)
    with pytest.raises(ArtifactError, match=culprit.replace(".", r"\.")):
        verify_artifact(art.root)
    with pytest.raises(ArtifactError):
        load_artifact(art.root)
    np.savez(tmp_path / "in.npz", **rp.inputs())
    capsys.readouterr()
    assert _cli("verify", str(art.root)) == 2
    assert culprit in capsys.readouterr().err
    assert _cli("run", str(art.root), "--inputs", str(tmp_path / "in.npz")) == 2
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, FORMAT_VERSION - 1])
def test_other_format_version_is_refused(version, tp_artifact):
    art, _, _ = tp_artifact
    _edit_manifest(art.root, lambda m: m.update(format_version=version), fix_checksum=True)
    with pytest.raises(ArtifactError, match=f"artifact format {version} is not supported by this partitioner "
                                            f"\\(supports {FORMAT_VERSION}\\)"):
        verify_artifact(art.root)


def test_path_names_inside_manifest_must_be_plain(tp_artifact):
    art, _, _ = tp_artifact
    _edit_manifest(art.root, lambda m: m["files"].update({"../escape": {"sha256": "0", "size": 0}}),
                   fix_checksum=True)
    with pytest.raises(ArtifactError, match="escape"):
        verify_artifact(art.root)


def test_verify_cli_ok(tp_artifact, capsys):
    art, _, _ = tp_artifact
    assert _cli("verify", str(art.root), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["world_size"] == 2


BAD_INPUTS = {
    "missing": ({}, "x"),
    "unknown": ({"x": rp.inputs()["x"], "zz": np.zeros(2, np.float32)}, "zz"),
    "shape": ({"x": np.zeros((3, rp.D_IN), np.float32)}, "x"),
    "dtype": ({"x": np.zeros((rp.B, rp.D_IN), np.float64)}, "x"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_exit_2_naming_the_input(case, tp_artifact, tmp_path, capsys):
    art, _, _ = tp_artifact
    feeds, name = BAD_INPUTS[case]
    np.savez(tmp_path / "in.npz", **feeds)
    with pytest.raises(InputError, match=f"'{name}'|{name}"):
        art.run(dict(feeds), in_process=True)
    capsys.readouterr()
    assert _cli("run", str(art.root), "--inputs", str(tmp_path / "in.npz")) == 2
    assert name in capsys.readouterr().err


def test_inputs_not_an_npz(tp_artifact, tmp_path, capsys):
    art, _, _ = tp_artifact
    (tmp_path / "bad.npz").write_text("not numpy")
    np.save(tmp_path / "one.npy", np.zeros(3))
    for path in (tmp_path / "bad.npz", tmp_path / "one.npy", tmp_path / "absent.npz"):
        capsys.readouterr()
        assert _cli("run", str(art.root), "--inputs", str(path)) == 2
        assert path.name in capsys.readouterr().err


def test_pickled_inputs_are_refused(tp_artifact, tmp_path, capsys):
    art, _, _ = tp_artifact
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))
    assert _cli("run", str(art.root), "--inputs", str(tmp_path / "obj.npz")) == 2
    assert "obj.npz" in capsys.readouterr().err


def test_microbatches_fixed_at_compile_time(tp_artifact, tmp_path, capsys):
    art, _, _ = tp_artifact
    np.savez(tmp_path / "in.npz", **rp.inputs())
    assert _cli("run", str(art.root), "--inputs", str(tmp_path / "in.npz"), "--microbatches", "4") == 2
    assert "recompile" in capsys.readouterr().err


def test_check_fails_on_mismatch(tmp_path, capsys):
    """A deliberately wrong split (rank 1 uses the wrong weight half) must fail --check with exit 1."""
    src, progs, bind = rp.tensor_parallel()
    bad = onnx.ModelProto()
    bad.CopyFrom(progs[1])
    w = onnx.numpy_helper.to_array(bad.graph.initializer[0]) * 1.01
    bad.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w.astype(np.float32), bad.graph.initializer[0].name))
    art = build_artifact(tmp_path / "bad", [progs[0], bad], bind, source=src, backend="onnxruntime")
    np.savez(tmp_path / "in.npz", **rp.inputs())
    assert _cli("run", str(art.root), "--inputs", str(tmp_path / "in.npz"), "--check", "--in-process") == 1
    assert "differ from ONNX Runtime" in capsys.readouterr().err
