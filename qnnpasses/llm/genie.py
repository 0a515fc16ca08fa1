"""``qnnpasses llm --bundle genie``: the pair as a Genie bundle, and a run of it with ``libGenie.so``.

Qualcomm's Genie runtime (``genie-t2t-run``, the Genie C API) runs an LLM from context binaries and
a ``genie_config.json``.  Its ``QnnHtp`` engine finds the graphs' tensors by name and checks their
shapes when it loads them; the graphs here are written in that form:

* ``input_ids`` ``[1, S]`` int32, ``attention_mask`` ``[1, S, N]`` float (the whole additive mask),
  ``position_ids_cos`` / ``position_ids_sin`` ``[1, S, h]`` (:mod:`qnnpasses.llm.genie_io`);
* ``past_key_{i}_in`` ``[kv_heads, 1, head_dim, N - S]`` and ``past_value_{i}_in``
  ``[kv_heads, 1, N - S, head_dim]`` uint8 (zero point 128: Genie clears empty slots with the
  encoding's offset), outputs ``logits`` and the new tokens' ``past_key_{i}_out`` /
  ``past_value_{i}_out``, the encodings identical in both graphs (:mod:`qnnpasses.llm.cache_dtype`);
* Genie reads the token count S and the context N of each graph from these shapes (one graph per
  S), keeps the cache left-aligned (slot i holds position i) and writes each call's new K/V at
  the next free slots.

The bundle holds the compiled context binaries (``*_qnn.bin``, beside the EPContext models that
reference them), ``genie_config.json`` (dialog: context, tokenizer, sampler; engine: the
``QnnHtp`` backend with ``kv-dim`` and the binaries; the rotary base as ``positional-encoding``)
and ``htp_backend_ext_config.json`` (the SoC the binaries were compiled for).  Both configuration
files follow the Genie API 1.21 that ``libGenie.so`` in the onnxruntime-qnn wheel implements;
that library validates them (:func:`validate_config`) and, on this machine's simulated HTP, runs
the bundle (:func:`generate`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from qnnpasses.errors import BadInputError

CONFIG_NAME = "genie_config.json"
BACKEND_CONFIG_NAME = "htp_backend_ext_config.json"
#: the Genie C API version the configuration files follow (that of ``libGenie.so`` in onnxruntime-qnn)
GENIE_API = "1.21"
KV_LAYOUT = {"key": "HBDS", "value": "HBSD"}
PAD_VALUE = 128


def check_request(context: int, prefill: int, precision: str) -> None:
    """Refuse what the Genie bundle cannot hold yet (one line each, before any work)."""
    if precision != "fp16":
        raise BadInputError(f"--bundle genie takes --precision fp16 for now (got {precision})")
    if prefill < 2:
        raise BadInputError("--bundle genie needs --prefill of at least 2 (Genie tells the graphs apart by their "
                            "token count)")


def check_model(local_layers: dict[str, int]) -> None:
    """Refuse a model whose attention Genie's one mask cannot describe."""
    if local_layers:
        raise BadInputError(f"--bundle genie cannot hold sliding-window layers yet ({len(local_layers)} local layers): "
                            "Genie gives one mask for every layer; use the default bundle")


# --------------------------------------------------------------------------- the configuration


