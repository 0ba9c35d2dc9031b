"""Expand ``LSTM``, ``GRU`` and ``RNN`` into standard ONNX ops: one input GEMM, then an unrolled loop.

TVM 0.27's ONNX importer has no converter for the recurrent ops, and a recurrent node is opaque
to the partitioner (one node holding a whole sequence's work). After binding, the sequence
length is static, so the recurrence unrolls into plain ``MatMul``/elementwise nodes that every
backend imports and every strategy can cut.

Rules:

1. A default-domain ``LSTM``/``GRU``/``RNN`` node of the main graph is expanded when ``X`` has a
   static shape, ``hidden_size`` is set and every activation named in ``activations`` is one this
   pass knows (:data:`ACTIVATIONS`). Otherwise it is left as it is (the backend then refuses it
   by name, or runs it itself): the pass never raises on a node it cannot expand.
2. The input projection is one GEMM per direction for the whole sequence: ``X`` is viewed as
   ``[T*B, I]`` (``layout=1``: ``[B*T, I]``, no transpose) and multiplied by ``W[d]ᵀ``; the
   input and recurrent biases are added once there (``Wb + Rb``; for GRU with
   ``linear_before_reset=1`` the hidden gate's ``Rbh`` stays inside the reset product, as the
   operator defines). Weights that are constants are transposed and summed here, in numpy;
   weights that are graph inputs get the equivalent ``Gather``/``Transpose``/``Slice`` nodes.
3. The recurrence unrolls over the static time steps (reverse direction: ``T-1`` down to ``0``),
   with one ``MatMul(H_{t-1}, R[d]ᵀ)`` per step (skipped at the first step when there is no
   ``initial_h``: the state is zero) and the gate equations of the ONNX operator spec: LSTM
   gates ``i, o, f, c`` with peepholes ``P = [Pi, Po, Pf]`` and ``input_forget`` (``f = 1 - i``);
   GRU gates ``z, r, h``; ``clip`` bounds every gate's pre-activation (after bias and peephole),
   as ONNX Runtime does.
4. ``sequence_lens``: a step ``t`` is valid for batch item ``b`` when ``t < sequence_lens[b]``.
   On an invalid step the state is carried unchanged and ``Y`` is zero. For the reverse
   direction this makes item ``b`` start at its own last valid step, and in both directions the
   final state is the state at each item's last valid step: ONNX Runtime's ``Y_h``/``Y_c``. A
   constant ``sequence_lens`` equal to ``T`` everywhere adds no masking.
5. Outputs: ``Y`` (``[T, D, B, H]``; ``layout=1``: ``[B, T, D, H]``) is built only when it is
   read; ``Y_h``/``Y_c`` are the final states stacked over directions. Graph outputs keep their
   names.
6. Only ops whose signature is stable from opset 7 on are emitted, except ``Slice``, ``Split``,
   ``Clip`` and ``Where``, which are written in the form the model's default opset expects: below
   opset 10 a slice is a ``Gather`` of the index range (TVM's importer refuses the attribute form
   of ``Slice``) and below opset 9 ``Where`` is a multiply-add with a 0/1 mask.
7. LSTM steps read their input projection with one ``Gather`` of a constant step index from
   the ``[T, B, 4H]`` view of the projection, and add it gate by gate to the gate's ``Slice`` of
   ``H_{t-1}·Rᵀ`` (GRU and RNN keep the ``Split`` of rule 2 and add ``x_t`` to the whole GEMM).
   TVM then fuses the ``Gather`` and the slices into the step's two gate kernels (an injective op
   cannot join the GEMM's kernel, an elementwise one can): no ``Split`` copy of the projection and
   no ``T`` step tensors; the index is a kernel argument, not a constant baked into the kernel,
   so every step runs the same two compiled kernels (a ``Slice`` at ``t*B`` made ``2T`` distinct
   kernels and a 3-5x longer build). The sums are the same numbers as before.
8. A ``Concat`` of more than :data:`CONCAT_FANIN` step outputs (``Y``) is a two-level tree of
   about ``sqrt(T)`` groups: TVM's ``concatenate`` selects each element's input through a chain
   of conditions over all its inputs, so a flat 128-way ``Concat`` of ``Y`` cost ~10x a copy.

Invariant: the graph computes what the recurrent node computed, up to float rounding (the
tests hold it to ONNX Runtime at 1e-5); the graph's inputs and outputs are unchanged. Shapes of
the new values are left to the next shape inference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from passes.registry import register

# rule 8: a Concat of more inputs is built as a tree (TVM's concatenate picks each element's input
# with a chain of selects over all inputs: 128 steps cost ~10x a plain copy)
CONCAT_FANIN = 16
RECURRENT_OPS: frozenset[str] = frozenset({"LSTM", "GRU", "RNN"})
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
# activation name (lower case) -> (uses alpha, uses beta, default alpha, default beta); ONNX Runtime's
# table: alphas and betas are consumed in order by the functions that use them.
ACTIVATIONS: dict[str, tuple[bool, bool, float, float]] = {
    "sigmoid": (False, False, 0.0, 0.0), "tanh": (False, False, 0.0, 0.0), "relu": (False, False, 0.0, 0.0),
    "affine": (True, True, 1.0, 0.0), "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 1.0, 0.0), "scaledtanh": (True, True, 1.0, 1.0),
    "hardsigmoid": (True, True, 0.2, 0.5), "elu": (True, False, 1.0, 0.0),
    "softsign": (False, False, 0.0, 0.0), "softplus": (False, False, 0.0, 0.0),
}


def _attr(node: ir.Node, name: str, default: object) -> object:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _static_dims(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)


def _read(value: ir.Value | None) -> bool:
    return value is not None and (value.is_graph_output() or bool(value.uses()))


class _Emitter:
    """Builds the replacement nodes (collected on a tape) and its constants (graph initializers)."""

    def __init__(self, graph: ir.Graph, base: str, opset: int, dtype: np.dtype, taken: set[str]) -> None:
        self.tape = ir.tape.Tape()
        self.graph, self.base, self.opset, self.dtype, self.taken = graph, base, opset, dtype, taken
        self._count = 0

    def const(self, array: np.ndarray | float | Sequence[int], dtype: np.dtype | type | None = None) -> ir.Value:
        if dtype is None and not isinstance(array, np.ndarray):
            dtype = self.dtype
        arr = np.asarray(array, dtype=dtype)
        name = f"{self.base}.c{self._count}"
        while name in self.taken:
            self._count += 1
            name = f"{self.base}.c{self._count}"
        self._count += 1
        self.taken.add(name)
        value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                         const_value=ir.tensor(arr, name=name))
        self.graph.register_initializer(value)
        return value

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, *inputs: ir.Value | None, **attrs: object) -> ir.Value:
        return self.tape.op(op_type, list(inputs), attrs or None)

    # -- opset-dependent forms (rule 6) --
    def slice(self, x: ir.Value, axis: int, start: int, end: int) -> ir.Value:
        if self.opset >= 10:
            return self.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([axis]))
        # Slice-1 (attributes) is refused by TVM's importer: a Gather of the index range instead
        return self.op("Gather", x, self.ints(list(range(start, end))), axis=axis)

    def clip(self, x: ir.Value, bound: float | None) -> ir.Value:
        if bound is None:
            return x
        if self.opset >= 11:
            return self.op("Clip", x, self.const(-bound), self.const(bound))
        return self.op("Clip", x, min=-float(bound), max=float(bound))

    def where(self, mask: tuple[ir.Value, ir.Value], a: ir.Value, b: ir.Value) -> ir.Value:
        """``mask ? a : b``; ``mask`` is ``(bool mask, float 0/1 mask)``."""
        if self.opset >= 9:
            return self.op("Where", mask[0], a, b)
        m = mask[1]
        return self.op("Add", self.op("Mul", m, a), self.op("Mul", self.op("Sub", self.const(1.0), m), b))

    def reshape(self, x: ir.Value, shape: Sequence[int]) -> ir.Value:
        return self.op("Reshape", x, self.ints(shape))

    def activation(self, name: str, x: ir.Value, alpha: float, beta: float) -> ir.Value:
        n = name.lower()
        if n in ("sigmoid", "tanh", "relu", "softsign", "softplus"):
            return self.op({"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "softsign": "Softsign",
                            "softplus": "Softplus"}[n], x)
        if n == "affine":
            return self.op("Add", self.op("Mul", x, self.const(alpha)), self.const(beta))
        if n == "leakyrelu":
            return self.op("LeakyRelu", x, alpha=float(alpha))
        if n == "thresholdedrelu":
            return self.op("Mul", x, self.op("Cast", self.op("Greater", x, self.const(alpha)),
                                             to=ir.DataType.from_numpy(self.dtype)))
        if n == "scaledtanh":
            return self.op("Mul", self.op("Tanh", self.op("Mul", x, self.const(beta))), self.const(alpha))
        if n == "hardsigmoid":
            return self.op("HardSigmoid", x, alpha=float(alpha), beta=float(beta))
        if n == "elu":
            return self.op("Elu", x, alpha=float(alpha))
        raise AssertionError(n)  # filtered by _activations


Act = Callable[[ir.Value], ir.Value]


def _activations(node: ir.Node, directions: int, em: _Emitter | None) -> list[list[Act]] | None:
    """Per direction, the op's activation functions (f, g[, h]); None when one is unknown (rule 1)."""
    per_dir = len(DEFAULT_ACTIVATIONS[node.op_type])
    names = list(_attr(node, "activations", []) or [])
    if not names:
        names = list(DEFAULT_ACTIVATIONS[node.op_type]) * directions
    if len(names) != per_dir * directions or any(n.lower() not in ACTIVATIONS for n in names):
        return None
    if em is None:
        return []
    alphas = list(_attr(node, "activation_alpha", []) or [])
    betas = list(_attr(node, "activation_beta", []) or [])
    funcs: list[Act] = []
    for name in names:
        uses_a, uses_b, da, db = ACTIVATIONS[name.lower()]
        a = (alphas.pop(0) if alphas else da) if uses_a else da
        b = (betas.pop(0) if betas else db) if uses_b else db
        funcs.append(lambda x, name=name, a=a, b=b: em.activation(name, x, a, b))
    return [funcs[d * per_dir:(d + 1) * per_dir] for d in range(directions)]


