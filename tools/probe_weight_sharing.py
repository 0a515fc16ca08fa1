#!/usr/bin/env python
"""Which onnxruntime-qnn versions run a weight-shared context pair, and with which options.

`qnnpasses llm` compiles the prefill and decode graphs into one weight-shared QNN context when
the backend runs one (:func:`qnnpasses.llm.compile.backend_shares_weights` tries a toy pair
first), else into a context each, so the device holds the weights twice.  This tool tries
every onnxruntime-qnn version on PyPI (each installed once with ``pip install --target`` under
``~/.cache/qnnpasses/ort-qnn/<version>`` and put first on the child's ``PYTHONPATH``) on that
toy pair (two graphs reading the same two 64 x 64 weights, on 8 tokens and on 1), compiling and
running in processes of their own as `qnnpasses llm` does (a failing session can take the process
down), in these variants:

* ``grouped``: compiled with ``ep.share_ep_contexts`` + ``enable_htp_weight_sharing``, the
  binary beside the models; both sessions created with the same options (what `qnnpasses llm`
  does, as onnxruntime's documentation describes it);
* ``alone``: the same compile; each session created on its own, without the sharing options;
* ``embedded``: compiled with the binary embedded in the EPContext models (``ep.context_embed_mode=1``);
  sessions grouped;
* ``separate``: each graph compiled into its own context and run alone (the control: what
  `qnnpasses llm` falls back to).

Figures go to ``docs/weight_sharing.json`` and ``docs/weight_sharing.md``.

    python tools/probe_weight_sharing.py                      # every version on PyPI
    python tools/probe_weight_sharing.py --versions 2.7.0     # one
    python tools/probe_weight_sharing.py --doc-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QNNPASSES_CACHE", Path.home() / ".cache" / "qnnpasses")) / "ort-qnn"
DOC_JSON, DOC_MD = ROOT / "docs" / "weight_sharing.json", ROOT / "docs" / "weight_sharing.md"
VARIANTS = ("separate", "grouped", "alone", "embedded")
TIMEOUT = 600


# --------------------------------------------------------------------------- the child


def child(variant: str, stage: str, folder: Path, result_path: Path) -> None:
    """``stage`` (compile, run) of the toy pair the ``variant`` way, in a process of its own as
    `qnnpasses llm` does it; progress is written after every step."""
    import onnxruntime
    import onnxruntime_qnn

    from qnnpasses.backends.htp import htp_session
    from qnnpasses.llm.compile import SHARE_OPTIONS, _share_config, _toy_pair, _zero_inputs

    result = json.loads(result_path.read_text()) if result_path.exists() else {"done": []}
    result.update(onnxruntime_qnn=onnxruntime_qnn.__version__, onnxruntime=onnxruntime.__version__)

    def step(name: str) -> None:
        result["done"].append(name)
        result_path.write_text(json.dumps(result))

    pairs = _toy_pair(folder)
    shared = variant != "separate"
    if stage == "compile":
        for index, (model, compiled) in enumerate(pairs):
            config = {"ep.context_enable": "1", "ep.context_file_path": str(compiled),
                      "ep.context_embed_mode": "1" if variant == "embedded" else "0"}
            if shared:
                config.update(_share_config(index == len(pairs) - 1))
            htp_session(str(model), extra_options=SHARE_OPTIONS if shared else {}, session_config=config,
                        optimize=False)
            step(f"compile {index + 1}")
        return
    sessions = []
    for index, (_, compiled) in enumerate(pairs):
        grouped = variant in ("grouped", "embedded")
        sessions.append(htp_session(str(compiled), extra_options=SHARE_OPTIONS if grouped else {},
                                    session_config=_share_config(index == len(pairs) - 1) if grouped else {},
                                    disable_cpu_fallback=True))
        step(f"session {index + 1}")
    for index, session in enumerate(sessions):
        session.run(None, _zero_inputs(session))
        step(f"run {index + 1}")


# --------------------------------------------------------------------------- the parent


def available_versions() -> list[str]:
    """onnxruntime-qnn's versions on the package index, oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "onnxruntime-qnn"],
                         capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if x.startswith("Available versions:")), "")
    versions = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()]
    return sorted(versions, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))


def installed(version: str) -> Path:
    target = CACHE / version
    if not (target / "onnxruntime_qnn").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"onnxruntime-qnn=={version}"], check=True)
    return target