def backend_config(target: dict[str, Any], weight_sharing: bool) -> dict[str, Any]:
    """``htp_backend_ext_config.json``: the SoC and HTP arch the context binaries were compiled for."""
    return {"devices": [{"soc_model": int(target["soc_model"]), "dsp_arch": str(target["htp_arch"]),
                         "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": bool(weight_sharing)}}


def context_binaries(manifest: dict[str, Any]) -> list[str]:
    """The compiled graphs' context binary files, prefill's first (the bundle's relative names)."""
    files = []
    for name in ("prefill", "decode"):
        for part in manifest["graphs"][name]["parts"]:
            files.extend(part.get("binaries") or [])
    return list(dict.fromkeys(files))


def genie_config(manifest: dict[str, Any], sampling: Any = None, host: bool = False) -> dict[str, Any]:
    """``genie_config.json`` for the bundle ``manifest`` describes (file names relative to the
    bundle: Genie is run from that folder).  ``sampling``: a :class:`qnnpasses.llm.sampling.Sampling`
    (default greedy).  The engine's threads are a phone's big cores (Qualcomm's published
    settings); ``host``: this machine's cores instead (:func:`generate`)."""
    text = manifest["tokenizer"]
    eos = [int(t) for t in text["eos_token_ids"]]
    bos = _dialog_bos(text)
    rope = manifest["rope"]
    # greedy: Genie samples anyway unless top-k is 1 (measured: "greedy" alone does not make it argmax)
    sampler: dict[str, Any] = {"version": 1, "seed": 42, "temp": 1.0, "top-k": 1, "top-p": 1.0, "greedy": True}
    if sampling is not None and not sampling.greedy:
        sampler.update(greedy=False, temp=float(sampling.temperature), **{"top-k": int(sampling.top_k or 0)},
                       **{"top-p": float(sampling.top_p)})
        if sampling.seed is not None:
            sampler["seed"] = int(sampling.seed)
    context = {"version": 1, "size": int(manifest["context"]), "n-vocab": int(manifest["vocab"]),
               "bos-token": int(bos) if bos is not None else -1, "eos-token": eos if len(eos) > 1 else eos[0]}
    if text.get("pad_token_id") is not None:
        context["pad-token"] = int(text["pad_token_id"])
    cores = len(os.sched_getaffinity(0)) if host else 0
    htp = {"version": 1, "spill-fill-bufsize": 0, "mmap-budget": 0, "use-mmap": True,
           "cpu-mask": hex((1 << cores) - 1) if host else "0xe0", "poll": not host,
           "kv-dim": int(manifest["head_dim"]), "allow-async-init": False}
    engine = {"version": 1, "n-threads": min(cores, 3) if host else 3,
              "backend": {"version": 1, "type": "QnnHtp", "QnnHtp": htp, "extensions": BACKEND_CONFIG_NAME},
              "model": {"version": 1, "type": "binary",
                        "binary": {"version": 1, "ctx-bins": context_binaries(manifest)},
                        "positional-encoding": {"type": "rope", "rope-dim": int(rope["dim"]),
                                                # older Genie releases read the base as an integer
                                                "rope-theta": _number(rope["theta"])}}}
    return {"dialog": {"version": 1, "type": "basic", "context": context, "sampler": sampler,
                       "tokenizer": {"version": 1, "path": "tokenizer.json"}, "engine": engine}}


def _dialog_bos(text: dict[str, Any]) -> int | None:
    """The BOS Genie puts before a dialog: the model's, when its tokenizer puts one before text
    (Genie prepends ``bos-token`` whenever it is set; a model whose prompts start without BOS, as
    transformers encodes them, gets -1, unset)."""
    bos = text.get("bos_token_id")
    return int(bos) if bos is not None and text.get("adds_bos", True) else None


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def write_configs(folder: Path, manifest: dict[str, Any]) -> list[Path]:
    """Write both configuration files into ``folder``; their paths."""
    config = folder / CONFIG_NAME
    config.write_text(json.dumps(genie_config(manifest), indent=2) + "\n")
    backend = folder / BACKEND_CONFIG_NAME
    backend.write_text(json.dumps(backend_config(manifest["target"], manifest.get("weight_sharing") == "shared"),
                                  indent=2) + "\n")
    return [config, backend]


# --------------------------------------------------------------------------- libGenie


class GenieError(ValueError):
    """libGenie is missing, refuses the bundle or fails to run it; one line for the user."""


def library_path() -> Path | None:
    """``libGenie.so`` of the installed onnxruntime-qnn wheel, if there is one."""
    try:
        import onnxruntime_qnn
    except ImportError:
        return None
    path = Path(onnxruntime_qnn.__file__).parent / "libGenie.so"
    return path if path.is_file() else None


def _load(path: Path) -> Any:
    lib = ctypes.CDLL(str(path))
    for name in ("Genie_getApiMajorVersion", "Genie_getApiMinorVersion"):
        getattr(lib, name).restype = ctypes.c_uint32
    return lib


def api_version(lib: Any) -> str:
    return f"{lib.Genie_getApiMajorVersion()}.{lib.Genie_getApiMinorVersion()}"


class _Log:
    """A Genie logger whose messages (errors, or everything at ``level`` 4) are kept as lines."""

    CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p)

    def __init__(self, lib: Any, level: int = 1):
        self.lines: list[str] = []
        self._libc = ctypes.CDLL(None)
        self._callback = self.CALLBACK(self._write)
        self.handle = ctypes.c_void_p()
        if lib.GenieLog_create(None, self._callback, level, ctypes.byref(self.handle)) != 0:
            self.handle = None

    def _write(self, _handle, fmt, _level, _time, args) -> None:
        buffer = ctypes.create_string_buffer(4096)
        self._libc.vsnprintf(buffer, len(buffer), fmt, ctypes.c_void_p(args))
        self.lines.append(buffer.value.decode(errors="replace").strip())

    def last(self) -> str:
        lines = [line for line in self.lines if line]
        return f": {lines[-1]}" if lines else ""


