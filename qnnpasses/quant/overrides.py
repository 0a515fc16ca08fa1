"""The chosen quantization as ``--quantization_overrides`` JSON for ``qnn-onnx-converter``.

The converter reads AIMET's encoding files.  Two layouts exist (AIMET "Encoding Format
Specification", https://quic.github.io/aimet-pages/releases/latest/techniques/encoding_spec.html;
the same fields appear in the schema tests of Qualcomm's FastForward exporter,
``Qualcomm-AI-research/fastforward``, ``tests/export/test_export_schemas.py``):

* **1.0.0** (written by default)::

      {"version": "1.0.0",
       "activation_encodings": [{"name", "dtype": "INT", "enc_type": "PER_TENSOR",
                                  "is_sym", "bw", "scale": [s], "offset": [o]}, ...],
       "param_encodings":      [{... "enc_type": "PER_CHANNEL", "scale": [s0, s1, ...],
                                  "offset": [o0, o1, ...]}, ...],
       "excluded_layers": [], "quantizer_args": {...}}

* **2.0.0** (AIMET's current layout, one entry per tensor shaped like an ONNX ``QuantizeLinear``:
  its output type, ``y_scale``, ``y_zero_point``, ``axis`` and ``block_size``; written next to
  the 1.0.0 file by ``qnnpasses quantize --overrides``)::

      {"version": "2.0.0",
       "encodings": [{"name", "output_dtype": "uint16", "y_scale": s, "y_zero_point": z},
                     {"name", "output_dtype": "int4", "y_scale": [s0, ...], "y_zero_point": [0, ...], "axis": 1},
                     {"name", "output_dtype": "int4", "y_scale": [[...], ...], "axis": 0, "block_size": 64}]}

  Zero points are those of the ONNX type (not AIMET offsets), omitted when all zero.

* **0.6.1** (legacy)::

      {"version": "0.6.1",
       "activation_encodings": {name: [{"bitwidth", "dtype": "int", "is_symmetric": "True"|"False",
                                        "min", "max", "scale", "offset"}]},
       "param_encodings": {name: [one dict per channel]}, "quantizer_args": {...}}

AIMET's offset is the negated zero point of the *unsigned* grid: ``x = scale * (q + offset)``
with ``q`` in ``[0, 2**bw - 1]``.  A uint8/uint16 zero point ``z`` is offset ``-z``; a
signed symmetric int8 (int16) tensor, zero point 0 on ``[-128, 127]``, is offset ``-128``
(``-32768``).  Encodings are read from the QDQ model that onnxruntime made, so the
converter reproduces exactly what was measured on the HTP.  Names are those of the
prepared float model (written next to the QDQ model as ``*.prepared.onnx``), which is what
the converter must be given: an activation's name is its QuantizeLinear's input, a
weight's name is its initializer's name before quantization.  Where a tensor is converted
between widths (Q -> DQ -> Q), the producer's encoding is the one recorded.  int32 biases are
left out: the converter derives them as input scale x weight scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from qnnpasses.errors import BadInputError

VERSIONS = ("1.0.0", "0.6.1", "2.0.0")
#: ONNX element type -> (AIMET bitwidth, signed, 2.0.0 output_dtype)
_INT_TYPES = {onnx.TensorProto.INT4: (4, True, "int4"), onnx.TensorProto.UINT4: (4, False, "uint4"),
              onnx.TensorProto.INT8: (8, True, "int8"), onnx.TensorProto.UINT8: (8, False, "uint8"),
              onnx.TensorProto.INT16: (16, True, "int16"), onnx.TensorProto.UINT16: (16, False, "uint16")}
#: onnxruntime renames a graph output's float producer to ``<output>_QuantizeLinear_Input``.
_OUTPUT_SUFFIX = "_QuantizeLinear_Input"

#: JSON schema of the 1.0.0 layout as written here (the tests validate every file against it).
SCHEMA_V1: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["version", "activation_encodings", "param_encodings"],
    "properties": {
        "version": {"const": "1.0.0"},
        "activation_encodings": {"type": "array", "items": {"$ref": "#/$defs/encoding"}},
        "param_encodings": {"type": "array", "items": {"$ref": "#/$defs/encoding"}},
        "excluded_layers": {"type": "array", "items": {"type": "string"}},
        "quantizer_args": {"type": "object"},
    },
    "$defs": {
        "encoding": {
            "type": "object",
            "required": ["name", "dtype", "enc_type", "is_sym", "bw", "scale", "offset"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "dtype": {"enum": ["INT", "FLOAT"]},
                "enc_type": {"enum": ["PER_TENSOR", "PER_CHANNEL"]},
                "is_sym": {"type": "boolean"},
                "bw": {"enum": [4, 8, 16, 32]},
                "scale": {"type": "array", "minItems": 1, "items": {"type": "number", "exclusiveMinimum": 0}},
                "offset": {"type": "array", "minItems": 1, "items": {"type": "number"}},
            },
        }
    },
}


#: JSON schema of the 2.0.0 layout as written here.
SCHEMA_V2: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["version", "encodings"],
    "properties": {"version": {"const": "2.0.0"}, "encodings": {"type": "array", "items": {"$ref": "#/$defs/enc"}}},
    "$defs": {
        "nested": {"anyOf": [{"type": "number"}, {"type": "array", "items": {"$ref": "#/$defs/nested"}}]},
        "enc": {
            "type": "object",
            "required": ["name", "output_dtype", "y_scale"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "output_dtype": {"enum": ["int4", "uint4", "int8", "uint8", "int16", "uint16"]},
                "y_scale": {"$ref": "#/$defs/nested"},
                "y_zero_point": {"$ref": "#/$defs/nested"},
                "axis": {"type": "integer"},
                "block_size": {"type": "integer", "minimum": 1},
            },
        },
    },
}


@dataclass
class Encoding:
    """One tensor's quantization in AIMET terms."""

    name: str
    bw: int
    scale: list[float]
    offset: list[int]
    is_sym: bool
    param: bool
    axis: int | None = None
    output_dtype: str = ""  # the ONNX quantized type (2.0.0)
    zero_point: list[int] | None = None  # in that type (2.0.0)
    scale_shape: tuple[int, ...] = ()  # () per tensor, (C,) per channel, (B, C) per block
    block_size: int = 0

    def v1(self) -> dict[str, Any]:
        kind = "PER_BLOCK" if self.block_size else "PER_CHANNEL" if len(self.scale) > 1 else "PER_TENSOR"
        entry = {"name": self.name, "dtype": "INT", "enc_type": kind, "is_sym": self.is_sym, "bw": self.bw,
                 "scale": self.scale, "offset": [float(o) for o in self.offset]}
        if self.block_size:
            entry["block_size"] = self.block_size
        return entry

    def v2(self) -> dict[str, Any]:
        shape = self.scale_shape if len(self.scale) > 1 else ()
        nest = (lambda v: np.asarray(v).reshape(shape).tolist()) if shape else (lambda v: v[0])
        entry: dict[str, Any] = {"name": self.name, "output_dtype": self.output_dtype, "y_scale": nest(self.scale)}
        zero = self.zero_point or [0]
        if any(zero):
            entry["y_zero_point"] = nest(zero)
        if shape:
            entry["axis"] = self.axis
        if self.block_size:
            entry["block_size"] = self.block_size
        return entry

    def legacy(self) -> list[dict[str, Any]]:
        top = 2 ** self.bw - 1
        return [{"bitwidth": self.bw, "dtype": "int", "is_symmetric": str(self.is_sym), "scale": s, "offset": int(o),
                 "min": s * o, "max": s * (top + o)} for s, o in zip(self.scale, self.offset)]


