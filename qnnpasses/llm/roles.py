"""The roles of a KV-cache decoder export's inputs and outputs, as the build and the runtime read them.

Two independent readings, so that one can check the other:

* :func:`export_roles`: from what the graph does (:func:`qnnpasses.ir.kv_roles.find_roles`),
  after onnxruntime's contrib ops are lowered; the build deploys with these;
* :func:`named_roles`: from the Hugging Face names every mainstream exporter writes
  (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/value`` in,
  ``logits``, ``present.{i}.key/value`` out); the reference run of the original export feeds it
  by these, so a wrong structural reading cannot verify itself.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from qnnpasses.ir.kv_roles import Roles, find_roles
from qnnpasses.ir.model import IRModel
from qnnpasses.passmanager.manager import PassManager, RunConfig
from qnnpasses.passmanager.named import CONTRIB_LOWERINGS
from qnnpasses.passmanager.spec import parse_pipeline

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


def pass_records(result) -> list[dict[str, Any]]:
    """A pass manager result's records as the report stores them."""
    return [{"name": r.name, "status": r.status, "reason": r.reason, "stats": r.stats} for r in result.records]


def lower_contrib(ir: IRModel) -> tuple[list[dict[str, Any]], str]:
    """``htp-llm``'s onnxruntime contrib-op lowerings on ``ir`` in place (under the same contracts as in
    ``htp-llm``: nothing lossy); returns their records and the spec of those that changed the graph."""
    result = PassManager(parse_pipeline(",".join(CONTRIB_LOWERINGS)), RunConfig(verify=False, strict=True)).run(ir)
    return pass_records(result), ",".join(r.name for r in result.records if r.changed)


def export_roles(ir: IRModel, given: dict[str, str] | None = None) -> Roles:
    """The roles of an export's I/O, found on what its graph does once the contrib ops are lowered
    (``ir`` is lowered in place: a ``GroupQueryAttention`` hides the Concat of the cache);
    ``given``: roles the user named (``--roles``)."""
    lower_contrib(ir)
    return find_roles(ir.graph, given)


def roles_dict(roles: Roles) -> dict[str, Any]:
    """The I/O roles as the manifest's ``source_roles`` and the reference feed hold them."""
    return {"input_ids": roles.input_ids, "attention_mask": roles.attention_mask, "position_ids": roles.position_ids,
            "logits": roles.logits, "past_key": roles.past_key, "past_value": roles.past_value,
            "present_key": roles.present_key, "present_value": roles.present_value}


def named_roles(inputs: list[str], outputs: list[str]) -> dict[str, Any] | None:
    """The roles the Hugging Face names give (as :func:`roles_dict`, layers in the names' order),
    or None when the export does not use them."""
    past = {(int(m[1]), m[2]): n for n in inputs if (m := _PAST.match(n))}
    present = {(int(m[1]), m[2]): n for n in outputs if (m := _PRESENT.match(n))}
    layers = sorted({layer for layer, _ in past})
    complete = layers == list(range(len(layers))) and set(past) == set(present) == {
        (layer, kind) for layer in layers for kind in ("key", "value")}
    if not layers or not complete or not {"input_ids", "attention_mask"} <= set(inputs) or "logits" not in outputs:
        return None
    return {"input_ids": "input_ids", "attention_mask": "attention_mask",
            "position_ids": "position_ids" if "position_ids" in inputs else None, "logits": "logits",
            **{f"{io}_{kind}": [names[(layer, kind)] for layer in layers]
               for io, names in (("past", past), ("present", present)) for kind in ("key", "value")}}


def reference_roles(inputs: list[str], outputs: list[str], structural: Callable[[], dict[str, Any]],
                    *, trust_names: bool = True) -> dict[str, Any]:
    """How to feed the original export: by its own Hugging Face names where it has them (so a wrong
    structural reading by the build cannot verify itself), else (or when ``trust_names`` is off:
    the user overrode the names with ``--roles``) by ``structural()``; ``fed_by`` says which."""
    named = named_roles(inputs, outputs) if trust_names else None
    if named is None:
        return {**structural(), "fed_by": "structure"}
    return {**named, "fed_by": "names"}
