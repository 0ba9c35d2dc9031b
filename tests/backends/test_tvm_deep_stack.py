"""``backends.tvm.deep_stack``: the TVM build runs on a thread with a large stack (SLANet's unrolled
decoder overflowed the main thread's 8 MiB inside TVM's FuseOps: SIGSEGV)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# C recursion deep enough to overflow an 8 MiB stack: json's decoder recurses in C per nesting
# level (the Python recursion limit is raised so it is the stack that decides).
DEEP = textwrap.dedent("""
    import json, sys
    sys.setrecursionlimit(10**7)
    from backends.tvm import deep_stack
    depth = 400_000
    text = "[" * depth + "]" * depth
    call = {call}
    value = call(json.loads, text)
    print("ok", isinstance(value, list))
""")


def _run(call: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DEEP.format(call=call)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_deep_recursion_overflows_the_main_thread_but_not_the_build_thread():
    main = _run("lambda f, *a: f(*a)")
    assert main.returncode != 0  # the check is meaningful: this depth overflows 8 MiB
    deep = _run("deep_stack.run")
    assert deep.returncode == 0 and deep.stdout.strip() == "ok True", deep.stderr[-500:]


def test_run_returns_and_raises_like_a_call():
    from backends.tvm import deep_stack

    assert deep_stack.run(lambda a, b=1: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="boom"):
        deep_stack.run(lambda: (_ for _ in ()).throw(ValueError("boom")))


def test_build_one_runs_on_the_deep_stack(monkeypatch, tmp_path):
    import importlib

    from backends.tvm import deep_stack

    build = importlib.import_module("backends.tvm.build")  # the package's ``build`` name is the function

    calls = []
    monkeypatch.setattr(deep_stack, "run", lambda fn, *a, **k: calls.append(fn) or {"built": True})
    assert build.build_one(None, tmp_path / "r.so", {"kind": "llvm"}) == {"built": True}
    assert calls == [build._build_one]