def _encoding(name: str, scale: np.ndarray, zero_point: np.ndarray, elem_type: int, param: bool,
              axis: int | None, block_size: int = 0) -> Encoding | None:
    if elem_type not in _INT_TYPES:
        return None  # int32 biases: the converter derives them
    bw, signed, output_dtype = _INT_TYPES[elem_type]
    shift = 2 ** (bw - 1) if signed else 0  # signed grid -> unsigned grid
    zeros = [int(z) for z in np.asarray(zero_point).astype(np.int64).ravel()]
    offsets = [-(z + shift) for z in zeros]
    symmetric = all(o == -(2 ** (bw - 1)) for o in offsets)
    return Encoding(name, bw, [float(s) for s in np.asarray(scale).ravel()], offsets, symmetric, param,
                    axis if np.size(scale) > 1 else None, output_dtype, zeros, tuple(np.shape(scale)), block_size)


def encodings_from_qdq(model: str | Path | onnx.ModelProto) -> list[Encoding]:
    """Every activation and weight encoding in a QDQ model, named as in the float model."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=True)
    inits = {i.name: i for i in proto.graph.initializer}
    value = lambda name: numpy_helper.to_array(inits[name]) if name in inits else None
    dequantized = {o for n in proto.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    found: dict[str, Encoding] = {}
    for node in proto.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        scale, zero_point = value(node.input[1]), value(node.input[2])
        if scale is None or zero_point is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
        if node.op_type == "QuantizeLinear":
            if node.input[0] in dequantized:
                continue  # a width conversion (Q -> DQ -> Q): the converter inserts its own
            name, param = node.input[0].removesuffix(_OUTPUT_SUFFIX), False
        elif node.input[0] in inits:  # a quantized initializer: its float name without the suffix
            name, param = node.input[0].removesuffix("_quantized"), True
        else:
            continue
        if name in found:
            continue  # the producer's encoding wins over later converts
        encoding = _encoding(name, scale, zero_point, inits[node.input[2]].data_type, param, axis, block)
        if encoding is not None:
            found[name] = encoding
    return list(found.values())


def build_overrides(encodings: list[Encoding], version: str = "1.0.0",
                    quantizer_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The overrides document in ``version``'s layout."""
    if version not in VERSIONS:
        raise BadInputError(f"overrides version must be one of {VERSIONS} (got '{version}')")
    acts = [e for e in encodings if not e.param]
    params = [e for e in encodings if e.param]
    if version == "2.0.0":
        return {"version": version, "encodings": [e.v2() for e in acts + params]}
    if version == "1.0.0":
        doc: dict[str, Any] = {"version": version, "activation_encodings": [e.v1() for e in acts],
                               "param_encodings": [e.v1() for e in params], "excluded_layers": []}
    else:
        doc = {"version": version, "activation_encodings": {e.name: e.legacy() for e in acts},
               "param_encodings": {e.name: e.legacy() for e in params}}
    doc["quantizer_args"] = quantizer_args or {}
    return doc


