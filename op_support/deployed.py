"""The graph the QNN EP is actually handed: the model after onnxruntime's basic optimizations.

Every onnxruntime session (``compile``, ``diagnose``, ``run --emit``, the application on
the device) applies the *basic* graph optimizations -- constant folding (including shape
arithmetic on static shapes), redundant-node elimination, Conv+BatchNorm/Add/Mul fusion --
before it partitions the graph between execution providers.  A ``Shape -> ... ->
ConstantOfShape -> Expand`` chain that the op-support table rejects node by node never
reaches the EP when its shapes are static: it is folded first.  Checking the graph as
written therefore predicts CPU nodes that no session ever sees; :func:`deployed_view`
produces what the EP sees, so ``check``, ``check --on htp``, ``lint`` and ``compile`` give
one verdict.  Node names survive these optimizations (fused nodes keep the name of the
node they absorb), so per-node verdicts of the real backend can be compared with it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

#: Above this, building onnxruntime's view would load every weight into memory: the graph
#: is checked as written instead (and the report says so).
MAX_VIEW_BYTES = 2 * 2**30


@dataclass
class DeployedView:
    """``ir``: the optimized graph (None when it could not be built, see ``note``);
    ``folded``: names of nodes onnxruntime folds or removes before the EP sees the graph."""

    ir: object | None
    folded: list[str] = field(default_factory=list)
    note: str = ""


def _model_bytes(path: Path) -> int:
    size = path.stat().st_size
    import onnx

    model = onnx.load(path, load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return size + sum((path.parent / loc).stat().st_size for loc in locations if (path.parent / loc).exists())


def onnxruntime_shapes(model, base_dir: Path | None = None) -> dict[str, list] | None:
    """The shape onnxruntime itself infers for every node output of ``model`` (a ModelProto),
    or None when onnxruntime cannot load it.  ``base_dir``: the folder of ``model``'s external
    data (not loaded); the probe model is written there, else passed in memory.

    onnxruntime's inference is ONNX's per-op inference plus its own partial data
    propagation (Shape -> Gather/Concat -> Reshape/Expand ...), which neither
    ``onnx.shape_inference`` mode reproduces; the QNN EP reads exactly these shapes and
    refuses a node whose shape is unknown ("Cannot get shape").  Asked by loading the model
    (optimizations off, nothing run) with every node output made a graph output: a dim is
    an int, a name (symbolic) or None (unknown).  onnxruntime reports an unknown shape and a
    scalar's alike (``[]``): :func:`onnxruntime_graph` keeps ONNX's answer for those.
    """
    import onnx
    import onnxruntime as ort

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    outputs = {o.name for o in proto.graph.output}
    inputs = {i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer}
    for node in proto.graph.node:
        for name in node.output:
            if name and name not in outputs and name not in inputs:
                proto.graph.output.add().name = name
                outputs.add(name)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        if base_dir is not None:
            probe = base_dir / "qnnpasses-shapes.onnx"
            onnx.save(proto, probe)
            source = str(probe)
        else:
            source = proto.SerializeToString()
        session = ort.InferenceSession(source, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - onnxruntime cannot load it: no shapes from it
        return None
    return {arg.name: list(arg.shape or []) for arg in [*session.get_inputs(), *session.get_outputs()]}


def onnxruntime_graph(model, base_dir: Path | None = None):
    """A graphsurgeon graph of ``model`` (a ModelProto) with the shapes onnxruntime infers
    when it loads it (:func:`onnxruntime_shapes`; where onnxruntime cannot load the model,
    ONNX's per-op inference without data propagation).  Dtypes come from ONNX's inference."""
    import onnx
    import onnx_graphsurgeon as gs

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    del proto.graph.value_info[:]
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=False)
    except Exception:  # noqa: BLE001 - inference trouble: check what the file declares
        pass
    graph = gs.import_onnx(proto)
    shapes = onnxruntime_shapes(model, base_dir)
    if shapes is not None:
        for name, tensor in graph.tensors().items():
            shape = shapes.get(name)
            if isinstance(tensor, gs.Variable) and shape:  # [] is a scalar or unknown: ONNX's answer stands
                tensor.shape = ["?" if d is None else d for d in shape]
    return graph


def _with_onnxruntime_shapes(ir, graph) -> None:
    """Give ``ir``'s tensors the shapes (and known dtypes) of ``graph``, the same model shaped
    by :func:`onnxruntime_graph`."""
    import onnx_graphsurgeon as gs

    shaped = graph.tensors()
    for name, tensor in ir.graph.tensors().items():
        source = shaped.get(name)
        if isinstance(tensor, gs.Variable) and isinstance(source, gs.Variable):
            tensor.shape = source.shape
            if source.dtype is not None:
                tensor.dtype = source.dtype


def deployed_view(model_path: str | os.PathLike, original_names: list[str], *, fold: bool = True) -> DeployedView:
    """The graph the EP is handed, as an IRModel shaped as onnxruntime shapes it: with
    ``fold``, onnxruntime's basic-level optimization of ``model_path`` (CPU provider, no
    run); else the graph as written."""
    import onnx
    import onnxruntime as ort

    from qnnpasses.errors import BadInputError
    from qnnpasses.ir.load import load_model

    path = Path(model_path)
    if _model_bytes(path) > MAX_VIEW_BYTES:
        return DeployedView(None, note="model over 2 GiB: checked with the loader's shapes (onnxruntime folds "
                                       "constants on load)")
    if not fold:
        try:
            ir = load_model(path)
        except BadInputError as exc:
            return DeployedView(None, note=f"{exc}: checked as loaded")
        _with_onnxruntime_shapes(ir, onnxruntime_graph(onnx.load(path)))
        return DeployedView(ir)
    with tempfile.TemporaryDirectory(prefix="qnnpasses-deployed-") as tmp:
        out = Path(tmp) / "deployed.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(out)
        so.log_severity_level = 3
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "deployed.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
            ir = load_model(out)
            graph = onnxruntime_graph(onnx.load(out, load_external_data=False), base_dir=Path(tmp))
        except Exception as exc:  # noqa: BLE001 - BadInputError included: no view means: check as written
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return DeployedView(None, note=f"onnxruntime could not optimize the model ({first[:120]}): checked as written")
        _with_onnxruntime_shapes(ir, graph)
        _materialize(ir)  # weights stay in the temporary folder: read what the checker needs now
    kept = {n.name for n in ir.graph.nodes}
    return DeployedView(ir, folded=[name for name in original_names if name not in kept])


def _materialize(ir) -> None:
    """Read constants whose values live in the temporary folder (the checker reads only
    small ones, but graphsurgeon constants must not point at deleted files)."""
    import numpy as np
    import onnx_graphsurgeon as gs

    attribute_constants = [v for n in ir.graph.nodes for v in n.attrs.values() if isinstance(v, gs.Constant)]
    for tensor in [*ir.graph.tensors().values(), *attribute_constants]:  # Constant nodes hold theirs in attrs
        if isinstance(tensor, gs.Constant):
            try:
                tensor.values = np.array(tensor.values)  # a copy: a memory-mapped view would keep pointing at the deleted file
            except Exception:  # noqa: BLE001 - an unreadable constant only loses its value
                continue
