"""``benchmarks/pipeline_runner_profile.py --compare``'s helpers (session 16): kernels named by
program and symbol, summed by class, by name stem and by conv layer (batch apart), and the
libraries found in each kind of runner executable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.bench_scripts import load

prof = load("pipeline_runner_profile")


def test_class_and_stem_ignore_program_and_numbers() -> None:
    """``F:conv2d4_prepacked`` and ``seg0:conv2d1_prepacked`` are the same kind of kernel; a
    builtin keeps its name; the class comes from the name."""
    assert prof.name_stem("F:conv2d4_prepacked") == prof.name_stem("seg0:conv2d1_prepacked") == "conv2d_prepacked"
    assert prof.name_stem("B:fused_conv2d3_add_relu2") == "fused_conv2d_add_relu"
    assert prof.name_stem("vm.builtin.alloc_tensor") == "vm.builtin.alloc_tensor"
    assert [prof.name_class(s) for s in ("B:fused_seg0_pad1_strided_slice28_concatenate_transpose", "F:transpose19",
                                         "seg0:matmul4_prepacked", "FB:conv2d3_prepacked", "vm.builtin.null_value",
                                         "P:max_pool2d", "U:fused_multiply_subtract")] == \
        ["layout", "layout", "gemm", "conv", "builtins", "pool", "other"]


def test_tvm_exes_names_each_library_by_program() -> None:
    """A pipeline runner's programs by kind, a bucketed executable's segments by index (a
    non-segment step skipped), a plain executable as ``main``."""
    lib = lambda: SimpleNamespace(_vm=object())  # noqa: E731
    f, b = lib(), lib()
    assert prof._tvm_exes({"F": f, "B": b}) == [("F", f), ("B", b)]
    s0, s2 = lib(), lib()
    bucketed = SimpleNamespace(steps=[(0, s0), (1, None), (2, s2)])
    assert prof._tvm_exes(bucketed) == [("seg0", s0), ("seg2", s2)]
    one = lib()
    assert prof._tvm_exes(one) == [("main", one)]


class _VM:
    def __init__(self) -> None:
        self.fn = None

    def set_instrument(self, fn) -> None:
        self.fn = fn


def test_hook_keys_kernels_by_program_and_records_shapes() -> None:
    """The same symbol in two programs is two kernels; builtins are summed across programs;
    the first call's argument shapes are kept; off removes the instrument."""
    vms = {"F": _VM(), "B": _VM()}
    runner = SimpleNamespace(_exe={k: SimpleNamespace(_vm=v) for k, v in vms.items()})
    hook = prof._KernelHook(runner)
    hook.on(True)
    arg = SimpleNamespace(shape=(2, 16, 16, 64))
    for prog in ("F", "B", "F"):
        vms[prog].fn(None, "conv2d1_prepacked", True, None, arg)
        vms[prog].fn(None, "conv2d1_prepacked", False, None, arg)
        vms[prog].fn(None, "vm.builtin.alloc_tensor", True, None)
        vms[prog].fn(None, "vm.builtin.alloc_tensor", False, None)
    assert dict(hook.calls) == {"F:conv2d1_prepacked": 2, "B:conv2d1_prepacked": 1, "vm.builtin.alloc_tensor": 3}
    assert hook.shapes == {"F:conv2d1_prepacked": "2x16x16x64", "B:conv2d1_prepacked": "2x16x16x64"}
    hook.on(False)
    assert all(v.fn is None for v in vms.values())


def _doc() -> dict:
    rec = lambda ms, calls, sym, shapes: {"ms": ms, "calls": calls, "class": prof.name_class(sym),  # noqa: E731
                                          "stem": prof.name_stem(sym), "shapes": shapes}
    return {"model": "resnet", "cut": "c", "stage0_last_weight": "w", "steps": 3, "load_before": [1.0],
            "load_after": [1.0], "step_plain": {"stage 0": 0.2, "stage 1": 0.2, "1 rank": 0.3},
            "step_hooked": {"stage 0": 0.25, "stage 1": 0.25, "1 rank": 0.35},
            "symbols": {
                "stage 0": {"F:conv2d1_prepacked": rec(58.4, 32, "F:conv2d1_prepacked", "2x16x16x64 2x3x3x64x32 2x16x16x64"),
                            "F:transpose20": rec(5.8, 136, "F:transpose20", "2x16x16x64 2x64x16x16")},
                "stage 1": {"FB:conv2d1_prepacked": rec(10.0, 8, "FB:conv2d1_prepacked", "2x2x2x512 8x3x3x512x64 2x2x2x512")},
                "1 rank": {"seg0:conv2d1_prepacked": rec(43.5, 4, "seg0:conv2d1_prepacked",
                                                          "16x16x16x64 1x3x3x64x64 16x16x16x64"),
                           "seg0:transpose62": rec(2.7, 8, "seg0:transpose62", "16x16x16x64 16x64x16x16")}}}


def test_sums_by_class_stem_and_conv_layer() -> None:
    """S is the stages' sum; a conv layer's key drops the batch and keeps the packed weight, and
    counts the images it ran over (calls x batch)."""
    doc = _doc()
    cls = prof._sum_by(doc, "class")
    assert cls["conv"]["S"] == pytest.approx(68.4) and cls["conv"]["1 rank"] == pytest.approx(43.5)
    assert cls["layout"]["stage 0 calls"] == 136 and cls["layout"]["1 rank calls"] == 8
    stems = prof._sum_by(doc, "stem")
    assert stems["conv2d_prepacked"]["S"] == pytest.approx(68.4)
    convs = prof.conv_layers(doc)
    a, b = convs["16x16x64 -> 16x16x64 w 2x3x3x64x32"], convs["16x16x64 -> 16x16x64 w 1x3x3x64x64"]
    assert a["S"] == pytest.approx(58.4) and a["S images"] == 64 and "1 rank" not in a
    assert b["1 rank"] == pytest.approx(43.5) and b["1 rank images"] == 64
    assert "transpose" not in " ".join(convs)


def test_report_prints_the_ratio_and_largest_difference_first(capsys) -> None:
    prof.report_compare(_doc(), 5)
    out = capsys.readouterr().out
    assert "S 400.0 = 1.33x the 1-rank step" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("conv ", "layout "))]
    assert lines[0].split()[0] == "conv" and lines[0].split()[-1] == "1.57"
