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
from dataclasses import dataclass
from typing import Any

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


@dataclass
class NamedRoles:
    """Roles read from Hugging Face names (layer order from the names' indices)."""

    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits: str
    past: list[str]      # keys of every layer, then values of every layer
    present: list[str]   # in the same order


def named_roles(inputs: list[str], outputs: list[str]) -> NamedRoles | None:
    """The roles the Hugging Face names give, or None when the export does not use them."""
    past = {(int(m[1]), m[2]): n for n in inputs if (m := _PAST.match(n))}
    present = {(int(m[1]), m[2]): n for n in outputs if (m := _PRESENT.match(n))}
    layers = sorted({layer for layer, _ in past})
    complete = layers == list(range(len(layers))) and set(past) == set(present) == {
        (layer, kind) for layer in layers for kind in ("key", "value")}
    if not layers or not complete or not {"input_ids", "attention_mask"} <= set(inputs) or "logits" not in outputs:
        return None
    order = [(layer, "key") for layer in layers] + [(layer, "value") for layer in layers]
    return NamedRoles(input_ids="input_ids", attention_mask="attention_mask",
                      position_ids="position_ids" if "position_ids" in inputs else None, logits="logits",
                      past=[past[k] for k in order], present=[present[k] for k in order])
