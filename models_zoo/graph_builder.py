"""The mechanism every zoo builder uses to write an ONNX graph.

A :class:`GraphBuilder` accumulates inputs, nodes, initializers and outputs, hands out unique
readable names ("layer1.attn.q_proj", "layer1.attn.q_proj.weight"), and draws every weight
from one ``numpy.random.default_rng(seed)`` stream.

Invariants:

1. Determinism: the same calls in the same order give byte-identical ``SerializeToString()``
   (weights come from one seeded stream, names from counters, attributes are sorted by
   ``onnx.helper.make_node``).
2. Names are unique across nodes and across values (a node's output is named after the node,
   or given an explicit name such as ``logits``).
3. One opset for the whole zoo: :data:`OPSET` of the default domain.
4. Weights are scaled so that activations stay O(1) through deep nets (He scaling before
   ReLU-like activations, Xavier-like scaling before linear ones), which keeps float32
   comparisons against ONNX Runtime at rtol 1e-4 meaningful.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
IR_VERSION = 10
PRODUCER_NAME = "partitioner.models_zoo"
PRODUCER_VERSION = "0.1.0"
#: ``metadata_props`` key holding the JSON of the arguments a model was built with.
ARGS_METADATA_KEY = "partitioner.zoo.args"

Dim = int | str


class GraphBuilder:
    """Accumulates one ONNX graph. See the module docstring for the invariants it keeps."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: list[onnx.TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._node_names: set[str] = set()
        self._value_names: set[str] = set()
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._moments: dict[str, float] = {}

    # -- activation scale estimates ----------------------------------------------------------

    def moment(self, value: str) -> float:
        """The estimated mean square E[x^2] of ``value`` (1.0 when never recorded).

        Builders record estimates as they go, so a BatchNormalization can be given running
        statistics that really normalise its input (as trained statistics would), keeping deep
        residual stacks at unit scale instead of growing block by block.
        """
        return self._moments.get(value, 1.0)

    def set_moment(self, value: str, m: float) -> str:
        """Record the estimated mean square of ``value``; returns ``value``."""
        self._moments[value] = float(m)
        return value

    # -- names -------------------------------------------------------------------------------

    def _unique(self, base: str, taken: set[str]) -> str:
        name, k = base, 1
        while name in taken:
            name = f"{base}_{k}"
            k += 1
        taken.add(name)
        return name

    def value_name(self, base: str) -> str:
        """A value name not used yet, ``base`` itself when free."""
        return self._unique(base, self._value_names)

    # -- graph inputs and outputs ------------------------------------------------------------

    def input(self, name: str, shape: Sequence[Dim], elem_type: int = TensorProto.FLOAT) -> str:
        """Declare a graph input; a ``str`` dim is symbolic."""
        name = self.value_name(name)
        self._inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, value: str, shape: Sequence[Dim], elem_type: int = TensorProto.FLOAT) -> str:
        """Declare ``value`` (already produced) as a graph output with a known shape."""
        self._outputs.append(helper.make_tensor_value_info(value, elem_type, list(shape)))
        return value

    # -- initializers ------------------------------------------------------------------------

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Add ``array`` as an initializer under a unique name derived from ``name``."""
        name = self.value_name(name)
        self._initializers.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        return name

    def const(self, name: str, value: object, dtype: type = np.float32) -> str:
        """A small constant initializer; equal constants (same dtype, shape, bytes) are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._consts:
            self._consts[key] = self.initializer(name, array)
        return self._consts[key]

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        """A float32 weight drawn from N(0, std^2) with the builder's seeded stream."""
        array = (self.rng.standard_normal(tuple(shape)) * std).astype(np.float32)
        return self.initializer(name, array)

    def he_weight(self, name: str, shape: Sequence[int], fan_in: int, gain: float = 2.0) -> str:
        """N(0, gain / fan_in): gain 2 before ReLU (He), 1 before a linear use (Xavier/LeCun)."""
        return self.normal(name, shape, math.sqrt(gain / max(fan_in, 1)))

    def bias(self, name: str, size: int, std: float = 0.02) -> str:
        """A small random bias (non-zero, so that bias-folding passes have something to fold)."""
        return self.normal(name, (size,), std)

    def batchnorm_params(self, prefix: str, channels: int, gamma: float = 1.0,
                         input_moment: float = 1.0) -> list[str]:
        """Scale, B, mean, var of a BatchNormalization in inference mode.

        The statistics are random but sensible: var is ``input_moment`` (the estimated mean
        square of the input) times U(0.8, 1.2), mean ~ 0, scale ~ ``gamma``, so the
        normalisation is not an identity and its output has mean square about ``gamma**2``.
        """
        c = (channels,)
        scale = (gamma * self.rng.uniform(0.8, 1.2, c)).astype(np.float32)
        shift = (self.rng.standard_normal(c) * 0.05).astype(np.float32)
        mean = (self.rng.standard_normal(c) * 0.05 * math.sqrt(input_moment)).astype(np.float32)
        var = (input_moment * self.rng.uniform(0.8, 1.2, c)).astype(np.float32)
        return [
            self.initializer(f"{prefix}.scale", scale),
            self.initializer(f"{prefix}.bias", shift),
            self.initializer(f"{prefix}.mean", mean),
            self.initializer(f"{prefix}.var", var),
        ]

    # -- nodes -------------------------------------------------------------------------------

    def op(self, op_type: str, inputs: Sequence[str], name: str, *, out: str | None = None,
           **attrs: object) -> str:
        """Add one single-output node named ``name`` (made unique); returns its output name.

        The output value is named ``out`` when given (e.g. a graph output), else after the node.
        """
        node_name = self._unique(name, self._node_names)
        output = self.value_name(out if out is not None else node_name)
        self._nodes.append(helper.make_node(op_type, list(inputs), [output], name=node_name, **attrs))
        return output

    # -- result ------------------------------------------------------------------------------

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def build(self, args: dict[str, object] | None = None, doc: str = "") -> onnx.ModelProto:
        """The finished ModelProto (opset :data:`OPSET`, producer :data:`PRODUCER_NAME`)."""
        graph = helper.make_graph(self._nodes, self.name, self._inputs, self._outputs,
                                  initializer=self._initializers, doc_string=doc or None)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name=PRODUCER_NAME, producer_version=PRODUCER_VERSION,
                                  ir_version=IR_VERSION)
        if args is not None:
            helper.set_model_props(model, {ARGS_METADATA_KEY: json.dumps(args, sort_keys=True)})
        return model