def write_overrides(qdq_model: str | Path, path: str | Path, *, version: str = "1.0.0",
                    quantizer_args: dict[str, Any] | None = None, for_model: str | Path | None = None) -> Path:
    """The encodings of ``qdq_model`` as converter overrides at ``path``; with ``for_model`` only those
    of tensors that model has (a QDQ-only rewrite, :mod:`qnnpasses.quant.split_operand`, adds tensors
    the float model the converter reads does not have)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    encodings = encodings_from_qdq(qdq_model)
    if for_model is not None:
        model = onnx.load(str(for_model), load_external_data=False)
        names = {t for n in model.graph.node for t in [*n.input, *n.output]} | {i.name for i in model.graph.initializer}
        encodings = [e for e in encodings if e.name in names]
    doc = build_overrides(encodings, version, quantizer_args)
    out.write_text(json.dumps(doc, indent=1))
    return out


def _from_v2(entry: dict[str, Any]) -> Encoding:
    bw, signed, _ = next(v for v in _INT_TYPES.values() if v[2] == entry["output_dtype"])
    scale = np.asarray(entry["y_scale"], dtype=np.float64)
    zeros = np.broadcast_to(np.asarray(entry.get("y_zero_point", 0), dtype=np.int64), scale.shape).ravel().tolist()
    offsets = [-(z + (2 ** (bw - 1) if signed else 0)) for z in zeros]
    return Encoding(entry["name"], bw, scale.ravel().tolist(), offsets, all(o == -(2 ** (bw - 1)) for o in offsets),
                    False, entry.get("axis"), entry["output_dtype"], zeros, scale.shape, entry.get("block_size", 0))


def read_overrides(path: str | Path) -> dict[str, Encoding]:
    """Encodings by tensor name from a 2.0.0, 1.0.0 or 0.6.1 overrides file (the inverse of :func:`write_overrides`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BadInputError(f"cannot read overrides {path}: {exc}") from None
    if isinstance(doc, dict) and doc.get("version") == "2.0.0" and isinstance(doc.get("encodings"), list):
        return {e["name"]: _from_v2(e) for e in doc["encodings"]}
    if not isinstance(doc, dict) or "activation_encodings" not in doc or "param_encodings" not in doc:
        raise BadInputError(f"{path}: not an encodings file (needs activation_encodings and param_encodings)")
    found = {}
    for key, param in (("activation_encodings", False), ("param_encodings", True)):
        group = doc[key]
        if isinstance(group, list):  # 1.0.0
            for e in group:
                found[e["name"]] = Encoding(e["name"], int(e["bw"]), list(e["scale"]), [int(o) for o in e["offset"]],
                                            bool(e["is_sym"]), param)
        else:  # 0.6.1: one dict per channel
            for name, channels in group.items():
                found[name] = Encoding(name, int(channels[0]["bitwidth"]), [c["scale"] for c in channels],
                                       [int(c["offset"]) for c in channels],
                                       str(channels[0]["is_symmetric"]).lower() == "true", param)
    return found
