"""The graph input and output names of the bundles other runtimes load (onnxruntime-genai, Genie).

Qualcomm's own LLM bundles name them ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_{i}_in`` / ``past_value_{i}_in`` and ``logits``, ``past_key_{i}_out`` /
``past_value_{i}_out`` (the new tokens' K/V); Genie finds tensors by these names, and
onnxruntime-genai's configuration takes them as ``%d`` patterns.
"""

from __future__ import annotations

from typing import Any

from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.api import PassContext

NAMES = {"past_key": "past_key_{}_in", "past_value": "past_value_{}_in",
         "new_key": "past_key_{}_out", "new_value": "past_value_{}_out"}
SINGLE = ("input_ids", "attention_mask", "position_ids", "logits")


def rename_io(ir: IRModel, roles: dict[str, Any]) -> dict[str, Any]:
    """Give the graph's inputs and outputs the bundle names (module docstring); the roles renamed.

    Inner tensors that hold one of those names step aside first; the renaming goes through fresh
    names, so two boundary tensors can trade names."""
    wanted: dict[str, str] = {}
    for role in SINGLE:
        if roles.get(role):
            wanted[roles[role]] = role
    for role, pattern in NAMES.items():
        for layer, name in enumerate(roles[role]):
            wanted[name] = pattern.format(layer)
    boundary = {t.name: t for t in [*ir.graph.inputs, *ir.graph.outputs]}
    ctx = PassContext()
    clash = [t for t in ir.graph.tensors().values() if t.name in set(wanted.values()) and t.name not in wanted]
    for tensor in clash:  # an inner tensor holding a name the boundary needs steps aside
        tensor.name = ctx.unique_name(ir, f"{tensor.name}.inner")
    for old in wanted:  # two steps: a swap of two names never meets itself
        boundary[old].name = ctx.unique_name(ir, f"{old}.renaming")
    for old, new in wanted.items():
        boundary[old].name = new
    renamed = dict(roles)
    for role in SINGLE:
        if roles.get(role):
            renamed[role] = role
    for role, pattern in NAMES.items():
        renamed[role] = [pattern.format(i) for i in range(len(roles[role]))]
    renamed["logits_offset"] = roles.get("logits_offset")  # not a bundle name: kept
    return renamed
