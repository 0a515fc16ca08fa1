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


def onnxruntime_graph(model):
    """A graphsurgeon graph with the shapes onnxruntime infers when it loads ``model`` (a
    ModelProto): ONNX's per-op inference *without* data propagation.  Where that leaves a
    shape unknown (a Reshape target computed from a Shape), the QNN EP answers "Cannot get
    shape" -- although ``onnx.shape_inference`` with ``data_prop=True`` would know it."""
    import onnx
    import onnx_graphsurgeon as gs

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    del proto.graph.value_info[:]
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=False)
    except Exception:  # noqa: BLE001 - inference trouble: check what the file declares
        pass
    return gs.import_onnx(proto)


@dataclass
class GraphView:
    """What the checker reads: ``graph`` (and ``opset`` through it)."""

    graph: object


def deployed_view(model_path: str | os.PathLike, original_names: list[str], *, fold: bool = True) -> DeployedView:
    """The graph the EP is handed: onnxruntime's basic-level optimization of ``model_path``
    (CPU provider, no run) with ``fold``, else the graph as written, shaped as onnxruntime
    shapes it."""
    import onnx
    import onnxruntime as ort

    path = Path(model_path)
    if _model_bytes(path) > MAX_VIEW_BYTES:
        return DeployedView(None, note="model over 2 GiB: checked with the loader's shapes (onnxruntime folds "
                                       "constants on load)")
    if not fold:
        return DeployedView(GraphView(onnxruntime_graph(onnx.load(path))))
    with tempfile.TemporaryDirectory(prefix="qnnpasses-deployed-") as tmp:
        out = Path(tmp) / "deployed.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(out)
        so.log_severity_level = 3
        try:
            ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
            graph = onnxruntime_graph(onnx.load(out))
        except Exception as exc:  # noqa: BLE001 - no view means: check as written
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return DeployedView(None, note=f"onnxruntime could not optimize the model ({first[:120]}): checked as written")
    kept = {n.name for n in graph.nodes}
    return DeployedView(GraphView(graph), folded=[name for name in original_names if name not in kept])
