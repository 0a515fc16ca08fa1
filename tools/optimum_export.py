#!/usr/bin/env python
"""Export a Hugging Face decoder to ONNX with Hugging Face Optimum, the way most HF users do
(``optimum-cli export onnx --task text-generation-with-past``), so that qnnpasses can be
run on the graphs people actually have, not only on the ones we export ourselves.

Optimum's ONNX exporter lives in the ``optimum-onnx`` package since Optimum 2.0, and pins
an older transformers than the main environment's, so it runs in a virtual environment of
its own under ``~/.cache/qnnpasses/optimum-venv`` (created on first use; nothing is
installed into the main environment).  Pinned there (see ``REQUIREMENTS``):

* ``optimum-onnx[onnxruntime]==0.1.0`` - the newest release; it requires
  ``optimum~=2.1.0`` and ``transformers>=4.36,<4.58``;
* ``optimum==2.1.0``, ``transformers==4.57.6`` - the newest versions those pins allow;
* ``torch==2.13.0`` - the main environment's version (optimum-onnx exports with the
  TorchScript exporter, ``dynamo=False``, which this torch still has); with this machine's
  pip configuration it resolves to the CPU wheel on local disk rather than PyPI's CUDA one;
* ``onnx==1.23.1``, ``onnxruntime==1.30.0`` - for the exporter's own output check;
* ``accelerate==1.16.0`` - without it the exporter skips its tied-weight deduplication
  (a tied lm_head would be stored twice), which a typical HF install does run.

Run::

    python tools/optimum_export.py --setup              # create/refresh the venv only
    python tools/optimum_export.py HF_DIR OUT.onnx      # export (creates the venv if needed)

or from Python: ``export_optimum(hf_dir, out_path)`` returns None on success, else a
one-line reason (the last meaningful line of the exporter's stderr).  Only the ONNX graph
is written to ``OUT.onnx`` (weights inline when under 2 GB, else ``OUT.onnx.data`` beside
it); tokenizer and config files are not copied.

The exporter reads ``HF_DIR`` with transformers 4.57, which does not know the
``rope_parameters`` block that transformers 5.x writes instead of ``rope_theta`` /
``rope_scaling`` (it would silently fall back to its default RoPE base).  So a 5.x config
is exported through a staged copy of ``HF_DIR`` (weights symlinked) whose ``config.json``
is rewritten in the 4.x form; see ``v4_config``.

Known fidelity gap (Optimum's, not ours): transformers 4.57 loads Gemma 2 with sdpa
attention, which ignores ``attn_logit_softcapping``, so the exported Gemma 2 graph has no
attention soft-capping (logits then differ from transformers 5.x's eager Gemma 2).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV = Path.home() / ".cache" / "qnnpasses" / "optimum-venv"

# Newest optimum-onnx + the newest optimum/transformers its pins allow (optimum~=2.1.0,
# transformers<4.58); torch as in the main env (local CPU wheel); accelerate for dedup.
REQUIREMENTS = (
    "optimum-onnx[onnxruntime]==0.1.0",
    "optimum==2.1.0",
    "transformers==4.57.6",
    "torch==2.13.0",
    "onnx==1.23.1",
    "onnxruntime==1.30.0",
    "accelerate==1.16.0",
)

MARKER = "qnnpasses-requirements.txt"  # inside VENV: the requirement list last installed
INSTALL_LOG = "qnnpasses-install.log"  # inside VENV: pip's output of the last install
TWO_GB = 2**31


def _venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _marker_text() -> str:
    return "\n".join(REQUIREMENTS) + "\n"


def ensure_venv(venv: Path = VENV, *, verbose: bool = False) -> Path:
    """Create the Optimum venv (``python -m venv``) and install ``REQUIREMENTS`` into it,
    unless its marker file already records exactly these requirements.  Returns the venv's
    python.  Safe to call concurrently (a lock file beside the venv)."""
    python = _venv_python(venv)
    marker = venv / MARKER
    if python.exists() and marker.exists() and marker.read_text() == _marker_text():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and marker.exists() and marker.read_text() == _marker_text():
            return python  # another process finished the install while we waited
        marker.unlink(missing_ok=True)
        start = time.monotonic()
        if not python.exists():
            _say(f"creating {venv}", verbose)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        _say("installing " + " ".join(REQUIREMENTS), verbose)
        cmd = [str(python), "-m", "pip", "install", "--no-input", *REQUIREMENTS]
        log_path = venv / INSTALL_LOG
        with open(log_path, "w") as log:
            proc = subprocess.run(
                cmd,
                stdout=None if verbose else log,
                stderr=subprocess.STDOUT if not verbose else None,
                env=_clean_env(),
            )
        if proc.returncode != 0:
            tail = "" if verbose else _last_meaningful_line(log_path.read_text())
            raise RuntimeError(f"pip install into {venv} failed: {tail}".rstrip(": "))
        marker.write_text(_marker_text())
        _say(f"venv ready in {time.monotonic() - start:.0f} s: {python}", verbose)
    return python


def export_optimum(hf_dir: Path, out_path: Path, *, timeout: float = 3600) -> str | None:
    """Export ``hf_dir`` with ``optimum-cli export onnx --task text-generation-with-past``
    (in the Optimum venv) and write the resulting ``model.onnx`` to ``out_path``.
    Returns None on success, else a one-line reason."""
    hf_dir, out_path = Path(hf_dir).resolve(), Path(out_path)
    if not (hf_dir / "config.json").exists():
        return f"no config.json in {hf_dir}"
    try:
        python = ensure_venv()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        return f"optimum venv: {exc}"
    with tempfile.TemporaryDirectory(prefix="optimum-export-") as tmp:
        out_dir = Path(tmp) / "out"
        model_dir = _stage_v4(hf_dir, Path(tmp) / "hf")
        cmd = [
            str(python), "-m", "optimum.commands.optimum_cli",
            "export", "onnx",
            "--model", str(model_dir),
            "--task", "text-generation-with-past",
            str(out_dir),
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, cwd=tmp, env=_clean_env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return f"optimum-cli timed out after {timeout:.0f} s"
        if proc.returncode != 0:
            reason = _last_meaningful_line(proc.stderr) or _last_meaningful_line(proc.stdout)
            return reason or f"optimum-cli exited with code {proc.returncode}"
        model = out_dir / "model.onnx"
        if not model.exists():
            onnx_files = sorted(p.name for p in out_dir.glob("*.onnx")) if out_dir.exists() else []
            return f"optimum-cli wrote no model.onnx (onnx files: {onnx_files or 'none'})"
        _move_onnx(model, out_path)
    return None


def v4_config(cfg: dict) -> dict | None:
    """``cfg`` (a ``config.json`` as a dict) in the form transformers 4.x reads, or None if
    it needs no change: 5.x's ``rope_parameters`` becomes ``rope_theta`` / ``rope_scaling``
    / ``partial_rotary_factor`` (GPT-NeoX: ``rotary_emb_base`` / ``rotary_pct``; Gemma 3:
    the sliding layers' base as ``rope_local_base_freq``)."""
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict) or not rp:
        return None
    local = None
    if all(isinstance(v, dict) for v in rp.values()):  # per layer type (Gemma 3)
        main = rp.get("full_attention") or next(iter(rp.values()))
        local = rp.get("sliding_attention")
    else:
        main = rp
    new = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    theta, partial = main.get("rope_theta"), main.get("partial_rotary_factor")
    scaling = {k: v for k, v in main.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if theta is not None:
        new.setdefault("rope_theta", theta)
    if rope_type != "default" and not new.get("rope_scaling"):
        new["rope_scaling"] = {**scaling, "rope_type": rope_type, "type": rope_type}
    if partial is not None:
        new.setdefault("partial_rotary_factor", partial)
    model_type = cfg.get("model_type", "")
    if model_type == "gpt_neox":
        if theta is not None:
            new.setdefault("rotary_emb_base", theta)
        if partial is not None:
            new.setdefault("rotary_pct", partial)
    if model_type.startswith("gemma3") and local and local.get("rope_theta") is not None:
        new.setdefault("rope_local_base_freq", local["rope_theta"])
    return new


def _stage_v4(hf_dir: Path, stage: Path) -> Path:
    """``hf_dir`` itself, or (when its config needs ``v4_config``) a copy of it in ``stage``
    with the rewritten ``config.json`` and every other entry symlinked."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    new = v4_config(cfg)
    if new is None:
        return hf_dir
    stage.mkdir(parents=True)
    for entry in hf_dir.iterdir():
        if entry.name != "config.json":
            (stage / entry.name).symlink_to(entry.resolve())
    (stage / "config.json").write_text(json.dumps(new, indent=2) + "\n")
    return stage


def _move_onnx(model: Path, out_path: Path) -> None:
    """Move ``model`` to ``out_path``: one file (weights inline) if under 2 GB, else the
    graph plus its external data as ``OUT.onnx.data`` (data moved, never loaded)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors

    out_path.parent.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(str(model), load_external_data=False)
    external = [t for t in _get_all_tensors(proto) if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        shutil.move(str(model), str(out_path))
        return
    locations = sorted({ExternalDataInfo(t).location for t in external})
    data_bytes = sum((model.parent / loc).stat().st_size for loc in locations)
    if proto.ByteSize() + data_bytes < TWO_GB:
        onnx.load_external_data_for_model(proto, str(model.parent))
        onnx.save_model(proto, str(out_path))
        return
    renamed = {
        loc: out_path.name + ".data" if len(locations) == 1 else f"{out_path.name}.{loc}"
        for loc in locations
    }
    for loc, new_loc in renamed.items():
        shutil.move(str(model.parent / loc), str(out_path.parent / new_loc))
    for tensor in external:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = renamed[entry.value]
    onnx.save_model(proto, str(out_path))


def _clean_env() -> dict[str, str]:
    """The environment for the venv's processes: offline hub, no main-env PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("VIRTUAL_ENV", None)
    return env


_NOISE = re.compile(
    r"^\s*(warnings\.warn\(|warn\(|~+|\^+|\||\d+%\||[-=]{3,}$)"
    r"|Warning:|warnings\.warn|TracerWarning|FutureWarning|DeprecationWarning"
    r"|^\s*(File \"|During handling|The above exception|Traceback \(most recent)"
)


def _last_meaningful_line(text: str) -> str:
    """The last line of ``text`` that is not blank, a warning, a traceback frame or a
    progress bar: for a failed run, the exception line."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and not _NOISE.search(line):
            return line[:500]
    return ""


def _say(msg: str, verbose: bool) -> None:
    print(f"[optimum_export] {msg}", file=sys.stderr if not verbose else sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", nargs="?", type=Path, help="saved HF model directory")
    parser.add_argument("out", nargs="?", type=Path, help="output .onnx path")
    parser.add_argument("--setup", action="store_true", help="create/refresh the venv only")
    args = parser.parse_args(argv)
    if args.setup:
        if args.hf_dir or args.out:
            parser.error("--setup takes no other arguments")
        python = ensure_venv(verbose=True)
        print(python)
        return 0
    if not (args.hf_dir and args.out):
        parser.error("HF_DIR and OUT.onnx are required (or --setup)")
    reason = export_optimum(args.hf_dir, args.out)
    if reason is not None:
        print(f"optimum export failed: {reason}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