def can_expand(node: ir.Node) -> str | None:
    """None when ``node`` is expandable (rule 1), else the reason it is not."""
    if node.op_type not in RECURRENT_OPS or node.domain not in ("", "ai.onnx"):
        return "not a recurrent op"
    dims = _static_dims(node.inputs[0])
    if dims is None or len(dims) != 3:
        return "X has no static 3-D shape"
    if not _attr(node, "hidden_size", 0):
        return "no hidden_size"
    direction = _attr(node, "direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        return f"unknown direction {direction!r}"
    if _activations(node, 2 if direction == "bidirectional" else 1, None) is None:
        return "unknown or miscounted activations"
    return None


class _Weights:
    """Per-direction weight pieces, as constants when the inputs are constants (rule 2)."""

    def __init__(self, node: ir.Node, em: _Emitter, gates: int, hidden: int) -> None:
        self.node, self.em, self.gates, self.hidden = node, em, gates, hidden

    def _input(self, i: int) -> ir.Value | None:
        return self.node.inputs[i] if len(self.node.inputs) > i else None

    def transposed(self, i: int, d: int) -> ir.Value:
        """``W[d]ᵀ`` / ``R[d]ᵀ``: ``[in, gates*H]``."""
        v = self._input(i)
        arr = _const(v)
        if arr is not None:
            return self.em.const(np.ascontiguousarray(arr[d].T, dtype=self.em.dtype))
        return self.em.op("Transpose", self.em.op("Gather", v, self.em.const(d, np.int64), axis=0), perm=[1, 0])

    def row(self, i: int, d: int) -> tuple[np.ndarray | None, ir.Value | None]:
        """``input[d]`` as a numpy array (constant) or a value; ``(None, None)`` when absent."""
        v = self._input(i)
        if v is None:
            return None, None
        arr = _const(v)
        if arr is not None:
            return np.asarray(arr[d], dtype=self.em.dtype), None
        return None, self.em.op("Gather", v, self.em.const(d, np.int64), axis=0)

    def piece(self, row: tuple[np.ndarray | None, ir.Value | None], start: int, end: int) -> ir.Value | None:
        arr, val = row
        if arr is not None:
            return self.em.const(arr[start:end])
        if val is not None:
            return self.em.slice(val, 0, start, end)
        return None


class _Expansion:
    """One recurrent node's replacement (rules 2-5)."""

    def __init__(self, graph: ir.Graph, node: ir.Node, opset: int, taken: set[str], index: int) -> None:
        self.node = node
        x = node.inputs[0]
        self.dtype = np.dtype(x.dtype.numpy()) if x.dtype is not None else np.dtype(np.float32)
        self.em = _Emitter(graph, node.name or f"{node.op_type.lower()}{index}", opset, self.dtype, taken)
        self.op = node.op_type
        self.hidden = int(_attr(node, "hidden_size", 0))
        self.layout = int(_attr(node, "layout", 0))
        direction = _attr(node, "direction", "forward")
        self.dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
        clip = _attr(node, "clip", None)
        self.clip = None if clip is None else float(clip)
        self.lbr = int(_attr(node, "linear_before_reset", 0)) if self.op == "GRU" else 0
        self.input_forget = int(_attr(node, "input_forget", 0)) if self.op == "LSTM" else 0
        dims = _static_dims(x)
        assert dims is not None
        self.T, self.B = (dims[0], dims[1]) if self.layout == 0 else (dims[1], dims[0])
        self.I = dims[2]
        self.G = GATES[self.op]
        self.w = _Weights(node, self.em, self.G, self.hidden)
        acts = _activations(node, len(self.dirs), self.em)
        assert acts is not None
        self.acts = acts
        self._rows: ir.Value | None = None

    def _in(self, i: int) -> ir.Value | None:
        return self.node.inputs[i] if len(self.node.inputs) > i else None

    # -- rule 4 --
    def _masks(self) -> list[tuple[ir.Value, ir.Value]] | None:
        lens = self._in(4)
        if lens is None:
            return None
        em = self.em
        arr = _const(lens)
        if arr is not None and np.all(arr.reshape(-1) >= self.T):
            return None
        steps = em.const(np.arange(self.T, dtype=np.float32).reshape(self.T, 1, 1), np.float32)
        lens_f = em.reshape(em.op("Cast", lens, to=ir.DataType.FLOAT), [1, self.B, 1])
        valid = em.op("Less", steps, lens_f)  # [T, B, 1]
        valid_f = em.op("Cast", valid, to=ir.DataType.from_numpy(self.dtype))
        masks = []
        for t in range(self.T):
            index = em.const(t, np.int64)
            masks.append((em.op("Gather", valid, index, axis=0), em.op("Gather", valid_f, index, axis=0)))
        return masks

    def _initial(self, i: int, d: int) -> ir.Value | None:
        v = self._in(i)
        if v is None:
            return None
        arr = _const(v)
        axis = 0 if self.layout == 0 else 1
        if arr is not None:
            return self.em.const(np.take(arr, d, axis=axis).astype(self.dtype))
        return self.em.op("Gather", v, self.em.const(d, np.int64), axis=axis)

    def _x_rows(self) -> ir.Value:
        """``X`` as ``[T*B, I]`` rows in time-major order (``layout=1`` is transposed once)."""
        if self._rows is None:
            x = self.node.inputs[0]
            if self.layout == 1:
                x = self.em.op("Transpose", x, perm=[1, 0, 2])
            self._rows = self.em.reshape(x, [self.T * self.B, self.I])
        return self._rows

    def _projection_rows(self, d: int, bias: ir.Value | None) -> ir.Value:
        """``X·W[d]ᵀ + bias`` for every step at once (one GEMM): ``[T*B, G*H]``."""
        y = self.em.op("MatMul", self._x_rows(), self.w.transposed(1, d))
        return y if bias is None else self.em.op("Add", y, bias)

    def _projection(self, d: int, bias: ir.Value | None) -> list[ir.Value]:
        """The projection split into ``T`` step inputs ``[B, G*H]`` by one ``Split`` (a per-step
        ``Gather`` would be one more kernel a step)."""
        em = self.em
        y = self._projection_rows(d, bias)
        if self.T == 1:
            return [y]
        sizes = [self.B] * self.T
        if em.opset >= 13:
            return list(em.tape.op_multi_out("Split", [y, em.ints(sizes)], {"axis": 0}, num_outputs=self.T))
        return list(em.tape.op_multi_out("Split", [y], {"axis": 0, "split": sizes}, num_outputs=self.T))

    def _lstm_steps(self, d: int, bias: ir.Value | None) -> list[ir.Value]:
        """Rule 7: the projection viewed as ``[T, B, 4H]`` and one ``Gather`` of a constant index per step."""
        if self.T == 1:
            return [self._projection_rows(d, bias)]
        em = self.em
        rows = em.reshape(self._projection_rows(d, bias), [self.T, self.B, self.G * self.hidden])
        return [em.op("Gather", rows, em.const(t, np.int64), axis=0) for t in range(self.T)]

    def _biases(self, d: int) -> tuple[ir.Value | None, ir.Value | None]:
        """(bias added to the input projection, GRU's Rbh when linear_before_reset)."""
        em, gh, h = self.em, self.G * self.hidden, self.hidden
        b = self._in(3)
        if b is None:
            return None, None
        arr = _const(b)
        keep = np.ones(gh, dtype=self.dtype)
        if self.lbr:
            keep[2 * h:] = 0
        if arr is not None:
            row = np.asarray(arr[d], dtype=self.dtype)
            rbh = em.const(row[gh + 2 * h:]) if self.lbr else None
            return em.const(row[:gh] + row[gh:] * keep), rbh
        row_v = em.op("Gather", b, em.const(d, np.int64), axis=0)
        wb, rb = em.slice(row_v, 0, 0, gh), em.slice(row_v, 0, gh, 2 * gh)
        if self.lbr:
            return em.op("Add", wb, em.op("Mul", rb, em.const(keep))), em.slice(row_v, 0, gh + 2 * h, 2 * gh)
        return em.op("Add", wb, rb), None

    def _recurrent(self, h: ir.Value | None, rt: ir.Value, extra: ir.Value | None = None) -> ir.Value | None:
        if h is None:
            return None
        y = self.em.op("MatMul", h, rt)
        return y if extra is None else self.em.op("Add", y, extra)

    def _add(self, a: ir.Value, b: ir.Value | None) -> ir.Value:
        return a if b is None else self.em.op("Add", a, b)

    def _gate(self, g: ir.Value, k: int) -> ir.Value:
        return self.em.slice(g, 1, k * self.hidden, (k + 1) * self.hidden)

    def _concat(self, values: list[ir.Value], axis: int) -> ir.Value:
        """Rule 8: ``Concat`` of many values as a two-level tree of about ``sqrt(n)`` groups."""
        n = len(values)
        if n <= CONCAT_FANIN:
            return self.em.op("Concat", *values, axis=axis)
        size = math.isqrt(n - 1) + 1
        groups = [values[i:i + size] for i in range(0, n, size)]
        parts = [g[0] if len(g) == 1 else self.em.op("Concat", *g, axis=axis) for g in groups]
        return self.em.op("Concat", *parts, axis=axis)

    def _direction(self, d: int, masks: list[tuple[ir.Value, ir.Value]] | None, want_y: bool
                   ) -> tuple[list[ir.Value] | None, ir.Value, ir.Value | None]:
        em, H = self.em, self.hidden
        acts = self.acts[d]
        bias, rbh = self._biases(d)
        steps = self._lstm_steps(d, bias) if self.op == "LSTM" else self._projection(d, bias)
        h = self._initial(5, d)
        c = self._initial(6, d) if self.op == "LSTM" else None
        zeros = em.const(np.zeros((self.B, H), dtype=self.dtype)) if masks is not None else None
        if masks is not None:  # a masked step carries the state: it must exist from the start
            h = h if h is not None else zeros
            if self.op == "LSTM":
                c = c if c is not None else zeros
        if self.op == "GRU" and not self.lbr:
            rt_full = self.w.transposed(2, d)
            rt_zr, rt_h = em.slice(rt_full, 1, 0, 2 * H), em.slice(rt_full, 1, 2 * H, 3 * H)
        else:
            rt_full = self.w.transposed(2, d)
        peep = None
        if self.op == "LSTM" and self._in(7) is not None:
            row = self.w.row(7, d)
            peep = [self.w.piece(row, k * H, (k + 1) * H) for k in range(3)]  # Pi, Po, Pf
        order = range(self.T) if self.dirs[d] == "forward" else range(self.T - 1, -1, -1)
        ys: dict[int, ir.Value] = {}
        for t in order:
            x_t = steps[t]
            if self.op == "RNN":
                new_h = acts[0](em.clip(self._add(x_t, self._recurrent(h, rt_full)), self.clip))
                new_c = None
            elif self.op == "GRU":
                f, g = acts
                gx_zr, gx_h = em.slice(x_t, 1, 0, 2 * H), em.slice(x_t, 1, 2 * H, 3 * H)
                if self.lbr:
                    hr = self._recurrent(h, rt_full)
                    zr = self._add(gx_zr, None if hr is None else em.slice(hr, 1, 0, 2 * H))
                    z = f(em.clip(self._gate(zr, 0), self.clip))
                    r = f(em.clip(self._gate(zr, 1), self.clip))
                    rec_h = rbh if hr is None else self._add(em.slice(hr, 1, 2 * H, 3 * H), rbh)
                    pre_h = gx_h if rec_h is None else em.op("Add", gx_h, em.op("Mul", r, rec_h))
                else:
                    zr = self._add(gx_zr, self._recurrent(h, rt_zr))
                    z = f(em.clip(self._gate(zr, 0), self.clip))
                    r = f(em.clip(self._gate(zr, 1), self.clip))
                    pre_h = gx_h if h is None else em.op("Add", gx_h, em.op("MatMul", em.op("Mul", r, h), rt_h))
                hh = g(em.clip(pre_h, self.clip))
                keep = em.op("Mul", em.op("Sub", em.const(1.0), z), hh)
                new_h = keep if h is None else em.op("Add", keep, em.op("Mul", z, h))
                new_c = None
            else:
                f, g, hact = acts
                rec = self._recurrent(h, rt_full)  # rule 7: x_t is added per gate, in the gate kernels
                gi, go, gf, gc = (self._gate(x_t, k) if rec is None
                                  else em.op("Add", self._gate(rec, k), self._gate(x_t, k)) for k in range(4))
                if peep is not None and c is not None:
                    gi = em.op("Add", gi, em.op("Mul", peep[0], c))
                    gf = em.op("Add", gf, em.op("Mul", peep[2], c))
                i = f(em.clip(gi, self.clip))
                fg = em.op("Sub", em.const(1.0), i) if self.input_forget else f(em.clip(gf, self.clip))
                cand = g(em.clip(gc, self.clip))
                new_c = em.op("Mul", i, cand)
                if c is not None:
                    new_c = em.op("Add", em.op("Mul", fg, c), new_c)
                if peep is not None:
                    go = em.op("Add", go, em.op("Mul", peep[1], new_c))
                o = f(em.clip(go, self.clip))
                new_h = em.op("Mul", o, hact(new_c))
            if masks is not None:
                assert h is not None
                ys[t] = em.where(masks[t], new_h, zeros) if want_y else new_h
                h = em.where(masks[t], new_h, h)
                if new_c is not None:
                    assert c is not None
                    c = em.where(masks[t], new_c, c)
            else:
                ys[t] = new_h
                h, c = new_h, new_c
        assert h is not None
        return ([ys[t] for t in range(self.T)] if want_y else None), h, c

    def build(self) -> dict[int, ir.Value]:
        """The replacement values for the node's read outputs, by output index."""
        em, H, B, T = self.em, self.hidden, self.B, self.T
        outs = list(self.node.outputs)
        want = [i < len(outs) and _read(outs[i]) for i in range(3)]
        masks = self._masks()
        per_dir = [self._direction(d, masks, want[0]) for d in range(len(self.dirs))]
        result: dict[int, ir.Value] = {}
        if want[0]:
            if self.layout == 0:  # [T, D, B, H]
                ys = [self._concat([em.reshape(y, [1, 1, B, H]) for y in seq], 0) for seq, _, _ in per_dir]
                result[0] = ys[0] if len(ys) == 1 else em.op("Concat", *ys, axis=1)
            else:  # [B, T, D, H]
                ys = [self._concat([em.reshape(y, [B, 1, 1, H]) for y in seq], 1) for seq, _, _ in per_dir]
                result[0] = ys[0] if len(ys) == 1 else em.op("Concat", *ys, axis=2)
        for k, pick in ((1, 1), (2, 2)):
            if not want[k] or (k == 2 and self.op != "LSTM"):
                continue
            shape, axis = ([1, B, H], 0) if self.layout == 0 else ([B, 1, H], 1)
            states = [em.reshape(state[pick], shape) for state in per_dir]  # type: ignore[arg-type]
            result[k] = states[0] if len(states) == 1 else em.op("Concat", *states, axis=axis)
        return result


def _default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


def expand_node(graph: ir.Graph, node: ir.Node, opset: int, taken: set[str], index: int = 0) -> bool:
    """Replace one recurrent ``node`` of ``graph`` by its expansion; False when rule 1 refuses it."""
    if can_expand(node) is not None:
        return False
    expansion = _Expansion(graph, node, opset, taken, index)
    replacements = expansion.build()
    new_nodes = list(expansion.em.tape.nodes)
    graph.insert_before(node, new_nodes)
    for k, new in replacements.items():
        old = node.outputs[k]
        if new.producer() is None:  # a constant can't stand for an output: pass it through a node
            new = expansion.em.op("Identity", new)
            graph.insert_before(node, new.producer())
        new.type, new.shape = old.type, old.shape
        name, was_output = old.name, old.is_graph_output()
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        if was_output:
            old.name = f"{name}.replaced"
            new.name = name
    graph.remove(node, safe=True)
    return True


@register("expand_recurrent")
class ExpandRecurrent(ir.passes.InPlacePass):
    """Expand every expandable LSTM/GRU/RNN node into standard ONNX ops (see the module rules)."""

    def __init__(self, ops: frozenset[str] = RECURRENT_OPS) -> None:
        super().__init__()
        self.ops = ops

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = _default_opset(model)
        targets = [n for n in graph if n.op_type in self.ops and n.domain in ("", "ai.onnx")]
        if not targets:
            return ir.passes.PassResult(model, modified=False)
        taken = {v.name for v in graph.inputs} | set(graph.initializers)
        taken |= {o.name for n in graph for o in n.outputs if o.name}
        changed = sum(expand_node(graph, n, opset, taken, k) for k, n in enumerate(targets))
        return ir.passes.PassResult(model, modified=bool(changed))
