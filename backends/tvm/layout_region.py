"""``ConvertLayout`` on the part of a dataflow block that holds a convolution, not on a long
convolution-free tail.

Rules:

1. In a dataflow block of a Relax function, the *layout region* is its bindings up to and
   including the last call of an op the pass converts (the keys of ``desired``: conv2d,
   conv2d_transpose); the bindings after it are the *tail* (a block without such a call is all
   tail).
2. When the tail holds more than ``tail_min`` (default :data:`TAIL_MIN`) bindings, the block is
   split before ``ConvertLayout``: the region stays a dataflow block (its values that the tail
   reads become outputs of that block) and the tail becomes an ordinary binding block, which
   ``ConvertLayout`` (a dataflow-block pass) does not visit. A block holding a ``MatchCast`` is
   left whole.
3. After ``ConvertLayout``, ``ConvertToDataflow`` makes the split functions' tails dataflow
   blocks again (``FuseOps`` fuses only inside dataflow blocks); other functions are untouched.
4. Blocks with a short tail, and functions without such a block, go to ``ConvertLayout`` as they
   are, so ordinary convolutional models build exactly as before.

Why: TVM 0.27's ``ConvertLayout`` hands the layout of every variable seen so far in the block to
each op's layout rule as a fresh ``ffi::Map`` (its table is a ``std::unordered_map``, the rule
takes a ``Map``), so its time is quadratic in the block's length. SLANet with its 501-step
decoder unrolled is one block of ~31k bindings: cut to 100 and 200 steps (6.7k and 12.9k ONNX
nodes) ``ConvertLayout`` took 29 s and 148 s, the whole decoder about 15 min, though the decoder
holds no convolution. A tail without a convolution has nothing to convert: the only layouts that
reach it are those of region values it reads, and with the split they are converted back to the
model's layout where the region ends (one ``permute_dims`` per converted value the tail reads)
instead of before the tail's first op without a layout rule.

Invariant: the module computes the same values; only where layout conversions sit changes.
"""

from __future__ import annotations

from typing import Any

# A tail up to this length is left in the block: ConvertLayout then costs at most ~11 s (measured
# ~6.6e-7 s x bindings^2 on SLANet's decoder). The corpus' LSTM models (ddddocr_ocr,
# hey_mycroft: ~1950-binding tails after their convolutions) keep their one block: split at 512,
# ddddocr_ocr ran 45.3 ms against 44.3 ms unsplit (paired, 4 rounds, load ~1.2). SLANet's tail is
# ~30k bindings.
TAIL_MIN = 4096


def _region_end(block: Any, ops: frozenset[str]) -> int:
    """Rule 1: index of the last binding calling one of ``ops`` (-1: none)."""
    from tvm import relax

    end = -1
    for k, b in enumerate(block.bindings):
        value = getattr(b, "value", None)
        if isinstance(value, relax.Call) and getattr(value.op, "name", None) in ops:
            end = k
    return end


def _tail_reads(tail: list[Any]) -> set[Any]:
    """Variables defined before ``tail`` that it reads (one ``free_vars`` over the tail)."""
    from tvm import relax

    seq = relax.SeqExpr([relax.BindingBlock(tail)], relax.Tuple([]))
    return set(relax.analysis.free_vars(seq))


def _splitter(ops: frozenset[str], tail_min: int) -> Any:
    """Rule 2 as a mutator; ``split`` counts the blocks it split."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Split(PyExprMutator):
        def __init__(self, mod: Any = None) -> None:
            super().__init__(mod)
            self.split = 0

        def _plan(self, block: Any) -> int | None:
            if not isinstance(block, relax.DataflowBlock):
                return None
            bindings = list(block.bindings)
            end = _region_end(block, ops)
            if len(bindings) - end - 1 <= tail_min or any(not isinstance(b, relax.VarBinding) for b in bindings):
                return None
            return end

        def _emit(self, binding: Any, output: bool) -> None:
            value = self.visit_expr(binding.value)
            name = str(binding.var)
            new = self.builder_.emit_output(value, name) if output else self.builder_.emit(value, name)
            self.set_var_remap(binding.var, new)

        def _split_block(self, block: Any, end: int) -> list[Any]:
            bindings = list(block.bindings)
            region, tail = bindings[:end + 1], bindings[end + 1:]
            out: list[Any] = []
            if region:
                read = _tail_reads(tail)
                self.builder_._begin_dataflow_block()
                for b in region:
                    self._emit(b, not isinstance(b.var, relax.DataflowVar) or b.var in read)
                out.append(self.builder_._end_block())
            self.builder_._begin_binding_block()
            for b in tail:
                self._emit(b, False)  # outside a dataflow block every variable is a plain Var
            out.append(self.builder_._end_block())
            self.split += 1
            return out

        def visit_seq_expr_(self, op: Any) -> Any:  # noqa: N802 - TVM's method name
            plans = [self._plan(b) for b in op.blocks]
            if all(p is None for p in plans):
                return super().visit_seq_expr_(op)
            blocks: list[Any] = []
            for block, end in zip(op.blocks, plans):
                new = [self.visit_binding_block(block)] if end is None else self._split_block(block, end)
                blocks += [b for b in new if len(b.bindings)]
            self.builder_._begin_binding_block()
            body = self.visit_expr(op.body)
            prologue = self.builder_._end_block()
            return relax.SeqExpr(blocks + ([prologue] if len(prologue.bindings) else []), body)

    return _Split


def split_layout_tails(mod: Any, ops: frozenset[str], tail_min: int | None = None) -> tuple[Any, list[Any]]:
    """Rules 1-2: ``mod`` with the long tails split off, and the global vars of the functions that
    changed (``tail_min``: default :data:`TAIL_MIN`, read when called)."""
    import tvm
    from tvm import relax

    split_cls = _splitter(ops, TAIL_MIN if tail_min is None else tail_min)
    changed = []
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        splitter = split_cls(mod)
        new = splitter.visit_expr(func)
        if splitter.split:
            out[gv] = new
            changed.append(gv)
    return out, changed


def convert_layout_pass(desired: dict[str, list[str]], tail_min: int | None = None) -> Any:
    """Rules 1-4: ``relax.transform.ConvertLayout(desired)`` with long convolution-free tails kept
    out of its reach, as one module pass."""
    import tvm
    from tvm import relax

    ops = frozenset(desired)

    @tvm.transform.module_pass(opt_level=0, name="ConvertLayoutRegion")
    def convert(mod: Any, _ctx: Any) -> Any:
        mod, changed = split_layout_tails(mod, ops, tail_min)
        mod = relax.transform.ConvertLayout(desired)(mod)
        if not changed:
            return mod
        merged = relax.transform.ConvertToDataflow()(mod)  # rule 3: only the split functions taken
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv in changed:
            out[gv] = merged[gv]
        return out

    return convert


__all__ = ["TAIL_MIN", "convert_layout_pass", "split_layout_tails"]
