"""The ``llm.json`` manifest: what a runtime needs to drive a prefill + decode pair.

``qnnpasses llm`` writes it beside the graphs; a runner (``qnnpasses generate``) reads it
with :func:`load_manifest`.  Schema ``qnnpasses-llm/1``::

    {"format": "qnnpasses-llm/1", "source": "<input file name>", "context": N, "prefill": M,
     "layers": L, "kv_heads": H, "head_dim": D, "vocab": V, "precision": "fp16",
     "kv_layout": {"key": "BHSD", "value": "BHSD"}, "kv_dtype": "float32",
     "weight_sharing": "shared" | "separate" | "none",
     "graphs": {
       "prefill": {"tokens": M, "past": N - M,
          "parts": [{"onnx": "prefill.onnx", "compiled": "prefill_ctx.onnx" or null,
                     "inputs": [...], "outputs": [...]}],
          "roles": {"input_ids": name, "attention_mask": name, "position_ids": name or null,
                    "past_key": [per layer], "past_value": [...], "logits": name,
                    "logits_offset": name or null,
                    "new_key": [...], "new_value": [...]},
          "io": {name: {"dtype": "int32|int64|float32|float16", "shape": [..]}}},
       "decode": {... "tokens": 1, "past": N - 1 ...}}}

Semantics of one call of a graph with ``tokens`` = S and ``past`` = P:

* ``attention_mask`` ``[1, P + S]``: the first P entries are the cache slots (1 iff the slot
  holds a valid entry, i.e. slot < valid_len), the last S the new tokens (1 real, 0 padding);
* ``position_ids`` ``[1, S]``: absolute positions of the new tokens (valid_len, valid_len+1, ...);
  the graphs always have this input (``qnnpasses llm`` exposes it when the export derived the
  positions from the past length);
* ``past_key[i]`` / ``past_value[i]`` ``[1, H, P, D]`` (layout ``BHSD``): cache slots 0..P-1;
* ``new_key[i]`` / ``new_value[i]`` ``[1, H, S, D]``: K/V of the new tokens only; the runner
  writes them at slots valid_len... of its cache itself;
* ``logits`` ``[1, S, V]``; when the role ``logits_offset`` names an output (fp16 pairs, unless
  built with ``--logits-offset none``), ``logits`` holds each row's logits minus that row's
  ``logits_offset`` ``[1, S, 1]`` (``logits-offset``: the maximum of the first
  :func:`default_offset_candidates` tokens' logits by default, of every token's with ``--logits-offset
  all``, so that the top logits come out at fp16's fine resolution near 0).  Argmax, softmax and
  sampling read ``logits`` as it is; the absolute logits are ``logits + logits_offset``
  (:func:`absolute_logits`).  A pair without it has ``logits_offset`` null or absent.

Additions beyond the agreed schema (readers may ignore them): ``source_roles`` -- the roles
in the original export (``input_ids``, ``attention_mask``, ``position_ids`` or null,
``logits``, ``past_key``/``past_value``, ``present_key``/``present_value``: its outputs that
hold past + new; ``given``: those the user named with ``--roles``); ``sliding_window`` -- layer
index (attention order) -> window for the local layers, whose masks follow the token positions
(``window-positions``), empty when the model has none; per part ``weight_bytes`` when split;
``device`` -- what the bundle asks of the device (:mod:`qnnpasses.llm.footprint`): per graph
``weight_bytes`` (in the HTP's dtype) and ``compiled_bytes``, ``kv_cache_bytes``,
``device_bytes``, ``decode_step_read_bytes`` and the ``decode_tokens_per_second_ceiling`` the
target's memory bandwidth allows, ``prefill_call_read_bytes`` and ``ceilings`` (per target of
known bandwidth: ``decode_tokens_per_second``, ``prefill_call_seconds``); ``target`` -- the device the graphs were probed and compiled for (``qnnpasses llm --soc``):
``{"name", "part", "product", "soc_model", "htp_arch": "vNN"}``; a runner on the HTP names it
too; ``tokenizer`` -- present when the bundle holds the model's tokenizer (``qnnpasses llm`` copies
``tokenizer.json`` and its companions from the model's folder or ``--tokenizer-dir DIR``):
``{"file": "tokenizer.json", "files": [every copied file], "vocab_size": n, "bos_token_id": id or
null, "eos_token_ids": [ids generation stops at], "pad_token_id": id or null, "chat_template":
bool}``; ``kv_alignment`` -- ``left`` (default: valid cache entries in the first slots, the
last prompt chunk padded at its end) or ``right`` (onnxruntime-genai's windowed cache: the entries
in the last past slots, the first chunk padded at its start; :mod:`qnnpasses.llm.feed`);
``kv_layout`` values ``BHSD``, ``HBDS`` (key transposed, ``[heads, 1, head_dim, slots]``) or
``HBSD`` and ``kv_dtype`` ``uint8`` with ``kv_encodings`` ``{"zero_point": z, "key_scales":
[per layer], "value_scales": [...]}`` (:mod:`qnnpasses.llm.kv_layout`); Genie bundles
(:mod:`qnnpasses.llm.genie`): ``rope`` ``{"theta", "dim"}`` (also per graph) -- the rotary cos/sin
the graphs take as inputs, roles ``position_cos`` / ``position_sin`` naming them (``position_ids``
null) and ``attention_mask`` ``[1, S, P + S]`` the whole additive mask (:mod:`qnnpasses.llm.feed`);
per part ``binaries`` -- the context binary files the compiled model references (every bundle);
``tokenizer.adds_bos`` -- whether the tokenizer puts BOS before text; per graph ``float_onnx`` -- the float graph a quantized part was made from (built with ``--keep-float``); ``session``:
``{"graph_optimization": "disable_all"}`` -- the compiled models were made, and the graphs
probed, with onnxruntime's graph optimizations off; a runner creating HTP sessions on the
``.onnx`` parts should do the same (onnxruntime otherwise fuses a part's first residual Add into
a Gemm the HTP rejects); a quantized pair's ``session.norm_rounding`` -- the ``.onnx`` parts
compute what they say on any backend, and the HTP gets them through
:func:`qnnpasses.quant.norm_rounding.htp_model` (the compiled models were made so; a runner
compiling the parts itself should do the same).

Paths in ``parts`` are relative to the manifest's folder.  With several parts, run them in
order, feeding each part from a dict of every tensor produced so far (graph inputs and earlier
parts' outputs) by name; the graph's outputs are the union of the parts' outputs.  Integer
inputs keep the dtype the graph has after lowering (``io`` says which).  ``weight_sharing``:
``shared`` when both compiled graphs live in one weight-shared QNN context, ``separate`` when
each has its own context, ``none`` when nothing was compiled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "qnnpasses-llm/1"
#: an fp16 pair's ``logits_offset`` by default: the maximum of this many first tokens' logits, at
#: most an eighth of the vocabulary (:func:`default_offset_candidates`; ``docs/logits_offset.md``:
#: N / V of the lm_head's bytes more, where every token as a candidate reads it twice)
OFFSET_CANDIDATES = 4096
GRAPHS = ("prefill", "decode")
ROLE_KEYS = ("input_ids", "attention_mask", "position_ids", "past_key", "past_value",
             "logits", "new_key", "new_value")
MANIFEST_NAME = "llm.json"


def default_offset_candidates(vocab: int) -> int:
    """The default number of candidate tokens for a vocabulary of ``vocab``: :data:`OFFSET_CANDIDATES`,
    at most ``vocab // 8`` (so the offset never costs more than an eighth of the lm_head's bytes)."""
    return max(1, min(OFFSET_CANDIDATES, vocab // 8))


class ManifestError(ValueError):
    """The manifest is missing, unreadable or not ``qnnpasses-llm/1``."""


def validate_manifest(data: dict[str, Any]) -> dict[str, Any]:
    """Check the fields a runner relies on; return ``data`` unchanged."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest")
    for key in ("context", "prefill", "layers", "kv_heads", "head_dim", "vocab", "graphs"):
        if key not in data:
            raise ManifestError(f"manifest lacks {key!r}")
    for name in GRAPHS:
        graph = data["graphs"].get(name)
        if not isinstance(graph, dict):
            raise ManifestError(f"manifest lacks graph {name!r}")
        for key in ("tokens", "past", "parts", "roles", "io"):
            if key not in graph:
                raise ManifestError(f"graph {name!r} lacks {key!r}")
        if graph["tokens"] + graph["past"] != data["context"]:
            raise ManifestError(f"graph {name!r}: tokens + past != context")
        missing = [k for k in ROLE_KEYS if k not in graph["roles"]]
        if missing:
            raise ManifestError(f"graph {name!r} lacks roles {missing}")
        for role in ("past_key", "past_value", "new_key", "new_value"):
            if len(graph["roles"][role]) != data["layers"]:
                raise ManifestError(f"graph {name!r}: {role} has not one entry per layer")
        if not graph["parts"]:
            raise ManifestError(f"graph {name!r} has no parts")
    return data


def absolute_logits(outputs: dict[str, Any], roles: dict[str, Any]) -> Any:
    """A graph call's logits as float32, with the ``logits_offset`` output added back when the
    graph has one (see the module docstring)."""
    import numpy as np

    logits = np.asarray(outputs[roles["logits"]], dtype=np.float32)
    offset = roles.get("logits_offset")
    return logits + np.asarray(outputs[offset], dtype=np.float32) if offset else logits


def write_manifest(out_dir: str | Path, data: dict[str, Any]) -> Path:
    """Validate and write ``out_dir/llm.json``."""
    validate_manifest(data)
    path = Path(out_dir) / MANIFEST_NAME
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read a manifest (``path`` is the folder or the ``llm.json`` file) and validate it.

    Adds ``"dir"``: the manifest's folder as a string, to resolve the part paths against.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read {path.name}: {exc}") from None
    validate_manifest(data)
    data["dir"] = str(path.parent)
    return data


def part_paths(manifest: dict[str, Any], graph: str, *, compiled: bool) -> list[Path]:
    """The files of ``graph``'s parts in run order (compiled EPContext models if asked)."""
    root = Path(manifest.get("dir", "."))
    out = []
    for part in manifest["graphs"][graph]["parts"]:
        name = part["compiled"] if compiled else part["onnx"]
        if name is None:
            raise ManifestError(f"graph {graph!r} was not compiled")
        out.append(root / name)
    return out
