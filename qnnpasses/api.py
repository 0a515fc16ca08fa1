"""The public API for pass and plugin authors: everything a pass needs, from one import.

    from qnnpasses.api import Pass, PassContext, PassResult, register_pass, EXACT, constant_value

* the pass protocol: :class:`Pass`, :class:`PassContext`, :class:`PassResult`, :func:`register_pass`;
* contracts (what ``--verify`` holds a pass to): :data:`EXACT`, :func:`approximate`,
  :func:`assumes`, :func:`changes_interface`, and the verification cases;
* graph properties a pass requires or ensures (ordering): :data:`FOLDED`, :data:`STATIC_SHAPES`, ...
  and :func:`register_property` for new ones;
* the IR (:class:`IRModel`), reading a graph (producers, constant values, static shapes), the
  graph-surgery helpers (replace uses, make constants and nodes with fresh names, emit data
  movement) and the attention recognizer (:func:`find_attentions`).

Names here stay stable across releases; the modules they come from may move.  A walk-through:
``docs/plugins.md``.
"""

from __future__ import annotations

from qnnpasses.ir.attention import Attention, ScoreRegion, find_attentions, find_score_region, match_attention
from qnnpasses.ir.model import IRModel
from qnnpasses.ir.read import (
    constant_shape,
    constant_value,
    input_value,
    is_constant,
    is_scalar_constant,
    last_axis,
    normalize_axis,
    producer,
    producer_op,
    scalar,
    single_consumer,
    static_shape,
)
from qnnpasses.passmanager.api import (
    ALL_CASES,
    ATTENTION_REWRITTEN,
    CASE_EXTREME,
    CASE_GIVEN,
    CASE_MASKED,
    CASE_PADDED_LEFT,
    CASE_PADDED_RIGHT,
    CASE_RANDOM,
    CONTRIB_LOWERED,
    DIMS_BOUND,
    EXACT,
    FINITE_MASKS,
    FOLDED,
    GELU_FUSED,
    INT32_INDICES,
    NO_GATHERND,
    NORMS_FINAL,
    NORMS_FUSED,
    STATIC_SHAPES,
    Contract,
    Pass,
    PassContext,
    PassResult,
    approximate,
    assumes,
    changes_interface,
    register_pass,
    register_property,
)
from qnnpasses.passmanager.rewrite import (
    can_replace,
    drop_nodes,
    emit,
    emit_gather,
    emit_reshape,
    emit_slice,
    emit_transpose,
    finish,
    make_constant,
    make_node,
    make_reduce,
    node_key,
    other_input,
    replace_all_uses,
)

__all__ = [
    # the pass protocol
    "Pass", "PassContext", "PassResult", "register_pass",
    # contracts and verification cases
    "Contract", "EXACT", "approximate", "assumes", "changes_interface",
    "ALL_CASES", "CASE_EXTREME", "CASE_GIVEN", "CASE_MASKED", "CASE_PADDED_LEFT", "CASE_PADDED_RIGHT", "CASE_RANDOM",
    # graph properties (ordering)
    "register_property", "ATTENTION_REWRITTEN", "CONTRIB_LOWERED", "DIMS_BOUND", "FINITE_MASKS", "FOLDED",
    "GELU_FUSED", "INT32_INDICES", "NO_GATHERND", "NORMS_FINAL", "NORMS_FUSED", "STATIC_SHAPES",
    # the IR and reading it
    "IRModel", "constant_shape", "constant_value", "input_value", "is_constant", "is_scalar_constant", "last_axis",
    "normalize_axis", "producer", "producer_op", "scalar", "single_consumer", "static_shape",
    # rewriting it
    "can_replace", "drop_nodes", "emit", "emit_gather", "emit_reshape", "emit_slice", "emit_transpose", "finish",
    "make_constant", "make_node", "make_reduce", "node_key", "other_input", "replace_all_uses",
    # the attention recognizer
    "Attention", "ScoreRegion", "find_attentions", "find_score_region", "match_attention",
]
