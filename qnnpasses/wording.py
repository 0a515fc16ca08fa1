"""Backend and table messages restated for people: no placeholders, no backend codes.

The op-support table and the QNN EP speak in their own terms (``ConstantOfShape node
`<node>` will not be assigned``, ``validateNativeOps master op validator
<node>:qti.aisw:Shape failed 3110``, shapes like ``unk__0xunk__1x16x16``).  Every command
shows reasons through :func:`explain`, so one node gets one wording everywhere.
"""

from __future__ import annotations

import re

_UNK_DIM = re.compile(r"unk__\d+")
_VALIDATOR = re.compile(r"(?:Failed to add node\.\s*)?\[backend: validateNativeOps master op validator "
                        r"[^\]]*?:qti\.aisw:(\w+) failed \d+\]")
_NOT_ASSIGNED = re.compile(r"Operators of type `(\w+)` are not supported by QNN EP\.\s*\w+ node `[^`]*` will not be "
                           r"assigned to QNN EP\.")
_BACKEND_CODE = re.compile(r"\s*\[backend: [^\]]*\]")
_CANNOT_GET_SHAPE = re.compile(r";\s*the EP answers 'Cannot get shape'")
_STATIC_ADVICE = re.compile(r"QNN needs static shapes \(fix the input shapes first\)")


def dims(text: str) -> str:
    """``unk__0xunk__1x16x16`` -> ``?x?x16x16`` (a dimension shape inference could not name)."""
    return _UNK_DIM.sub("?", text)


def explain(reason: str, node: str | None = None, *, static_inputs: bool = False) -> str:
    """One reason why a node stays off the HTP, in plain words."""
    text = _NOT_ASSIGNED.sub(lambda m: f"the QNN EP has no {m.group(1)} op", reason)
    text = _VALIDATOR.sub(lambda m: f"the HTP backend rejects this {m.group(1)} (its op validation fails)", text)
    text = _BACKEND_CODE.sub("", text)
    text = _CANNOT_GET_SHAPE.sub("", text)
    if static_inputs:
        text = _STATIC_ADVICE.sub("its size is computed at run time by shape arithmetic; constant folding "
                                  "(`qnnpasses run`, or the simplify pass) makes it static", text)
    else:
        text = _STATIC_ADVICE.sub("the HTP needs static shapes (give the inputs static shapes with --shape)", text)
    if node:
        text = text.replace("`<node>`", f"`{node}`").replace("<node>", node)
    else:
        text = text.replace(" `<node>`", "").replace(" <node>", "")
    return dims(text).strip()


__all__ = ["dims", "explain"]
