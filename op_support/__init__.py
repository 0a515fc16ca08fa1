"""Backend op-support tables (measured on the real QNN HTP) and the checker that reads them.

``check_node`` / ``check_graph`` predict per-node placement from ``tables/htp.json``;
``probe_models`` rebuilds the single-op models the table was measured with.
"""

from .checker import (
    GraphSummary,
    NodeSupport,
    check_graph,
    check_node,
    predicted_partitions,
    summarize,
)
from .table import load_table, lookup

__all__ = [
    "GraphSummary",
    "NodeSupport",
    "check_graph",
    "check_node",
    "load_table",
    "lookup",
    "predicted_partitions",
    "summarize",
]
