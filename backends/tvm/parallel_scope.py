"""Kernel bodies LLVM can optimise: parallel chunks with no-alias pointers, accumulators on the stack.

Two TIR rewrites at the end of TVM's host lowering, both for the CPU (llvm) target.

1. Parallel chunks with no-alias pointers (:data:`NOALIAS_PARALLEL_BODY`, default off: see
   "Measured" below). TVM's LLVM codegen
   turns a parallel loop into a closure launched through ``TVMBackendParallelLaunch``
   (``CodeGenCPU::CreateParallelLaunch``): the buffer pointers the body uses are loaded from the
   closure's struct, so LLVM knows nothing about whether they alias each other. A serial kernel
   has no closure: its body sits in the ``compute_scope`` MakePackedAPI wraps it in, which
   codegen (``CodeGenCPU::CreateComputeScope``) emits as a separate function whose pointer
   arguments carry ``noalias``.

   Rule (:func:`wrap_parallel_bodies`): the body of every outermost parallel ``For`` is wrapped
   in ``AttrStmt(compute_scope, "<function>_par_body<i>")``, inside the loop. Codegen emits the
   body as a function whose arguments are its free variables (the loop variable, the buffer
   pointers, sizes bound outside the loop), ``noalias`` on every pointer argument, called once
   per iteration (our schedules' parallel loops run over fused outer tiles, microseconds each,
   against a direct call of a few ns). A statement after the scope (``Evaluate(0)``) makes
   codegen set the debug location back to the closure's (without it LLVM's verifier rejects
   the closure's instructions that follow, tagged with the inner function's debug scope). Left
   alone: a parallel loop holding another parallel loop (codegen's parallel environment, the
   task id, is not passed into a compute scope) and a body already wrapped (idempotent).

   Soundness: ``noalias`` promises only that two different pointer arguments do not overlap
   during the call. The arguments are the kernel's distinct buffers, the same pointers the
   serial kernel's compute function gets as ``noalias`` (TVM's contract: the caller's tensors
   do not alias), and a buffer both read and written is one argument. A variable codegen knows
   may alias (``alias_var_set_``) gets no ``noalias``, as in the serial function.

2. Accumulators on the stack (:data:`LOCALS_ON_STACK`). ``LowerTVMBuiltin`` turns every
   ``"local"`` buffer into a ``TVMBackendAllocWorkspace`` call (on the CPU only small "global"
   buffers stay on the stack), so a conv's register tile (``conv2d_nhwc_local``: 16 x float32x16
   = 1 KiB) is heap memory behind a pointer returned by a call: LLVM's scalar replacement, which
   turns such a tile into vector registers, works on stack slots only, and the kernel allocates
   and frees it on every tile, which also gives the body an error path. In the small conv test
   model's LLVM IR the tile, once on the stack, leaves neither an alloca nor a workspace call.

   Rule (:func:`locals_on_stack`): a ``"local"`` buffer of constant size up to
   :data:`LOCAL_STACK_MAX_BYTES` (16 KiB: 16x the conv tile above, far below a thread's stack of
   megabytes; codegen puts the slot in the function's entry block, once per call) gets TVM's
   ``disable_lower_builtin`` annotation, so codegen allocates it on the stack. Shapes it is for:
   every kernel with a "local" (cache_write) buffer, serial or parallel. Larger or dynamic-size
   local buffers keep the workspace.

Where it runs (:func:`tir_pipeline`): a TIR pipeline named :data:`PIPELINE` = TVM's default
``s_tir`` lowering; host finalisation = rule 2, ``LowerTVMBuiltin`` + ``LowerIntrin``, rule 1
(after them, so the body it wraps is final). :func:`compile` passes it to
``tvm.compile(..., tir_pipeline=...)``; ``backends.tvm.build`` and the benchmarks that time our
builds (``kernel_profile.py``, ``thread_scaling.py``) and ``conv_algorithms._time_alone`` compile through
it. Both knobs off: TVM's ``"default"`` pipeline (the "before").

Measured (docs/per_device_speed.md, "Session 12: parallel chunks with no-alias pointers"),
paired, ``kernel_profile.py --scaling``: rule 1 alone took 22-23% off mobilenet batch 8's 2-thread
kernel time (1 thread unchanged); rule 2 on top of rule 1 5.5% (1 thread) and 14% (2
threads); but rule 1 on top of rule 2 gains nothing (mobilenet batch 8 0.99x / 1.03x on 1 / 2
threads, heldout_mbv2 batch 8 1.06x / 0.94x, heldout_inception batch 1 1.02x / 1.14x): once the
accumulators are stack slots the closure's missing ``noalias`` no longer costs, and rule 1 adds a
call per iteration. So :data:`LOCALS_ON_STACK` is on and :data:`NOALIAS_PARALLEL_BODY` is off
(kept, tested, for the day a kernel's body needs it).
"""

from __future__ import annotations

from typing import Any, Callable

#: rule 1: each parallel loop's body in a compute scope with no-alias pointer arguments (off:
#: no gain once LOCALS_ON_STACK holds, module docstring "Measured")
NOALIAS_PARALLEL_BODY = False
#: rule 2: constant-size "local" buffers up to LOCAL_STACK_MAX_BYTES on the stack
LOCALS_ON_STACK = True
LOCAL_STACK_MAX_BYTES = 16384
PIPELINE = "partitioner_noalias"
ATTR = "compute_scope"
STACK_KEY = "disable_lower_builtin"  # TVM's transform::kDisableLowerTVMBuiltin


def _is_parallel(s: Any) -> bool:
    from tvm import tirx

    return isinstance(s, tirx.For) and int(s.kind) == int(tirx.ForKind.PARALLEL)


