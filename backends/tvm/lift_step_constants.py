"""Weight-only kernels of a program called many times with the same weights, run once per change.

A pipeline stage calls its per-micro-batch programs ``M`` times a step with the same weights
(``partitioner.training.pipeline`` rule 4; ``hoist.py`` rule 7 marks them). Inside TVM, a
weight given as a program input (not a constant) still goes through weight-only kernels on every
call that no ONNX-level hoist can reach: the convolution schedule's panel packing
(``schedules/contraction._pack_conv_weights``, split into its own ``*_weight_prepack`` kernel),
and the HWIO transposes ConvertLayout adds around a weight. Measured before this module (the zoo
resnet-18 pipeline at 64x64, batch 16, 1F1B x8, micro-batches of 2 images, last stage): 52 of
192 ms of kernels per step re-packing conv weights.

Rules:

0. Before anything else, on every program: a conv weight's per-call layout transpose and its
   panel pack become one pass (:mod:`backends.tvm.fold_weight_packs`); a step constant's folded
   pack is then lifted by rule 2 like the pack it replaces.
1. Which programs: those whose ONNX program names its *step constants* in ``metadata_props``
   under :data:`STEP_CONSTANTS_KEY` (comma-separated input names), where they are exactly the
   trailing graph inputs, the program has no comm op, and ``main`` takes exactly the graph
   inputs (no weight parameters of ``weight_params.py``). Any other program builds as before.
2. How (:func:`lift`, after the scheduled pipeline, so that the packs exist as calls): the
   segment function is inlined into ``main`` (``InlinePrivateFunctions``), ``main`` gets
   ``num_input`` = the number of the other inputs, and TVM's ``LiftTransformParams`` moves every
   binding computed from step constants alone into ``main_transform_params`` (:data:`TRANSFORM`),
   which takes the step constants and returns what ``main`` now takes in their place. Then
   ``ConvertToDataflow`` + ``CanonicalizeBindings`` put the returned tuple back into the dataflow
   block (else every returned reshape stays a copy: see the code).
3. At run time (``executable.py`` rule 8) the executable calls ``main_transform_params`` when a
   step-constant input buffer was refilled (a new weight, or a caller that does not reuse
   read-only inputs), keeps its results, and calls ``main`` with them.

Cost: the lifted values (a packed copy of each conv weight) stay alive in the executable between
calls: about one weight-sized buffer per lifted weight per program. Invariant: the same kernels
compute the same values (bit for bit); only how often the weight-only ones run changes.
"""

from __future__ import annotations

import os
from typing import Any

import onnx

STEP_CONSTANTS_KEY = "partitioner.step_constant_inputs"
#: :func:`keep_step_constants_last` on (off, also by the environment's
#: ``PARTITIONER_TVM_KEEP_STEP_CONSTANTS_LAST=0``: a rewrite's appended inputs stay after the step
#: constants, and rule 1 then lifts nothing in that program)
KEEP_LAST = os.environ.get("PARTITIONER_TVM_KEEP_STEP_CONSTANTS_LAST", "1") != "0"
TRANSFORM = "main_transform_params"


def step_constant_inputs(program: onnx.ModelProto) -> tuple[str, ...]:
    """Rule 1: the program's step-constant inputs (trailing graph inputs), or ``()``."""
    marked = next((p.value for p in program.metadata_props if p.key == STEP_CONSTANTS_KEY), "")
    names = tuple(n for n in marked.split(",") if n)
    inits = {t.name for t in program.graph.initializer}
    inputs = [v.name for v in program.graph.input if v.name not in inits]
    if not names or len(names) >= len(inputs) or tuple(inputs[-len(names):]) != names:
        return ()
    return names


def marked_step_constants(program: onnx.ModelProto) -> list[str]:
    """The names marked under :data:`STEP_CONSTANTS_KEY`, whether or not they are still the trailing
    inputs rule 1 wants (a rewrite that appends an input after them breaks the order)."""
    marked = next((p.value for p in program.metadata_props if p.key == STEP_CONSTANTS_KEY), "")
    return [n for n in marked.split(",") if n]


def keep_step_constants_last(program: onnx.ModelProto) -> None:
    """Rule 1, for a rewrite that added inputs to a program with step constants: the marked names
    moved back to the end of its inputs (in place; nothing when none are marked). Without it, rule 1
    finds no trailing step constants and the build lifts nothing: the zoo mlp's first 1F1B stage's
    ``B`` repacked its weight on every micro-batch once ``moved_wgrad`` appended its seed input."""
    names = [n for n in marked_step_constants(program) if n in {v.name for v in program.graph.input}]
    if names and KEEP_LAST:
        mark_step_constants(program, names)


def mark_step_constants(program: onnx.ModelProto, names: list[str]) -> None:
    """Rule 1, for a caller: move ``names`` (inputs of ``program``) to the end of its inputs and
    name them under :data:`STEP_CONSTANTS_KEY` (in place)."""
    chosen = set(names)
    if not chosen:
        return
    inputs = list(program.graph.input)
    ordered = [v for v in inputs if v.name not in chosen] + [v for v in inputs if v.name in chosen]
    del program.graph.input[:]
    program.graph.input.extend(ordered)
    entry = next((p for p in program.metadata_props if p.key == STEP_CONSTANTS_KEY), None)
    if entry is None:
        entry = program.metadata_props.add()
        entry.key = STEP_CONSTANTS_KEY
    entry.value = ",".join(v.name for v in ordered if v.name in chosen)


def lift(mod: Any, program: onnx.ModelProto, comm_ops: int) -> Any:
    """Rules 0 and 2: ``mod`` (after the pipeline) with its weights' transposed packs folded and the
    step constants' transforms lifted into :data:`TRANSFORM` (rule 2 only where rule 1 applies)."""
    from tvm import relax

    from .fold_weight_packs import fold_transposed_packs

    mod = fold_transposed_packs(mod)  # rule 0: a weight's transpose and pack as one pass
    names = step_constant_inputs(program)
    inits = {t.name for t in program.graph.initializer}
    inputs = [v.name for v in program.graph.input if v.name not in inits]
    if not names or comm_ops or len(mod["main"].params) != len(inputs):
        return mod
    mod = relax.transform.InlinePrivateFunctions()(relax.transform.RewriteDataflowReshape()(mod))
    mod["main"] = mod["main"].with_attr("num_input", len(inputs) - len(names))
    mod = relax.transform.LiftTransformParams()(mod)
    # the returned values leave the dataflow block one by one after the inlining and the lift, and
    # tvm.compile's RewriteDataflowReshape skips a reshape whose result leaves its block: it stays
    # a copy (measured: the resnet's last stage's weight-gradient reshapes, 13 ms a call). Build
    # the returned tuple inside the block again, so only the tuple leaves it.
    return relax.transform.CanonicalizeBindings()(relax.transform.ConvertToDataflow()(mod))


__all__ = ["STEP_CONSTANTS_KEY", "TRANSFORM", "keep_step_constants_last", "lift", "mark_step_constants",
           "marked_step_constants", "step_constant_inputs"]
