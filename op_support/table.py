"""Loading the op-support tables (``op_support/tables/*.json``).

A table is data, measured on the real backend and committed; this module only finds,
loads and indexes it.  Schema (one table per backend)::

    {"backend": "htp", "qnn_version": "2.40", "htp_arch": "v73", "precision": "...",
     "global": {"max_rank": 5, "rules": [RULE...], "notes": [...]},
     "ops": {"ai.onnx": {"Softmax": ENTRY, ...}, "com.microsoft": {...}}}

    ENTRY = {"supported": true,            # false: the EP rejects the op alone ("reason")
             "fusions": [...],             # ...unless it sits in a pattern the EP fuses (Erf in GeLU)
             "qnn_ops": ["Softmax"],       # QNN op(s) the node becomes
             "opset": [13, 28],            # opsets of the measured ONNX schema version
             "inputs":  [{"name": "input", "dtypes": ["float32", "float16"]}, ...],
             "outputs": [{"name": "output", "dtypes": [...]}],
             "variadic": false,            # the last input spec repeats
             "max_rank": 5,                # of every non-constant tensor of the node
             "max_rank_by_dtype": {"int64": 4},   # lower limits for tensors of a dtype
             "rules": [RULE...],           # attribute / constant-input / combination constraints
             "conditional_notes": [{"when": {...}, "note": "..."}],
             "notes": ["..."],             # e.g. EP-inserted Transposes
             "probes": {"htp": 20, "cpu": 2},
             "source": ["build/Softmax/float32-r6-axis=-1: cpu (...)", ...]}

    RULE = {"check": "<kind>", ..., "reason": "...", "source": [probe ids]}

Rule kinds are evaluated by :mod:`qnnpasses.op_support.checker`.

The name ``"htp"`` stands for the table of the target's HTP arch: ``htp.json`` (measured on
HTP v73, the default target) or ``htp_v<arch>.json`` when the arch has one of its own
(:func:`use_htp_arch`, called when a command activates its ``--soc`` / ``--htp-arch`` target).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

TABLES_DIR = Path(__file__).resolve().parent / "tables"
DEFAULT_DOMAIN = "ai.onnx"


def normalize_domain(domain: str | None) -> str:
    """ONNX's default domain has two spellings: "" and "ai.onnx"."""
    return DEFAULT_DOMAIN if domain in (None, "", "ai.onnx") else domain


#: The file the name "htp" stands for (see the module docstring).
_htp_table = "htp"


def htp_table_name(arch: int) -> str:
    """The bundled table for HTP ``arch``: its own when one was measured, else v73's ``htp``."""
    own = f"htp_v{arch}"
    return own if (TABLES_DIR / f"{own}.json").is_file() else "htp"


def use_htp_arch(arch: int) -> str:
    """Make ``load_table("htp")`` return the table for HTP ``arch``; the table's name."""
    global _htp_table
    _htp_table = htp_table_name(arch)
    return _htp_table


@cache
def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def load_table(name_or_path: str | Path = "htp") -> dict[str, Any]:
    """A table by backend name ("htp": the active arch's) or path.  Cached: treat the result as read-only."""
    if name_or_path == "htp":
        name_or_path = _htp_table
    if isinstance(name_or_path, str) and name_or_path in _BY_NAME:  # passes ask per match: no path work
        return _BY_NAME[name_or_path]
    path = Path(name_or_path)
    if not path.suffix:
        path = TABLES_DIR / f"{name_or_path}.json"
        _BY_NAME[name_or_path] = table = _load(str(path.resolve()))
        return table
    return _load(str(path.resolve()))


#: tables asked for by backend name (a bundled file, which does not change while the process runs)
_BY_NAME: dict[str, dict[str, Any]] = {}


def lookup(table: dict[str, Any], op_type: str, domain: str | None = "") -> dict[str, Any] | None:
    """The table entry of an op, or None if the table does not know it."""
    return table.get("ops", {}).get(normalize_domain(domain), {}).get(op_type)