def _map_stmts(s: Any, fn: Callable[[Any], Any | None]) -> Any:
    """``s`` with ``fn`` applied top-down: where ``fn`` returns a statement it replaces the node
    (not descended into), where it returns None the node's children are rewritten. Unchanged
    subtrees are kept (``same_as``)."""
    from tvm import tirx

    out = fn(s)
    if out is not None:
        return out
    if isinstance(s, tirx.SeqStmt):
        seq = [_map_stmts(c, fn) for c in s.seq]
        return s if all(a.same_as(b) for a, b in zip(seq, s.seq)) else tirx.SeqStmt(seq, s.span)
    if isinstance(s, (tirx.AttrStmt, tirx.For, tirx.While)):
        body = _map_stmts(s.body, fn)
        if body.same_as(s.body):
            return s
        if isinstance(s, tirx.AttrStmt):
            return tirx.AttrStmt(s.node, s.attr_key, s.value, body, s.span)
        if isinstance(s, tirx.While):
            return tirx.While(s.condition, body, s.span)
        return _with_body(s, body)
    if isinstance(s, tirx.IfThenElse):
        then = _map_stmts(s.then_case, fn)
        other = None if s.else_case is None else _map_stmts(s.else_case, fn)
        if then.same_as(s.then_case) and (other is None or other.same_as(s.else_case)):
            return s
        return tirx.IfThenElse(s.condition, then, other, s.span)
    return s


def _with_body(loop: Any, body: Any) -> Any:
    from tvm import tirx

    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations, loop.step, loop.span)


def _holds(s: Any, pred: Callable[[Any], bool]) -> bool:
    found: list[Any] = []
    _map_stmts(s, lambda x: found.append(x) if pred(x) else None)
    return bool(found)


def _scoped(body: Any) -> bool:
    from tvm import tirx

    first = body.seq[0] if isinstance(body, tirx.SeqStmt) and len(body.seq) else body
    return isinstance(first, tirx.AttrStmt) and first.attr_key == ATTR


def wrap_parallel_bodies(func: Any, name: str) -> Any:
    """Rule 1: ``func`` (a lowered host PrimFunc) with each outermost parallel loop's body in a
    compute scope named ``<name>_par_body<i>``; unchanged when it has no parallel loop."""
    import tvm
    from tvm import tirx

    count = [0]

    def visit(s: Any) -> Any | None:
        if not _is_parallel(s):
            return None
        if _scoped(s.body) or _holds(s.body, _is_parallel):
            return s
        label = tvm.ir.StringImm(f"{name}_par_body{count[0]}")
        scope = tirx.AttrStmt(tirx.const(0, "int32"), ATTR, label, s.body)
        count[0] += 1
        return _with_body(s, tirx.SeqStmt([scope, tirx.Evaluate(tirx.const(0, "int32"))]))

    body = _map_stmts(func.body, visit)
    return func if body.same_as(func.body) else func.with_body(body)


def local_bytes(buf: Any) -> int | None:
    """Bytes of ``buf`` when it is a ``"local"`` buffer of constant shape, else None."""
    import tvm
    from tvm import tirx

    if buf.scope() != "local" or not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return None
    dt = tvm.runtime.DataType(str(buf.dtype))
    n = (dt.bits * dt.lanes + 7) // 8
    for d in buf.shape:
        n *= int(d)
    return n


def locals_on_stack(func: Any) -> Any:
    """Rule 2: ``func`` with each small constant-size "local" buffer marked for the stack."""
    from tvm import tirx

    def visit(s: Any) -> Any | None:
        if not isinstance(s, tirx.AllocBuffer):
            return None
        n = local_bytes(s.buffer)
        if n is None or n > LOCAL_STACK_MAX_BYTES or STACK_KEY in s.annotations:
            return s
        return tirx.AllocBuffer(s.buffer, {**dict(s.annotations), STACK_KEY: tirx.IntImm("int32", 1)}, s.span)

    body = _map_stmts(func.body, visit)
    return func if body.same_as(func.body) else func.with_body(body)


def _prim_pass(name: str, rewrite: Callable[[Any, str], Any]) -> Any:
    import tvm

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name=name)
    def _pass(func: Any, mod: Any, ctx: Any) -> Any:
        symbol = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else "kernel"
        return rewrite(func, str(symbol))

    return _pass


def _factory() -> Any:
    import tvm
    from tvm.s_tir import pipeline as s_tir_pipeline

    lower, finalize_host, finalize_device = s_tir_pipeline.default_s_tir_pipeline()

    def host() -> Any:
        first = [_prim_pass("LocalsOnStack", lambda f, _: locals_on_stack(f))] if LOCALS_ON_STACK else []
        last = [_prim_pass("NoAliasParallelBody", wrap_parallel_bodies)] if NOALIAS_PARALLEL_BODY else []
        return tvm.ir.transform.Sequential([*first, finalize_host(), *last])

    return lower, host, finalize_device


def tir_pipeline(target: Any) -> str:
    """The ``tir_pipeline`` argument of ``tvm.compile`` for ``target``: :data:`PIPELINE` for a
    CPU (llvm) target while either knob is on (it reads the knobs when it runs), else TVM's
    ``"default"``."""
    import tvm

    if not (NOALIAS_PARALLEL_BODY or LOCALS_ON_STACK) or str(tvm.target.Target(target).kind.name) != "llvm":
        return "default"
    tvm.tirx.register_tir_pipeline(PIPELINE, _factory)
    return PIPELINE


def compile(mod: Any, target: Any) -> Any:  # noqa: A001 - the tvm.compile it stands for
    """``tvm.compile(mod, target)`` with :func:`tir_pipeline`'s TIR pipeline."""
    import tvm

    return tvm.compile(mod, target, tir_pipeline=tir_pipeline(target))
