"""Weights as parameters of ``main``, not constants in ``rank<i>.so`` (docs/large_models.md).

Rules:
1. Which weights: every initializer that the program given to the build holds as an external
   reference without its bytes. The compile driver gives the build such programs exactly when
   the model was loaded with lazy external weights (an external-data model): every weight of
   at least 64 KiB is then a reference into ``rank<i>.data``. Any other program (weights in the
   protobuf, the usual small model) keeps its weights as constants, so its build (constant
   folding, prepacked GEMM weights of ``schedules/gemm_packed.py``) and its speed do not change.
2. How: before the import, such a weight becomes a typed graph input of the program
   (:func:`weights_as_inputs`); ``main`` takes it after the real inputs as a parameter named
   ``weight:<initializer name>``, so the library needs no side table: the runtime reads the
   names back from the VM (``get_function_param_name``).
3. At run time (:func:`bind_weights`) each parameter is the rank's ``rank<i>.data`` bytes: on the
   CPU a copy-on-write memory map handed to TVM through DLPack (no copy: a rank's resident memory
   is the pages its kernels touch); on a GPU one upload. A program loaded with its data (the
   in-process runner) gives the in-memory arrays instead.
4. What the library holds (:func:`library_constant_bytes`): the bytes of the distinct tensor
   constants of the built module's Relax functions, which the VM's constant pool embeds in
   ``rank<i>.so``. These are the weights as the build left them, not as the program gave them:
   a Winograd conv's transformed weights (4x a 3x3 conv's), packed panels, folded batch norms.
   The build records them (``constant_bytes``) so the runtime memory rule can price the built
   rank (``partitioner.cost.memory.with_library_constants``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from partitioner.core.errors import BackendError
from partitioner.core.mapped_weights import map_rank_weights

PREFIX = "weight:"


def param_weight_names(program: onnx.ModelProto) -> tuple[str, ...]:
    """Rule 1: the initializers that become parameters, in initializer order."""
    return tuple(t.name for t in program.graph.initializer
                 if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data)


def weights_as_inputs(program: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """Rule 2: a copy of ``program`` whose parameter weights are graph inputs (appended after the
    real inputs), and their names; ``program`` itself when it has none."""
    names = param_weight_names(program)
    if not names:
        return program, ()
    chosen = set(names)
    out = onnx.ModelProto()
    out.CopyFrom(program)
    weights = [t for t in out.graph.initializer if t.name in chosen]
    keep = [onnx.TensorProto() for _ in range(len(out.graph.initializer) - len(weights))]
    for dst, src in zip(keep, (t for t in out.graph.initializer if t.name not in chosen)):
        dst.CopyFrom(src)
    infos = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in weights]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    out.graph.input.extend(infos)
    return out, names


def library_constant_bytes(mod: Any) -> int:
    """Rule 4: bytes of the distinct tensor constants in the Relax functions of ``mod`` (the
    scheduled module just before the VM build). Checked against the built library's constant
    pool (``VMExecutable.stats()``): zoo ResNet-18 rank, 44.57 MiB direct, 150.90 MiB auto, equal
    to the pool's shapes at 4 bytes each."""
    import tvm
    from tvm import relax

    found: dict[int, Any] = {}

    def visit(e: Any) -> None:
        if isinstance(e, tvm.ir.GenericConst):
            found[e.value.__hash__()] = e.value

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return int(sum(int(np.prod([int(d) for d in v.shape], dtype=np.int64)) * np.dtype(str(v.dtype)).itemsize
                   for v in found.values()))


def main_weight_params(vm: Any) -> list[str]:
    """Rule 2: the weight names ``main`` of a loaded library takes, in parameter order."""
    names = [str(vm._get_function_param_name("main", i)) for i in range(int(vm._get_function_arity("main")))]
    return [n[len(PREFIX):] for n in names if n.startswith(PREFIX)]


def bind_weights(program: onnx.ModelProto, folder: Path, names: Sequence[str], device: Any) -> list[Any]:
    """Rule 3: one TVM tensor per weight parameter ``names`` of rank ``program``."""
    import tvm

    if not names:
        return []
    inits = {t.name: t for t in program.graph.initializer}
    missing = [n for n in names if n not in inits]
    if missing:
        raise BackendError(f"{folder}: the library takes weight {missing[0]!r}, which its program does not hold")
    on_cpu = device.dlpack_device_type() == 1
    lean = onnx.ModelProto()
    lean.graph.initializer.extend(inits[n] for n in names if inits[n].data_location == onnx.TensorProto.EXTERNAL
                                  and not inits[n].raw_data)
    mapped = map_rank_weights(lean, folder, mode="c" if on_cpu else "r")
    out = []
    for n in names:
        arr = mapped[n] if n in mapped else numpy_helper.to_array(inits[n])
        if on_cpu and isinstance(arr, np.memmap) and arr.size:
            out.append(tvm.runtime.from_dlpack(arr))  # zero-copy: TVM reads the mapped pages
        else:
            out.append(tvm.runtime.tensor(np.ascontiguousarray(arr), device))
    return out


__all__ = ["PREFIX", "bind_weights", "library_constant_bytes", "main_weight_params", "param_weight_names", "weights_as_inputs"]
