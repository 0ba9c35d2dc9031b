"""Which output each thread writes (backends/tvm/schedules/contraction.py, ``ROWS_OUTER_CONV`` /
``_parallel_order``).

TVM's pool splits a parallel loop statically (iterations ``[0, n/2)`` to the first thread on 2
threads). For a 3x3 conv whose weights fit ``ROWS_OUTER_WEIGHT_BYTES`` (ResNet-18's 64 -> 64 on
28x28 at batch 1), the first half of the parallel loop must write whole rows (the top half of the
map, every channel), the rows the next kernel's first thread reads; with the knob off it wrote one
channel tile of every row, so the test fails then. A 3x3 256 -> 256 conv (2.25 MiB of weights), an
RGB stem (3 input channels) and a batch of 2 keep channel tiles outermost. Every build matches ONNX
Runtime (``tvm_build_check.build_and_compare``: seeded input, rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from backends.tvm.schedules import contraction as C
from backends.tvm.schedules import threads
from backends.tvm.schedules.vector import vector_lanes
from backends.tvm.target import detect_host_target
from tvm_build_check import build_and_compare


def _conv(c: int, hw: int, batch: int = 1, ci: int | None = None) -> onnx.ModelProto:
    ci = ci or c
    rng = np.random.default_rng(c + hw + batch + ci)
    w = (rng.standard_normal((c, ci, 3, 3)) * np.sqrt(2.0 / (9 * ci))).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _first_half(mod: Any) -> tuple[set[int], set[int], int]:
    """(output rows, output channels, parallel extent) the first half of the conv's parallel loop
    writes: its update block's bindings of ``yy`` and ``ff`` evaluated for those iterations (the
    inner loops at 0, which only add offsets within a tile, except a serial channel-tile loop,
    which runs over its range)."""
    [src] = [f.script() for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint
             and not gv.name_hint.endswith("_weight_prepack")]
    var, ext = re.search(r"for (\w+) in T\.parallel\(T\.int64\((\d+)\)\)", src.split('sblock("conv2d_nhwc_init")')[0]
                         .split("pad_temp[v_i0")[-1]).groups()
    update = src.split('sblock("conv2d_nhwc_update")')[1]
    bind = {k: re.sub(r"T\.int64\((\d+)\)", r"\1", re.search(rf"v_{k} = T\.axis\.spatial\([^,]+, (.*)\)\n", update).group(1))
            for k in ("yy", "ff")}
    # a serial channel-tile loop inside the parallel one (SPLIT_PAD_BORDER: only (n, h) is fused)
    tiles = re.search(r"for ff_0 in range\(T\.int64\((\d+)\)\)", src)
    rows, chans = set(), set()
    for i in range(int(ext) // 2):
        for f0 in range(int(tiles.group(1)) if tiles else 1):
            env = {var: i, "ff_0": f0, "ff_1": 0, "ff_2": 0, "xx_0": 0, "xx_1": 0}
            rows.add(eval(bind["yy"], {}, env))  # noqa: S307 - an index expression of our own build
            chans.add(eval(bind["ff"], {}, env))  # noqa: S307
    return rows, chans, int(ext)


def _tile() -> int:
    """Output channels per channel tile on the host: 2 vectors (32 on AVX-512, 16 on AVX2)."""
    return 2 * vector_lanes(tvm.target.Target(detect_host_target()), 32)


@pytest.fixture
def parallel_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    threads.set_parallel_min_flops(0.0)
    yield
    threads.set_parallel_min_flops(None)


def test_first_thread_writes_the_top_rows(parallel_always: None) -> None:
    rows, chans, _ = _first_half(build_and_compare(_conv(64, 28)))
    assert rows == set(range(14)), f"first half of the parallel loop writes rows {sorted(rows)}"
    assert chans == set(range(0, 64, _tile())), f"... and channel tiles {sorted(chans)} (want every tile)"


def test_knob_off_splits_channels(parallel_always: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "ROWS_OUTER_CONV", False)
    rows, chans, _ = _first_half(build_and_compare(_conv(64, 28)))
    assert rows == set(range(28)) and chans == set(range(0, 32, _tile()))  # the first half of the tiles


def test_large_weights_keep_channel_tiles_outermost(parallel_always: None) -> None:
    assert 9 * 256 * 256 * 4 > C.ROWS_OUTER_WEIGHT_BYTES
    rows, chans, _ = _first_half(build_and_compare(_conv(256, 7)))
    # the first half writes the first half of the channels (AVX2's 7x7 tile has 1 vector: rule 1)
    assert rows == set(range(7)) and max(chans) < 128


def test_batch_two_keeps_channel_tiles_outermost(parallel_always: None) -> None:
    _, chans, _ = _first_half(build_and_compare(_conv(64, 12, batch=2)))
    assert chans == set(range(0, 32, _tile()))


def test_rgb_stem_keeps_channel_tiles_outermost(parallel_always: None) -> None:
    rows, chans, _ = _first_half(build_and_compare(_conv(64, 28, ci=3)))
    assert rows == set(range(28)), f"a stem's first half writes rows {sorted(rows)}"
