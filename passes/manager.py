"""The pass manager: run passes in order and verify the graph after each one.

Rules:

1. Passes run in the order given; each gets the model the previous one returned.
2. With ``verify=True``, :func:`passes.verify.verify` runs after every pass. Static shapes are
   required from the *last* pass that provides them (``provides_shapes = True``, i.e.
   ``shape_inference``) onwards, unless ``require_shapes`` says otherwise: an early inference may
   leave shapes that only constant folding makes static (Expand, Range, Reshape of computed
   shapes), and the final inference must then see them all.
3. Any failure, in a pass or in the verification after it, raises one
   :class:`partitioner.core.errors.PassError` naming the failing pass and the passes that ran before
   it: ``pass 'constant_folding' failed (after: shape_inference): <reason>``.

Invariant: the model a PassManager returns verifies (when ``verify=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from partitioner.core.errors import PartitionerError, PassError
from passes.data_dependent import data_dependent_refusal
from passes.registry import get_pass, pass_name
from passes.verify import verify as verify_model


def _one_line(error: BaseException) -> str:
    text = str(error) if isinstance(error, PartitionerError) else f"{type(error).__name__}: {error}"
    cause = error.__cause__
    # onnx-ir wraps the real error ("An error occurred when running ..."); the cause says what broke.
    if cause is not None and not isinstance(error, PartitionerError):
        text = f"{text} <- {_one_line(cause)}"
    return " ".join(text.split())


class PassManager(ir.passes.PassBase):
    """Run ``passes`` (instances or registered names) in order, verifying after each.

    Args:
        passes: pass instances, or names looked up in the registry.
        verify: run :func:`verify` after every pass.
        require_shapes: ``None`` (default) requires static shapes from the last shape-providing
            pass on; ``True``/``False`` forces it on or off.
    """

    def __init__(
        self,
        passes: Sequence[ir.passes.PassBase | str],
        verify: bool = True,
        *,
        require_shapes: bool | None = None,
    ) -> None:
        self.passes: tuple[ir.passes.PassBase, ...] = tuple(
            get_pass(p)() if isinstance(p, str) else p for p in passes
        )
        self.verify = verify
        self.require_shapes = require_shapes

    @property
    def in_place(self) -> bool:
        return all(p.in_place for p in self.passes)

    @property
    def changes_input(self) -> bool:
        return bool(self.passes) and (self.passes[0].changes_input or self.passes[0].in_place)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        ran: list[str] = []
        providers = [i for i, p in enumerate(self.passes) if getattr(p, "provides_shapes", False)]
        last_provider = providers[-1] if providers else len(self.passes)
        for index, pass_ in enumerate(self.passes):
            name = pass_name(pass_)
            after = ", ".join(ran) or "none"
            try:
                result = pass_(model)
            except Exception as e:  # every pass failure becomes one PassError naming the pass
                message = f"pass '{name}' failed (after: {after}): {_one_line(e)}"
                refusal = data_dependent_refusal(model, message) if "non-static shape" in str(e) else None
                if refusal is not None:  # a shape that depends on values: refuse it by name
                    raise refusal from e
                raise PassError(message) from e
            model = result.model
            modified = modified or result.modified
            shapes_known = index >= last_provider
            if self.verify:
                require = shapes_known if self.require_shapes is None else self.require_shapes
                try:
                    verify_model(model, require_shapes=require)
                except PartitionerError as e:
                    message = f"pass '{name}' failed (after: {after}): graph does not verify: {e}"
                    refusal = data_dependent_refusal(model, message) if "non-static shape" in str(e) else None
                    if refusal is not None:  # a shape that depends on values: refuse it by name
                        raise refusal from e
                    raise PassError(message) from e
            ran.append(name)
        return ir.passes.PassResult(model, modified)
