"""lower-cast-to-bool: Cast(float -> bool) => Not(Equal(x, 0)), exactly (NaN, -0.0, inf included)."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import run_cpu
from qnnpasses.ir.load import load_model


@pytest.mark.parametrize("dtype", ["float", "float16"])
def test_cast_to_bool_becomes_not_equal_zero(dtype):
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
        g ({dtype}[2, 8] x) => (bool[2, 8] y, int32[2, 8] z) {{
            y = Cast<to = 9>(x)
            z = Cast<to = 6>(y)
        }}""")
    ir, record = run_strictly(model, "lower-cast-to-bool")
    assert record.stats == {"lowered": 1} and op_counts(ir) == {"Equal": 1, "Not": 1, "Cast": 1}
    np_dtype = np.float32 if dtype == "float" else np.float16
    special = np.array([[0.0, -0.0, np.nan, np.inf, -np.inf, 1e-3, -3.0, 65504.0]] * 2, dtype=np_dtype)
    expected, got = run_cpu(load_model(model), {"x": special}), run_cpu(ir, {"x": special})
    assert np.array_equal(got["y"], expected["y"]) and np.array_equal(got["z"], expected["z"])
