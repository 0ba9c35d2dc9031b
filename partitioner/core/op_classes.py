"""The one op-class table: which ONNX op types behave alike, for the rooms that group ops.

Rules:
1. Each set names one behaviour, and every room that needs it imports it from here: the split
   rules (:mod:`partitioner.strategies.axis_rules`), the cost model (:mod:`partitioner.cost.ops`,
   :mod:`partitioner.cost.workdepth`) and the fusion passes (:mod:`passes.group_elementwise`,
   :mod:`passes.fuse_bias_activation`).
2. Where a room needs a slightly different grouping, it composes these sets (e.g. the cost
   model's views are ``RESHAPES | {"Dropout"}``: a dropout at inference moves no data) rather than
   declaring its own copy, so adding an op to a family is one edit.
"""

from __future__ import annotations

#: two-input elementwise ops with numpy broadcasting.
BINARY = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "And", "Or", "Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
})
#: elementwise ops over any number of broadcast inputs.
VARIADIC = frozenset({"Sum", "Max", "Min", "Mean"})
#: every broadcasting elementwise op (what a split rule treats as "elementwise").
ELEMENTWISE = BINARY | VARIADIC | {"Where", "PRelu"}
#: one-input elementwise ops.
UNARY = frozenset({
    "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Cast", "Clip", "Identity",
    "Dropout", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Gelu",
    "Not", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Tan", "IsNaN", "IsInf",
    "Mish", "ThresholdedRelu", "Celu", "CastLike", "BitwiseNot", "Shrink", "Asin", "Acos", "Atan",
    "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
})
#: one-input elementwise ops the elementwise-grouping pass fuses (numpy-evaluable, float).
FUSABLE_UNARY = frozenset({
    "Abs", "Ceil", "Clip", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish",
    "LeakyRelu", "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin",
    "Softplus", "Softsign", "Sqrt", "Tanh",
})
#: two-input elementwise ops the elementwise-grouping pass fuses.
FUSABLE_BINARY = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu", "And", "Or", "Equal", "Less", "Greater"}
)
#: contractions a bias and an activation fuse into.
CONTRACTIONS = frozenset({"Conv", "MatMul", "Gemm"})
#: activations that fuse into a contraction.
FUSABLE_ACTIVATIONS = frozenset(
    {"Relu", "Clip", "Sigmoid", "Tanh", "Gelu", "LeakyRelu", "HardSigmoid", "Elu", "Softplus"}
)
SOFTMAX_LIKE = frozenset({"Softmax", "LogSoftmax", "Hardmax"})
POOLS = frozenset({"MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
#: reductions that keep or drop the reduced axes.
REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                        "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})
ARG_REDUCTIONS = frozenset({"ArgMax", "ArgMin"})
#: ops that only reinterpret the shape of their data (no element moves).
RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: views for the split rules: a transpose moves axes, which the rules follow like a reshape.
SPLIT_VIEWS = RESHAPES | {"Transpose"}
#: views for the cost model: free at run time (a dropout at inference is an identity).
COST_VIEWS = RESHAPES | {"Dropout"}
#: ops that cost nothing (constants and shape queries).
FREE = frozenset({"Constant", "Shape", "Size"})
#: ops that copy or rearrange data without arithmetic.
COPIES = frozenset({"Concat", "Transpose", "Pad", "Split", "Expand", "Tile", "Cast", "DepthToSpace",
                    "SpaceToDepth", "CastLike", "ConstantOfShape", "Range", "NonZero", "ScatterND",
                    "ScatterElements", "OneHot", "Trilu", "CumSum", "TopK"})
#: ops whose outputs are random: never folded into constants.
RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli"})