def probe(version: str, variant: str) -> dict:
    from qnnpasses.backends.child import describe_exit

    steps = ["compile 1", "compile 2", "session 1", "session 2", "run 1", "run 2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed(version)), str(ROOT)]))
    exit_text = tail = ""
    with tempfile.TemporaryDirectory(prefix="probe_sharing.") as tmp:
        result_path = Path(tmp) / "result.json"
        for stage in ("compile", "run"):
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", variant, "--stage", stage, "--folder", tmp,
                                       "--result", str(result_path)], env=env, capture_output=True, text=True,
                                      timeout=TIMEOUT)
                exit_text = describe_exit(proc.returncode) if proc.returncode else ""
                tail = (proc.stderr.strip().splitlines() or [""])[-1][-200:]  # the error's own words end it
            except subprocess.TimeoutExpired:
                exit_text, tail = f"timed out after {TIMEOUT}s", ""
            if exit_text:
                break
        result = json.loads(result_path.read_text()) if result_path.exists() else {"done": []}
    done = result["done"]
    entry = {"version": version, "variant": variant, "loaded": result.get("onnxruntime_qnn"),
             "onnxruntime": result.get("onnxruntime"), "done": done, "ok": done == steps}
    if not entry["ok"]:
        failed = steps[len(done)] if len(done) < len(steps) else "?"
        entry["failure"] = f"{failed}: {exit_text or 'failed'}" + (f" ({tail})" if tail and "SIG" not in exit_text else "")
    return entry


def short(failure: str) -> str:
    """The step and the gist of a failure: the signal, the QNN error code, or onnxruntime's own words."""
    import re

    step, _, rest = failure.partition(": ")
    found = re.search(r"killed by (SIG\w+)", rest) or re.search(r"Error: (QNN_\w+)", rest) \
        or re.search(r"FAIL : (?:\S+:\d+ )?(?:\w+ )?(.{0,90})", rest)
    return f"{step}: {found.group(1).strip().rstrip(')') if found else rest[:90]}"


def render(entries: list[dict]) -> str:
    """docs/weight_sharing.md from the JSON's entries."""
    runtimes = ", ".join(sorted({e.get("onnxruntime") or "?" for e in entries}))
    versions = sorted({e["version"] for e in entries}, key=lambda v: tuple(int(p) for p in v.split(".")))
    by = {(e["version"], e["variant"]): e for e in entries}
    lines = ["# Weight-shared contexts across onnxruntime-qnn versions", "",
             "Written by `python tools/probe_weight_sharing.py` from `docs/weight_sharing.json`.  A toy pair "
             "(two graphs reading the same two 64 x 64 weights, on 8 tokens and on 1) compiled for the simulated "
             "HTP and run, compile and run each in a process of its own (the tool's docstring says what each "
             "variant sets).  `ok`: both graphs compiled, both sessions created and both run; otherwise the first "
             f"step that failed and the gist of its error (in full below).  onnxruntime {runtimes}.",
             "", "| onnxruntime-qnn | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for version in versions:
        cells = []
        for variant in VARIANTS:
            e = by.get((version, variant))
            cells.append("-" if e is None else "ok" if e["ok"] else short(e["failure"]))
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    working = sorted({e["version"] for e in entries if e["ok"] and e["variant"] != "separate"})
    lines += ["", ("Versions that run a weight-shared pair: " + ", ".join(working) + ".") if working else
              "No version runs a weight-shared pair here: `qnnpasses llm` compiles each graph into its own "
              "context (its toy-pair probe finds this at build time and says so in the manifest), and the "
              "device holds the pair's weights once per graph.", "", "The errors in full:", ""]
    seen: dict[str, list[str]] = {}
    for e in entries:
        if not e["ok"]:
            seen.setdefault(e["failure"].partition(": ")[2], []).append(f"{e['version']} {e['variant']}")
    lines += [f"- {', '.join(where)}: {message}" for message, where in seen.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", help="default: every version on the package index")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--doc-only", action="store_true")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=("compile", "run"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.stage, args.folder, args.result)
        return 0
    doc = json.loads(DOC_JSON.read_text()) if DOC_JSON.exists() else {"entries": []}
    if not args.doc_only:
        fresh = []
        for version in args.versions or available_versions():
            for variant in args.variants:
                entry = probe(version, variant)
                print(f"{version} {variant}: {'ok' if entry['ok'] else entry['failure']}", flush=True)
                fresh.append(entry)
        keys = {(e["version"], e["variant"]) for e in fresh}
        doc["entries"] = [e for e in doc["entries"] if (e["version"], e["variant"]) not in keys] + fresh
        DOC_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    DOC_MD.write_text(render(doc["entries"]))
    print(f"wrote {DOC_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
