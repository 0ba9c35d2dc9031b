"""Every hostile input of the catalogue (hostile_testkit.CASES) is refused by the Python API with
a ModelLoadError whose one-line message names the problem; and the loader never opens a file
outside the model's folder. The same catalogue through the CLI is test_hostile_cli.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hostile_testkit import CASES, SECRET_TEXT, HostileCase, external_model, model_dir, outside_dir, save, w_bytes

from partitioner.core.errors import ModelLoadError
from partitioner.load import load

CASE_NAMES = sorted(CASES)


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 22


@pytest.fixture(params=CASE_NAMES)
def hostile(request, tmp_path: Path) -> HostileCase:
    return CASES[request.param](tmp_path)


def test_api_refuses(hostile: HostileCase) -> None:
    with pytest.raises(ModelLoadError) as info:
        load(str(hostile.path), batch=hostile.batch, shapes=hostile.shapes)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for part in hostile.expect:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_sparse_2gb_file_is_not_read(tmp_path: Path) -> None:
    """The > 2 GB model is refused from its size alone: the loader's process never grows."""
    import resource

    case = CASES["file_over_2gb"](tmp_path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError, match="over protobuf's 2 GB limit"):
        load(str(case.path))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


# never opens a file outside the model's folder ---------------------------------------------

_AUDIT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import partitioner.core.segments, models_zoo, onnx, onnx_ir, networkx  # import first
    from partitioner.core.errors import ModelLoadError
    from partitioner.load import load
    opened = []
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)
    try:
        load(sys.argv[1])
        outcome = "loaded"
    except ModelLoadError as exc:
        outcome = "refused: " + str(exc)
    sys.stdout.write(json.dumps({"outcome": outcome, "opened": opened}))
    """
)

TRAVERSAL_CASES = ["ext_dotdot", "ext_dotdot_inner", "ext_absolute", "ext_symlink_file", "ext_symlink_folder"]


def _opened_by_loader(model: Path, tmp_path: Path) -> tuple[str, list[str]]:
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _AUDIT_SCRIPT, str(model)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    return data["outcome"], data["opened"]


def _allowed(path: Path, folder: Path) -> bool:
    """Inside the model's folder, or part of the Python installation (stdlib, site-packages)."""
    installs = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    repo = Path(__file__).resolve().parents[2]
    roots = [folder.resolve(), *installs, repo / "partitioner", repo / "models_zoo"]
    return any(path.resolve().is_relative_to(r) for r in roots)


@pytest.mark.parametrize("name", TRAVERSAL_CASES)
def test_never_opens_outside_the_folder(name: str, tmp_path: Path) -> None:
    case = CASES[name](tmp_path)
    secret = (tmp_path / "outside" / "secret.bin").resolve()
    assert secret.read_bytes().startswith(SECRET_TEXT)
    outcome, opened = _opened_by_loader(case.path, tmp_path)
    assert outcome.startswith("refused: "), outcome
    assert all(part in outcome for part in case.expect), outcome
    resolved = [Path(p) if Path(p).is_absolute() else tmp_path / p for p in opened]
    assert secret not in {p.resolve() for p in resolved}, opened
    outside = [str(p) for p in resolved if not _allowed(p, case.path.parent)]
    assert not outside, f"opened outside the model's folder: {outside}"


def test_audit_hook_sees_reads_in_the_folder(tmp_path: Path) -> None:
    """The audit harness must be able to fail: a valid model's external data file is opened."""
    d = model_dir(tmp_path)
    outside_dir(tmp_path)
    (d / "w.bin").write_bytes(w_bytes())
    path = save(external_model("w.bin", offset=0, length=48), d / "m.onnx")
    outcome, opened = _opened_by_loader(path, tmp_path)
    assert outcome == "loaded"
    assert (d / "w.bin").resolve() in {Path(p).resolve() for p in opened}
    assert all(_allowed(Path(p), d) for p in opened)
