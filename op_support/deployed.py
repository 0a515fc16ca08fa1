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


def deployed_view(model_path: str | os.PathLike, original_names: list[str]) -> DeployedView:
    """onnxruntime's basic-level optimization of ``model_path`` (CPU provider, no run)."""
    import onnxruntime as ort

    from qnnpasses.errors import BadInputError
    from qnnpasses.ir.load import load_model

    path = Path(model_path)
    if _model_bytes(path) > MAX_VIEW_BYTES:
        return DeployedView(None, note="model over 2 GiB: checked as written (onnxruntime folds constants on load)")
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
        except (BadInputError, Exception) as exc:  # noqa: BLE001 - no view means: check as written
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return DeployedView(None, note=f"onnxruntime could not optimize the model ({first[:120]}): checked as written")
        ir.graph.nodes  # weights stay in the temporary folder: read what the checker needs now
        _materialize(ir)
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
