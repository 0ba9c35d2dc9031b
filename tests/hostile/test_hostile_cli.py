"""Every hostile input of the catalogue (hostile_testkit.CASES) through the CLI,
``python -m partitioner.cli inspect PATH`` in a subprocess.

Each must: exit 2; write exactly one stderr line ``partitioner: error: ...`` that contains the
case's expected strings (the file/tensor/node and the problem); show no traceback; use under
10 s of CPU (its own rusage: wall time on a shared machine measures the other processes; a child
that blocks is killed at hostile_testkit.CLI_TIMEOUT_S of wall time and fails); and stay bounded
in memory (a 4 GiB address-space limit, and a peak RSS under 1 GiB read from the child's own
rusage).

The subprocesses are started two at a time by a module fixture (each takes about a second, most
of it importing onnx-ir); each case is still its own test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostile_testkit import CASES, CLI_CPU_LIMIT_S, CliResult, HostileCase, run_cli

MAX_CHILD_RSS = 1 * 2**30
CASE_NAMES = sorted(CASES)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[HostileCase, CliResult | Exception]]:
    cases = {name: CASES[name](tmp_path_factory.mktemp(name)) for name in CASE_NAMES}

    def one(case: HostileCase) -> CliResult | Exception:
        try:
            return run_cli(["inspect", str(case.path), *case.cli_args], cwd=case.path.parent)
        except Exception as exc:  # a timeout is reported by the case's own test
            return exc

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cases, pool.map(one, cases.values())))
    return {name: (cases[name], results[name]) for name in CASE_NAMES}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_cli_refuses(name: str, cli_results) -> None:
    case, res = cli_results[name]
    if isinstance(res, Exception):
        raise res
    lines = res.stderr.splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("partitioner: error: ")
    assert "Traceback" not in res.stderr
    for part in case.expect:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    assert res.cpu_seconds < CLI_CPU_LIMIT_S, f"{res.cpu_seconds:.1f} s of CPU ({res.seconds:.1f} s wall)"
    assert res.max_rss_bytes < MAX_CHILD_RSS, f"peak RSS {res.max_rss_bytes / 2**20:.0f} MiB"


def test_cli_debug_shows_traceback(tmp_path: Path) -> None:
    """--debug is the one way to get a traceback; the exit code stays 2."""
    case = CASES["cycle"](tmp_path)
    res = run_cli(["inspect", "--debug", str(case.path)], cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" in res.stderr and "the graph has a cycle" in res.stderr


def test_cli_harness_reports_success_and_memory(tmp_path: Path) -> None:
    """The harness must be able to fail: a valid model exits 0 with no stderr and a real RSS."""
    res = run_cli(["inspect", "mlp"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert 20 * 2**20 < res.max_rss_bytes < MAX_CHILD_RSS
    # importing the CLI alone takes a fraction of a second of CPU; zero would mean the child's
    # rusage was not read, and the CPU limit of every case would pass unchecked
    assert 0.05 < res.cpu_seconds < CLI_CPU_LIMIT_S, res.cpu_seconds


def test_cli_harness_kills_at_the_wall_clock_limit(tmp_path: Path) -> None:
    """The wall-clock kill works: a call given less time than importing the CLI takes is killed
    and reported, not waited for."""
    with pytest.raises(TimeoutError, match="ran past"):
        run_cli(["inspect", "mlp"], cwd=tmp_path, timeout=0.05)
