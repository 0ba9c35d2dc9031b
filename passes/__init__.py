"""Graph passes on the IR and the pass manager that verifies between them.

Public API:

- :class:`PassManager` runs passes in order and :func:`verify` after each one.
- :func:`verify` checks the graph invariants (SSA, order, use-def, shapes).
- :data:`REGISTRY` / :func:`get_pass`: pass classes by name, for ``--passes a,b,c``.
- :data:`DEFAULT_PIPELINE` and :func:`run_pipeline`, which the CLI calls.
"""

from __future__ import annotations

import onnx_ir as ir

# Importing the pass modules registers them (each one applies @register).
from passes import (  # noqa: F401
    common_subexpression_elimination,
    constant_folding,
    dead_code_elimination,
    expand_recurrent,
    fold_constant_if,
    fold_conv_batchnorm,
    fold_shape_subgraphs,
    fuse_bias_activation,
    group_elementwise,
    identity_elimination,
    layout_nhwc,
    recognize_gelu,
    recognize_layernorm,
    shape_inference,
    topological_sort,
    unroll_loop,
)
from passes.manager import PassManager
from passes.registry import REGISTRY, get_pass, register
from passes.side_effects import COMM_DOMAIN, COMM_OP_TYPES, is_side_effecting
from passes.verify import verify

__all__ = [
    "COMM_DOMAIN",
    "COMM_OP_TYPES",
    "DEFAULT_PIPELINE",
    "OPTIMIZE_PIPELINE",
    "PassManager",
    "REGISTRY",
    "get_pass",
    "is_side_effecting",
    "register",
    "run_pipeline",
    "verify",
]

DEFAULT_PIPELINE: tuple[str, ...] = (
    "shape_inference",
    "constant_folding",
    "fold_shape_subgraphs",  # inference + folding + constant If to a fixed point; names what stays dynamic
    "dead_code_elimination",
    "identity_elimination",
    "common_subexpression_elimination",
    "dead_code_elimination",
    "shape_inference",
)

# DEFAULT_PIPELINE's clean-up, then rewrites (folding, recognition, transpose sinking), then the
# annotation passes last: a rewrite that rebuilds a node would drop its fusion-group annotation.
OPTIMIZE_PIPELINE: tuple[str, ...] = (
    *DEFAULT_PIPELINE,
    "expand_recurrent",  # LSTM/GRU/RNN unrolled: strategies then see (and cut) plain MatMuls
    "fold_conv_batchnorm",
    "recognize_layernorm",
    "layout_nhwc",
    "recognize_gelu",
    "dead_code_elimination",
    "shape_inference",
    "fuse_bias_activation",
    "group_elementwise",
    "dead_code_elimination",
    "shape_inference",
)


def run_pipeline(model: ir.Model, names: list[str] | None = None, *, verify: bool = True) -> ir.Model:
    """Run the named passes (``None``: :data:`DEFAULT_PIPELINE`) on ``model`` and return the result.

    With ``names == []`` no pass runs, but the model is still verified (structure only: no pass
    inferred shapes). The names ``default`` and ``optimize`` stand for :data:`DEFAULT_PIPELINE`
    and :data:`OPTIMIZE_PIPELINE` (so ``--passes optimize`` works). Unknown names raise
    UsageError before any pass runs; a failing pass raises PassError naming it and the passes
    before it.
    """
    aliases = {"default": DEFAULT_PIPELINE, "optimize": OPTIMIZE_PIPELINE}
    selected = [p for name in (["default"] if names is None else names) for p in aliases.get(name, (name,))]
    manager = PassManager([get_pass(name)() for name in selected], verify=verify)
    if not selected and verify:
        from passes.verify import verify as verify_model

        verify_model(model, require_shapes=False)
    return manager(model).model