def _config_handle(lib: Any, text: str, log: _Log) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    status = lib.GenieDialogConfig_createFromJson(text.encode(), ctypes.byref(handle))
    if status != 0:
        raise GenieError(f"Genie refuses the configuration (status {status}){log.last()}")
    if log.handle is not None:
        lib.GenieDialogConfig_bindLogger(handle, log.handle)
    return handle


def _child(argv: list[str] | None = None) -> int:
    """Modes: ``validate`` a configuration; ``generate`` from token ids (the bundle folder is the
    working directory, as for ``genie-t2t-run``)."""
    parser = argparse.ArgumentParser(prog="python -m qnnpasses.llm.genie")
    parser.add_argument("mode", choices=("validate", "generate"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--cwd", required=True, help="the bundle folder (the configuration's paths are relative to it)")
    parser.add_argument("--prompt-ids", default="")
    parser.add_argument("--max-new-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    os.chdir(args.cwd)
    result: dict[str, Any] = {"ok": False}

    def write() -> None:
        Path(args.result).write_text(json.dumps(result))

    path = library_path()
    if path is None:
        result["error"] = "libGenie.so not found (it ships in the onnxruntime-qnn wheel)"
        write()
        return 0
    lib = _load(path)
    result["api"] = api_version(lib)
    log = _Log(lib)
    text = Path(args.config).read_text()
    try:
        config = _config_handle(lib, text, log)
    except GenieError as exc:
        result["error"] = str(exc)
        write()
        return 0
    if args.mode == "validate":
        result["ok"] = True
        write()
        return 0
    result["stage"] = "load"
    write()
    dialog = ctypes.c_void_p()
    start = time.perf_counter()
    if lib.GenieDialog_create(config, ctypes.byref(dialog)) != 0:
        result["error"] = f"Genie cannot load the bundle{log.last()}"
        write()
        return 0
    result["load_seconds"] = time.perf_counter() - start
    tokens: list[int] = []
    stamps: list[float] = []
    callback_type = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int,
                                     ctypes.c_void_p)

    def on_tokens(values, count, _code, _user) -> None:
        tokens.extend(int(values[i]) for i in range(count))
        stamps.extend([time.perf_counter()] * count)

    callback = callback_type(on_tokens)
    lib.GenieDialog_setMaxNumTokens.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.GenieDialog_setMaxNumTokens(dialog, int(args.max_new_tokens))
    ids = [int(t) for t in args.prompt_ids.split(",") if t]
    array = (ctypes.c_uint32 * len(ids))(*ids)
    result["stage"] = "query"
    write()
    start = time.perf_counter()
    status = lib.GenieDialog_tokenQuery(dialog, array, len(ids), 0, callback, None)
    result.update(tokens=tokens, status=status, seconds=time.perf_counter() - start,
                  first_token_seconds=(stamps[0] - start) if stamps else None)
    if status not in (0, 4):  # 4: the context is full, which ends a generation too
        result["error"] = f"Genie's query failed (status {status}){log.last()}"
    else:
        result["ok"] = True
    lib.GenieDialog_free(dialog)
    write()
    return 0


def _run(mode: str, config: Path, cwd: Path, extra: list[str] = ()) -> dict[str, Any]:
    from qnnpasses.backends.child import run_child

    with tempfile.TemporaryDirectory(prefix="qnnpasses_genie_") as tmp:
        result_path, log = Path(tmp) / "result.json", Path(tmp) / "genie.log"
        args = [mode, "--config", str(config), "--result", str(result_path), "--cwd", str(cwd), *extra]
        child = run_child("qnnpasses.llm.genie", args, result_path, log_path=log)
        # Genie prints what its schema check finds (one "- at '<path>': ..." line per error)
        findings = [line.strip()[2:] for line in log.read_text(errors="replace").splitlines()
                    if line.strip().startswith("- at ")]
    result = child.result or {"ok": False}
    if child.crash is not None:
        stage = f" ({result['stage']})" if result.get("stage") else ""
        result.update(ok=False, error=f"Genie {mode}: {child.crash}{stage}")
    elif not result.get("ok") and findings:
        result["error"] = f"{result.get('error', 'Genie refuses the configuration')}: {'; '.join(findings)}"
    return result


def validate_config(path: str | Path) -> dict[str, Any]:
    """Genie's own check of ``genie_config.json`` (its schema): ``{"ok", "error", "api"}``, in a child."""
    path = Path(path).resolve()
    return _run("validate", path, path.parent)


def generate(bundle: str | Path, manifest: dict[str, Any], prompt_ids: list[int], max_new_tokens: int, *,
             stop_ids: Iterable[int] = (), sampling: Any = None,
             on_token: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Generate with Genie itself (``libGenie.so``, the simulated HTP here) from ``prompt_ids``.

    Genie starts a dialog with its ``bos-token`` when one is set, so a leading BOS in ``prompt_ids``
    is not given twice.
    It stops at its EOS tokens and does not hand the EOS over (``stopped`` says why it ended);
    ``stop_ids`` are those of the manifest."""
    bundle = Path(bundle).resolve()
    if not (bundle / CONFIG_NAME).is_file():
        raise GenieError(f"{bundle}: no {CONFIG_NAME} (build it with 'qnnpasses llm ... --bundle genie')")
    if library_path() is None:
        raise GenieError("libGenie.so not found (it ships in the onnxruntime-qnn wheel: pip install onnxruntime-qnn)")
    bos = _dialog_bos(manifest["tokenizer"])
    ids = list(prompt_ids)
    if bos is not None and ids and ids[0] == bos:
        ids = ids[1:]
    with tempfile.TemporaryDirectory(prefix="qnnpasses_genie_cfg_") as tmp:
        config = Path(tmp) / CONFIG_NAME
        config.write_text(json.dumps(genie_config(manifest, sampling, host=True)))
        result = _run("generate", config, bundle,
                      ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(max_new_tokens)])
    if not result.get("ok"):
        raise GenieError(result.get("error") or "Genie failed")
    tokens = result["tokens"][:max_new_tokens]
    stop = {int(t) for t in stop_ids}
    kept: list[int] = []
    for token in tokens:
        kept.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop:
            break
    # Genie ends a dialog at its EOS without handing that token over: status 0 before the budget
    if len(kept) >= max_new_tokens:
        stopped = "max_new_tokens"
    elif (kept and kept[-1] in stop) or result.get("status") == 0:
        stopped = "eos"
    else:
        stopped = "context_full"
    return {"tokens": kept, "stopped": stopped, "load_seconds": result.get("load_seconds", 0.0), "seconds": result.get("seconds", 0.0),
            "first_token_seconds": result.get("first_token_seconds"), "runtime": f"Genie API {result.get('api')}"}


if __name__ == "__main__":  # pragma: no cover - the child process
    sys.exit(_child())
