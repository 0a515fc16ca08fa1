"""The shared helpers that let a rewrite decide once per repeated sub-graph without reading
weights: ``node_key`` (what a node computes from its variable inputs) and ``constant_shape``."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.ir.model import DerivedValues
from qnnpasses.passmanager.rewrite import constant_shape, node_key


def _reshape(target, dtype=np.int64, **attrs) -> gs.Node:
    x, y = gs.Variable("x", dtype=np.float32, shape=[2, 6]), gs.Variable("y", dtype=np.float32)
    return gs.Node("Reshape", inputs=[x, gs.Constant("t", np.asarray(target, dtype=dtype))], outputs=[y],
                   attrs=attrs)


def test_node_key_is_equal_for_the_same_computation_and_differs_for_another():
    assert node_key(_reshape([3, 4])) == node_key(_reshape([3, 4]))
    assert hash(node_key(_reshape([3, 4])))
    assert node_key(_reshape([3, 4])) != node_key(_reshape([4, 3]))
    assert node_key(_reshape([3, 4])) != node_key(_reshape([3, 4], np.int32))
    assert node_key(_reshape([3, 4])) != node_key(_reshape([3, 4], allowzero=1))


def test_node_key_tells_signed_zeros_apart_and_gives_up_on_tensor_attributes():
    def leaky(alpha):
        return gs.Node("LeakyRelu", inputs=[gs.Variable("x")], outputs=[gs.Variable("y")], attrs={"alpha": alpha})

    assert node_key(leaky(0.0)) != node_key(leaky(-0.0))
    assert node_key(leaky(0.5)) == node_key(leaky(0.5))
    constant = gs.Node("Constant", outputs=[gs.Variable("c")], attrs={"value": gs.Constant("v", np.zeros(2))})
    assert node_key(constant) is None


def test_constant_shape_does_not_compute_a_derived_weight():
    computed = []
    values = DerivedValues((4, 3), np.float32, lambda: computed.append(1) or np.zeros((4, 3), np.float32))
    weight = gs.Constant("w", values)
    assert constant_shape(weight) == (4, 3)
    assert computed == [] and isinstance(weight._values, DerivedValues)
    node = gs.Node("Constant", outputs=[gs.Variable("c")],
                   attrs={"value": gs.Constant("v", np.zeros((2, 5), np.float32))})
    assert constant_shape(node.outputs[0]) == (2, 5)
    assert constant_shape(gs.Variable("x", dtype=np.float32, shape=[2, 5])) is None
