"""Calibration samples in, ``input_list.txt`` + raw files out (and back, to verify).

What the QNN tools read (QNN SDK docs, "Tools" page, qnn-onnx-converter ``--input_list``
and qnn-net-run ``--input_list``; the line syntax is restated in the qairt-quantizer
section of the same docs):

* one line per sample (one graph execution / one calibration sample);
* a single-input model lists one raw file path per line; a multi-input model lists
  ``<input_name>:=<path>`` entries separated by spaces;
* a raw file is the tensor's bytes in its native (row-major, ONNX) layout, no header.

dtypes: float inputs are written as float32 (what the tools read by default).  QNN has no
64-bit tensors: the converter turns int64 graph inputs into int32 ones, so int64 samples
are written as int32 (after checking they fit); other integer types keep their width and
bool becomes one byte per value.  With any non-float input the converter must read the
files in that native form, which is its ``--use_native_input_files`` flag (see
:mod:`qnnpasses.handoff.sdk`).  ``inputs.json`` records name, file dtype and shape of every
input so a package can be read back exactly (:func:`read_samples`).

Paths in ``input_list.txt`` are relative to the package folder; ``convert.sh`` runs from it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from qnnpasses.errors import BadInputError
from qnnpasses.ir.model import IRModel

INPUT_LIST = "input_list.txt"
MANIFEST = "inputs.json"
RAW_DIR = "inputs"


@dataclass(frozen=True)
class InputSpec:
    name: str
    source_dtype: np.dtype     # the model's dtype
    file_dtype: np.dtype       # what the raw file holds
    shape: tuple               # declared shape (ints, or strings for symbolic dims)

    @property
    def file_key(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.name)


def file_dtype_for(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.dtype(np.float32)
    if dtype == np.int64:
        return np.dtype(np.int32)
    if dtype == np.uint64:
        return np.dtype(np.uint32)
    if dtype == np.bool_:
        return np.dtype(np.uint8)
    return dtype


def input_specs(ir: IRModel) -> list[InputSpec]:
    specs = []
    for tensor in ir.graph.inputs:
        if isinstance(tensor, gs.Constant):
            continue
        if tensor.dtype is None:
            raise BadInputError(f"input '{tensor.name}' has no dtype")
        dtype = np.dtype(tensor.dtype)
        shape = tuple(d if isinstance(d, int) else str(d) for d in (tensor.shape or []))
        specs.append(InputSpec(tensor.name, dtype, file_dtype_for(dtype), shape))
    return specs


def needs_native_files(specs: list[InputSpec]) -> bool:
    return any(s.file_dtype.kind != "f" for s in specs)


# --------------------------------------------------------------------------- loading calibration


def load_calibration(path: str | Path, specs: list[InputSpec]) -> list[dict[str, np.ndarray]]:
    """Samples from a .npz, a folder of .npz files, or an existing input_list.txt."""
    source = Path(path)
    if source.is_dir():
        files = sorted(source.glob("*.npz"))
        if not files:
            raise BadInputError(f"--calib folder {source} holds no .npz files")
        return [s for f in files for s in _npz_samples(f, specs)]
    if source.suffix == ".npz":
        return _npz_samples(source, specs)
    if source.is_file():
        return _input_list_samples(source, specs)
    raise BadInputError(f"--calib not found: {source}")


def _npz_samples(path: Path, specs: list[InputSpec]) -> list[dict[str, np.ndarray]]:
    """One sample, or N samples when every array has one leading dim more than its input."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise BadInputError(f"cannot read calibration file {path}: {exc}") from None
    names = [s.name for s in specs]
    missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
    if missing or extra:
        raise BadInputError(f"{path.name}: arrays must be keyed by input name: missing {missing}, unexpected {extra}")
    batched = {s.name: arrays[s.name].ndim == len(s.shape) + 1 for s in specs}
    if all(batched.values()):
        counts = {arrays[n].shape[0] for n in names}
        if len(counts) != 1:
            raise BadInputError(f"{path.name}: stacked samples disagree on their count ({sorted(counts)})")
        samples = [{n: arrays[n][i] for n in names} for i in range(counts.pop())]
    elif not any(batched.values()):
        samples = [arrays]
    else:
        raise BadInputError(f"{path.name}: either every array or none must carry a leading sample dimension")
    for sample in samples:
        _validate(sample, specs, path.name)
    return samples


