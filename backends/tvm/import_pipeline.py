"""The TVM backend's import pipeline: the one place a per-rank program is made ready for TVM's ONNX importer.

Rules:

1. :func:`prepare_for_import` takes the program as the compile driver serialised it (once, in
   ``core/programs.to_proto``), deserialises it once into onnx-ir, runs :func:`import_passes` on
   it with the pass manager (``passes.manager.PassManager``, no verification between these
   rewrites: the program was verified when it was lowered) and serialises it once. That protobuf
   is what the support check, the fallback's cut and ``from_onnx`` (through
   ``core/segments.split_program``) read.
2. The passes, in order: :class:`backends.tvm.expand_functions.ExpandForImport` (recurrent ops
   unrolled, function bodies of ops TVM lacks inlined, then folded), a lenient
   ``passes.shape_inference.ShapeInference`` (segments need typed boundaries; existing types,
   e.g. the comm outputs', stay), :class:`backends.tvm.resize_inputs.DropEmptyResizeInputs`, then
   every rewrite of :data:`backends.tvm.import_fixes.IMPORT_REWRITES` (rules 1-8 there).
3. After the serialisation, the op-form rewrites of :mod:`backends.tvm.form_rewrites` (Sinh/Cosh,
   IsInf, negative Squeeze axes, ConvTranspose ``output_shape``) run on the protobuf, then
   :mod:`backends.tvm.scatter_slices` (block-writing ``ScatterElements`` as Slice/Concat): the
   protobuf rewrites left on the way to ``from_onnx``, until those modules are ported to onnx-ir
   (they commute with rule 2's rewrites: neither touches an op the other emits).
4. The result depends only on the program and the installed TVM's convert map, so the builder
   (``lower.lower_program``), the support check (``lower.check_supported``) and the ONNX Runtime
   fallback (``fallback.needs_fallback``, ``fallback.ort_segments``) all see the same program.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import onnx_ir as ir

from .expand_functions import ExpandForImport, tvm_known_ops


def import_passes(known: Iterable[str] | None = None) -> list[ir.passes.PassBase]:
    """Rule 2: fresh instances of the import passes, in order (``known``: the op types TVM's
    importer converts; default :func:`backends.tvm.expand_functions.tvm_known_ops`)."""
    from passes.shape_inference import ShapeInference

    from .import_fixes import IMPORT_REWRITES
    from .resize_inputs import DropEmptyResizeInputs

    return [ExpandForImport(known), ShapeInference(strict=False), DropEmptyResizeInputs(),
            *(rewrite() for rewrite in IMPORT_REWRITES)]


def prepare_for_import(program: onnx.ModelProto, known: Iterable[str] | None = None) -> onnx.ModelProto:
    """Rules 1-3: ``program`` ready for TVM's ONNX importer (a new protobuf; ``program`` itself is
    not modified)."""
    from passes.manager import PassManager

    from .form_rewrites import rewrite_forms
    from .scatter_slices import scatter_slices_to_concat

    model = ir.serde.deserialize_model(program)
    PassManager(import_passes(tvm_known_ops() if known is None else known), verify=False)(model)
    return scatter_slices_to_concat(rewrite_forms(ir.serde.serialize_model(model)))


__all__ = ["import_passes", "prepare_for_import", "tvm_known_ops"]
