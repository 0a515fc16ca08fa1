"""decompose-layernorm: LayerNormalizations the HTP rejects (axis not last, rank > 4) => ops it runs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx.parser
import pytest
from conftest import fixture_inputs, fixture_outputs, fixture_path, requires_htp
from pass_testing import op_counts, run_strictly

from qnnpasses.backends.cpu import compare_outputs, cosine_similarity, run_cpu
from qnnpasses.ir.load import load_model
from qnnpasses.ir.model import save_model
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.spec import parse_pipeline


def layernorm(shape: list[int], axis: int, bias: bool = True, extra_outputs: bool = False):
    """A one-node LayerNormalization model (optionally with its Mean/InvStdDev outputs used)."""
    normalized = shape[axis:]
    count = int(np.prod(normalized))
    nshape = ",".join(map(str, normalized))
    inits = f"float[{nshape}] s = {{{','.join(str(1.0 + 0.01 * (i % 7)) for i in range(count))}}}"
    if bias:
        inits += f", float[{nshape}] b = {{{','.join(['0.1'] * count)}}}"
    dims = ",".join(map(str, shape))
    stat_dims = ",".join(map(str, shape[:axis % len(shape)] + [1] * len(normalized)))
    outputs = f"float[{dims}] y" + (f", float[{stat_dims}] mean, float[{stat_dims}] inv" if extra_outputs else "")
    node = f"{'y, mean, inv' if extra_outputs else 'y'} = LayerNormalization<axis={axis}, epsilon=1e-5>(x, s{', b' if bias else ''})"
    return onnx.parser.parse_model(
        f'<ir_version: 8, opset_import: ["" : 17]> g (float[{dims}] x) => ({outputs}) <{inits}> {{ {node} }}')


def rewrite(source, spec: str = "decompose-layernorm", inputs=None):
    return run_strictly(source, spec, inputs)

ops = op_counts


def test_axis_not_last_is_flattened_onto_a_last_axis_layernorm():
    ir, record = rewrite(layernorm([2, 8, 16], axis=1))
    assert record.stats == {"reshaped": 1, "decomposed": 0, "kept_native": 0}
    assert ops(ir) == Counter({"Reshape": 2, "LayerNormalization": 1})
    node = next(n for n in ir.graph.nodes if n.op == "LayerNormalization")
    assert node.attrs["axis"] == -1 and node.inputs[0].shape == [2, 128] and node.inputs[1].shape == (128,)


def test_rank5_reshaped_and_primitives_when_asked():
    ir, record = rewrite(layernorm([1, 2, 2, 4, 16], axis=-1))
    assert record.stats["reshaped"] == 1 and ops(ir)["LayerNormalization"] == 1
    ir, record = rewrite(layernorm([1, 2, 2, 4, 16], axis=-1, bias=False), "decompose-layernorm{strategy=primitives}")
    assert record.stats["decomposed"] == 1 and "LayerNormalization" not in ops(ir)
    assert ops(ir)["ReduceMax"] == 1 and ops(ir)["Pow"] == 0  # the fp16-safe form


def test_supported_layernorm_is_kept_unless_always():
    _, record = rewrite(layernorm([1, 8, 64], axis=-1))
    assert not record.changed and record.stats["kept_native"] == 1
    ir, record = rewrite(layernorm([1, 8, 64], axis=-1), "decompose-layernorm{when=always,strategy=primitives,form=plain}")
    assert record.stats["decomposed"] == 1 and ops(ir)["ReduceMean"] == 2 and ops(ir)["Sqrt"] == 1


def test_used_statistics_outputs_block_the_rewrite():
    ir = load_model(layernorm([2, 8, 16], axis=1, extra_outputs=True))
    result = PassManager(parse_pipeline("decompose-layernorm"), RunConfig(strict=True)).run(ir).records[-1]
    assert not result.changed and any("Mean/InvStdDev" in n for n in result.notes)


@pytest.mark.parametrize("name", ["bert_ts", "bert_dynamo", "gpt2_ts", "gpt2_dynamo"])
@pytest.mark.parametrize("strategy", ["reshape", "primitives"])
def test_fixtures_with_when_always(name, strategy):
    ir, record = rewrite(fixture_path(name), f"decompose-layernorm{{when=always,strategy={strategy}}}", fixture_inputs(name))
    assert record.stats["reshaped" if strategy == "reshape" else "decomposed"] == 5
    comparison = compare_outputs(fixture_outputs(name), run_cpu(ir, fixture_inputs(name)))
    assert comparison.max_abs <= 1e-4, comparison.failure()


@pytest.mark.parametrize("name", ["bert_ts", "gpt2_dynamo"])
def test_fixture_layernorms_are_all_htp_supported_so_nothing_changes(name):
    _, record = rewrite(fixture_path(name), inputs=fixture_inputs(name))
    assert not record.changed and record.stats["kept_native"] == 5


@requires_htp
@pytest.mark.parametrize("shape, axis", [([1, 8, 64], 1), ([1, 2, 2, 4, 64], -1)], ids=["axis-1", "rank-5"])
def test_rejected_layernorm_moves_to_the_htp(tmp_path, shape, axis):
    from qnnpasses.backends.htp import probe_placement, run_on_htp

    raw_ir = load_model(layernorm(shape, axis))
    raw = save_model(raw_ir, tmp_path / "raw.onnx")
    assert probe_placement(raw).cpu_nodes == [raw_ir.graph.nodes[0].name]
    ir, _ = rewrite(raw)
    fixed = save_model(ir, tmp_path / "fixed.onnx")
    x = {"x": (np.random.default_rng(0).standard_normal(shape) * 3).astype(np.float32)}
    placement = probe_placement(fixed, inputs=x)
    assert placement.ok and placement.qnn_partitions == 1 and placement.cpu_nodes == []
    assert cosine_similarity(run_on_htp(fixed, x)["y"], run_cpu(raw, x)["y"]) >= 0.9999
