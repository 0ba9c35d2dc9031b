"""Reading onnx-ir values in a pass: the constant a value holds.

Rules:
1. A value holds a constant when it is an initializer that is not also a graph input (a graph
   input's value is the caller's, whatever its default) or a ``Constant`` node's output
   (``onnx_ir.convenience.get_const_tensor``); :func:`const_array` returns it as numpy, else None.
2. :func:`scalar_const` is the number a one-element floating constant holds, else None.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """Rule 1."""
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def scalar_const(value: ir.Value | None) -> float | None:
    """Rule 2: the number a one-element floating constant (initializer or ``Constant`` output) holds."""
    array = const_array(value)
    if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    return float(array.reshape(()))
