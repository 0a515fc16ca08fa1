"""Kinds of ONNX ops: the one table every pass, analysis and rule asks.

* :data:`ELEMENTWISE`: each output element depends on the inputs' elements at the same
  (broadcast) index only, with no attribute naming an axis; a permutation or a reshape of the
  inputs commutes with the op.
* :data:`REDUCTIONS`: the ``Reduce*`` family (``axes``, ``keepdims``).
* :data:`RESHAPES` keep every element in order and change only the shape; :data:`VIEWS` add
  ``Identity``; :data:`LAYOUT` adds ``Transpose`` (every element kept, the order may change).
* :data:`DATA_MOVEMENT`: ops that select, copy or rearrange elements and compute nothing.

A module that needs a narrower set (the ops a pattern may be written with) names it next to the
pattern, as a subset of these where it can.
"""

from __future__ import annotations

ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "Where",
    "And", "Or", "Xor", "Not", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf",
    "Neg", "Abs", "Sign", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Floor", "Ceil", "Round", "BitShift",
    "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Tanh",
    "Sigmoid", "HardSigmoid", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "ThresholdedRelu",
    "Gelu", "HardSwish", "Softplus", "Softsign", "Mish", "Clip", "Cast", "Identity",
})
REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                        "ReduceSumSquare", "ReduceLogSumExp"})
RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
VIEWS = RESHAPES | {"Identity"}
LAYOUT = VIEWS | {"Transpose"}
DATA_MOVEMENT = LAYOUT | {
    "Gather", "GatherND", "GatherElements", "Concat", "Slice", "Split", "Expand", "Tile", "Pad", "ScatterND",
    "ScatterElements", "DepthToSpace", "SpaceToDepth", "Trilu", "Shape", "Size", "Constant", "ConstantOfShape",
    "Range", "NonZero", "CastLike", "EyeLike", "Dropout", "Resize",
}