def _validate(sample: dict[str, np.ndarray], specs: list[InputSpec], where: str) -> None:
    for spec in specs:
        array = sample[spec.name]
        if array.dtype != spec.source_dtype:
            raise BadInputError(f"{where}: '{spec.name}' is {array.dtype}, the model wants {spec.source_dtype}")
        if len(array.shape) != len(spec.shape) or any(isinstance(d, int) and d != a for d, a in zip(spec.shape, array.shape)):
            raise BadInputError(f"{where}: '{spec.name}' has shape {list(array.shape)}, the model wants {list(spec.shape)}")


def _input_list_samples(path: Path, specs: list[InputSpec]) -> list[dict[str, np.ndarray]]:
    """Read an existing input list whose raw files follow this module's dtype convention."""
    samples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "%")):
            continue
        files = _parse_line(line, specs, f"{path.name}:{number}")
        sample = {}
        for spec in specs:
            raw = Path(files[spec.name])
            raw = raw if raw.is_absolute() else path.parent / raw
            sample[spec.name] = _read_raw(raw, spec, f"{path.name}:{number}")
        samples.append(sample)
    if not samples:
        raise BadInputError(f"{path} lists no samples")
    return samples


def _parse_line(line: str, specs: list[InputSpec], where: str) -> dict[str, str]:
    entries = line.split()
    if all(":=" in e for e in entries):
        files = dict(e.split(":=", 1) for e in entries)
    elif len(entries) == len(specs) and not any(":=" in e for e in entries):
        files = {s.name: e for s, e in zip(specs, entries)}
    else:
        raise BadInputError(f"{where}: expected <input_name>:=<path> entries for a multi-input model")
    missing = sorted({s.name for s in specs} - set(files))
    if missing:
        raise BadInputError(f"{where}: no file for input(s) {missing}")
    return files


def _read_raw(path: Path, spec: InputSpec, where: str) -> np.ndarray:
    if not path.is_file():
        raise BadInputError(f"{where}: raw file not found: {path}")
    if not all(isinstance(d, int) for d in spec.shape):
        raise BadInputError(f"{where}: input '{spec.name}' has symbolic dims {list(spec.shape)}; pass .npz samples")
    data = np.fromfile(path, dtype=spec.file_dtype)
    expected = int(np.prod(spec.shape, dtype=np.int64))
    if data.size != expected or path.stat().st_size != expected * spec.file_dtype.itemsize:
        raise BadInputError(f"{where}: {path.name} holds {path.stat().st_size} bytes; '{spec.name}' needs "
                            f"{expected * spec.file_dtype.itemsize} ({expected} x {spec.file_dtype})")
    return data.reshape(spec.shape).astype(spec.source_dtype)


# --------------------------------------------------------------------------- writing / reading back


def to_file_array(array: np.ndarray, spec: InputSpec) -> np.ndarray:
    if spec.file_dtype.kind in "iu" and array.dtype.kind in "iu" and array.size:
        info = np.iinfo(spec.file_dtype)
        if array.min() < info.min or array.max() > info.max:
            raise BadInputError(f"input '{spec.name}' holds values outside {spec.file_dtype}, which QNN uses for it")
    return np.ascontiguousarray(array.astype(spec.file_dtype))


def write_samples(out: Path, samples: list[dict[str, np.ndarray]], specs: list[InputSpec]) -> Path:
    """Raw files under ``out/inputs/NNNN/``, ``out/input_list.txt`` and ``out/inputs.json``."""
    raw_root = out / RAW_DIR
    if raw_root.exists():
        shutil.rmtree(raw_root)
    lines = []
    for index, sample in enumerate(samples):
        folder = raw_root / f"{index:04d}"
        folder.mkdir(parents=True)
        entries = []
        for spec in specs:
            rel = f"{RAW_DIR}/{index:04d}/{spec.file_key}.raw"
            to_file_array(sample[spec.name], spec).tofile(out / rel)
            entries.append(rel if len(specs) == 1 else f"{spec.name}:={rel}")
        lines.append(" ".join(entries))
    (out / INPUT_LIST).write_text("\n".join(lines) + "\n")
    manifest = {"samples": len(samples), "native_input_files": needs_native_files(specs),
                "inputs": [{"name": s.name, "file_dtype": s.file_dtype.name, "model_dtype": s.source_dtype.name,
                            "shape": list(samples[0][s.name].shape) if samples else list(s.shape)} for s in specs]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out / INPUT_LIST


def read_samples(package: str | Path) -> list[dict[str, np.ndarray]]:
    """The samples of a package, read back from ``input_list.txt`` and the raw files."""
    package = Path(package)
    manifest = json.loads((package / MANIFEST).read_text())
    specs = [InputSpec(i["name"], np.dtype(i["model_dtype"]), np.dtype(i["file_dtype"]),
                       tuple(i["shape"])) for i in manifest["inputs"]]
    return _input_list_samples(package / INPUT_LIST, specs)
