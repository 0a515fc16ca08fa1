"""Calibration and evaluation data: found on disk, checked against the model, read one sample at a time.

Accepted sources (``--calib`` / ``--evaluate`` / ``--eval``):

* a ``.npz`` file whose arrays are named after the model's inputs.  Each array holds one
  sample (the input's exact shape) or a stack of samples: shape ``(N, *input_shape)``, or
  ``(N, *input_shape[1:])`` when the input's batch is 1 (rows of a token-window matrix);
* a ``.npy`` file: one sample or a stack, for a model with one input;
* a folder: ``<input name>.npy`` stacks, one per input, when every input has one; else
  every ``.npz`` (and, for one-input models, ``.npy``) in it, in name order;
* ``input_list.txt`` in the QNN converter's format: one sample per line, entries
  ``name:=path`` separated by spaces (a bare ``path`` for one-input models), paths to raw
  little-endian files in the input's dtype, relative to the list's folder (else to the
  working directory); lines starting
  with ``#`` or ``%`` (output names) are skipped.

Arrays that name no model input are ignored (``labels`` for perplexity travel in the same
file).  Nothing is loaded up front: stacks in uncompressed ``.npz``/``.npy`` files are
memory-mapped and a sample is sliced out when asked for, so 512 samples never sit in memory
together.  Every sample is checked when read; a missing input, another dtype or another
shape is a :class:`BadInputError` naming the sample, the input and both sides.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from qnnpasses.errors import BadInputError

#: Arrays a data file may carry besides the inputs (the next-token labels of an LM window).
LABELS = "labels"


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def model_inputs(ir) -> list[InputSpec]:
    """The graph inputs of an :class:`~qnnpasses.ir.model.IRModel` (static shapes required)."""
    specs = []
    for tensor in ir.graph.inputs:
        shape = tuple(tensor.shape or ())
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadInputError(f"input '{tensor.name}' has a symbolic shape {list(shape)}; fix the shapes first "
                                "(qnnpasses run --pipeline htp-llm --shape ...)")
        specs.append(InputSpec(tensor.name, np.dtype(tensor.dtype), shape))
    return specs


# --------------------------------------------------------------------------- arrays on disk


class _Stack:
    """One array of a data file: a single sample or N stacked ones, read lazily."""

    def __init__(self, where: str, load: Callable[[], np.ndarray], dtype: np.dtype, shape: tuple[int, ...]):
        self.where, self._load, self.dtype, self.shape = where, load, dtype, shape
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = self._load()
        return self._array


def _npy_header(fh) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """Shape, dtype, Fortran order and header length of an ``.npy`` stream, without reading data."""
    fmt = np.lib.format
    version = fmt.read_magic(fh)
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    if version not in readers:
        raise ValueError(f".npy format version {version} is not supported")
    shape, fortran, dtype = readers[version](fh)
    return tuple(shape), np.dtype(dtype), fortran, fh.tell()


def _npy_stack(path: Path, name: str) -> _Stack:
    try:
        with open(path, "rb") as fh:
            shape, dtype, _, _ = _npy_header(fh)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
        raise BadInputError(f"cannot read {path}: {exc}") from None
    return _Stack(f"{path}:{name}", lambda: np.load(path, mmap_mode="r", allow_pickle=False), dtype, shape)


def _npz_stacks(path: Path) -> dict[str, _Stack]:
    """Arrays of an ``.npz``; stored (uncompressed) members are memory-mapped in place."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise BadInputError(f"cannot read {path}: not an .npz archive ({exc})") from None
    stacks = {}
    with archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            key = info.filename[:-4]
            with archive.open(info) as fh:
                try:
                    shape, dtype, fortran, header = _npy_header(fh)
                except Exception as exc:  # noqa: BLE001
                    raise BadInputError(f"cannot read array '{key}' of {path}: {exc}") from None
            stacks[key] = _Stack(f"{path}:{key}", _member_loader(path, info, key, shape, dtype, fortran, header),
                                 dtype, shape)
    return stacks


def _member_loader(path: Path, info: zipfile.ZipInfo, key: str, shape, dtype, fortran, header) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if info.compress_type == zipfile.ZIP_STORED and dtype.kind != "O" and not fortran:
            with open(path, "rb") as fh:  # local header: 30 bytes + name + extra
                fh.seek(info.header_offset + 26)
                name_len, extra_len = np.frombuffer(fh.read(4), dtype="<u2")
            start = info.header_offset + 30 + int(name_len) + int(extra_len) + header
            return np.memmap(path, dtype=dtype, mode="r", offset=start, shape=shape)
        with np.load(path, allow_pickle=False) as data:  # compressed: this array only, once
            return data[key]

    return load


# --------------------------------------------------------------------------- samples


class CalibrationData(Sequence):
    """Samples for a model, indexable and iterable, each read from disk when asked for."""

    def __init__(self, source: str | Path, inputs: list[InputSpec]):
        self.source = Path(source)
        self.inputs = inputs
        self._by_name = {s.name: s for s in inputs}
        self._samples: list[Callable[[], dict[str, np.ndarray]]] = []
        self._labels: list[Callable[[], np.ndarray | None]] = []
        self.stacks: list[_Stack] = []  # the arrays on disk the samples are sliced from
        self._discover()
        if not self._samples:
            raise BadInputError(f"{self.source}: no calibration samples found")

    # -- discovery

    def _discover(self) -> None:
        # absolute: samples are read lazily, and onnxruntime's quantizer changes the working
        # directory while it calibrates (a relative folder then points nowhere)
        path = self.source.absolute()
        if not path.exists():
            raise BadInputError(f"calibration data not found: {path}")
        if path.is_dir():
            self._discover_folder(path)
        elif path.suffix == ".npz":
            self._add_stacks(_npz_stacks(path), str(path))
        elif path.suffix == ".npy":
            self._add_stacks({self._single_input(path): _npy_stack(path, self._single_input(path))}, str(path))
        elif path.suffix == ".txt":
            self._discover_input_list(path)
        else:
            raise BadInputError(f"{path}: calibration data must be .npz, .npy, a folder of them or input_list.txt")

    def _single_input(self, path: Path) -> str:
        if len(self.inputs) != 1:
            raise BadInputError(f"{path}: a .npy file holds one array but the model has {len(self.inputs)} inputs "
                                f"{[s.name for s in self.inputs]}; use .npz or a folder of <input>.npy")
        return self.inputs[0].name

    def _discover_folder(self, folder: Path) -> None:
        per_input = {s.name: folder / f"{s.name}.npy" for s in self.inputs}
        if all(p.is_file() for p in per_input.values()):
            self._add_stacks({n: _npy_stack(p, n) for n, p in per_input.items()}, str(folder))
            labels = folder / f"{LABELS}.npy"
            if labels.is_file():
                self._attach_labels(_npy_stack(labels, LABELS))
            return
        files = sorted(p for p in folder.iterdir() if p.suffix in (".npz", ".npy") and p.is_file())
        if not files:
            raise BadInputError(f"{folder}: no .npz or .npy files (nor input_list.txt) in this folder")
        for file in files:
            if file.suffix == ".npz":
                self._add_stacks(_npz_stacks(file), str(file))
            else:
                self._add_stacks({self._single_input(file): _npy_stack(file, self._single_input(file))}, str(file))

    def _add_stacks(self, stacks: dict[str, _Stack], where: str) -> None:
        missing = [s.name for s in self.inputs if s.name not in stacks]
        if missing:
            raise BadInputError(f"{where}: no array for model input(s) {missing} (the file has {sorted(stacks)})")
        counts = {s.name: self._count(stacks[s.name], s) for s in self.inputs}
        if len(set(counts.values())) != 1:
            raise BadInputError(f"{where}: inputs hold different numbers of samples {counts}")
        count = next(iter(counts.values()))
        first = len(self._samples)
        self.stacks += [stacks[s.name] for s in self.inputs]
        for i in range(count):
            self._samples.append(self._slicer(stacks, i, count, f"{where} sample {i}"))
        self._labels.extend([lambda: None] * count)
        if LABELS in stacks:
            self._attach_labels(stacks[LABELS], first)

    def _attach_labels(self, stack: _Stack, first: int = 0) -> None:
        """Labels stacked like the samples from ``first`` on (one row each), or one array for a single sample."""
        count = len(self._samples) - first
        stacked = count > 1 or (stack.shape and stack.shape[0] == count and len(stack.shape) > 1)
        for i in range(count):
            self._labels[first + i] = (lambda i=i: np.asarray(stack.array()[i])) if stacked else \
                (lambda: np.asarray(stack.array()))

    def _count(self, stack: _Stack, spec: InputSpec) -> int:
        """How many samples ``stack`` holds for ``spec``, or a one-line error saying why it cannot."""
        if stack.dtype != spec.dtype:
            raise BadInputError(f"{stack.where}: input '{spec.name}' has dtype {stack.dtype}, the model wants {spec.dtype}")
        shape = stack.shape
        if shape == spec.shape:
            return 1
        if len(shape) == len(spec.shape) + 1 and shape[1:] == spec.shape:
            return shape[0]
        if spec.shape and spec.shape[0] == 1 and len(shape) == len(spec.shape) and shape[1:] == spec.shape[1:]:
            return shape[0]
        raise BadInputError(f"{stack.where}: input '{spec.name}' has shape {list(shape)}, the model wants "
                            f"{list(spec.shape)} (or N stacked samples)")

    def _slicer(self, stacks: dict[str, _Stack], index: int, count: int, where: str):
        def load() -> dict[str, np.ndarray]:
            sample = {}
            for spec in self.inputs:
                stack = stacks[spec.name]
                array = stack.array()
                value = array if stack.shape == spec.shape and count == 1 else array[index]
                sample[spec.name] = np.ascontiguousarray(np.asarray(value).reshape(spec.shape))
            return sample

        return load

    def _discover_input_list(self, path: Path) -> None:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            if not text or text.startswith(("#", "%")):
                continue
            entries = self._parse_line(text, f"{path}:{number}")
            self._samples.append(self._raw_loader(entries, path.parent, f"{path}:{number}"))
            self._labels.append(lambda: None)

    def _parse_line(self, text: str, where: str) -> dict[str, str]:
        entries = {}
        for part in text.split():
            name, sep, file = part.partition(":=")
            if not sep:
                name, file = self._single_input(Path(where)), part
            if name not in self._by_name:
                raise BadInputError(f"{where}: '{name}' is not a model input ({sorted(self._by_name)})")
            entries[name] = file
        missing = [n for n in self._by_name if n not in entries]
        if missing:
            raise BadInputError(f"{where}: no file for model input(s) {missing}")
        return entries

    def _raw_loader(self, entries: dict[str, str], base: Path, where: str):
        def load() -> dict[str, np.ndarray]:
            sample = {}
            for name, file in entries.items():
                spec = self._by_name[name]
                path = Path(file) if Path(file).is_absolute() or not (base / file).is_file() else base / file
                if not path.is_file():
                    raise BadInputError(f"{where}: raw file for '{name}' not found: {path}")
                want = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize
                size = path.stat().st_size
                if size != want:
                    raise BadInputError(f"{where}: {path.name} has {size} bytes; input '{name}' {list(spec.shape)} "
                                        f"{spec.dtype} needs {want}")
                sample[name] = np.fromfile(path, dtype=spec.dtype.newbyteorder("<")).astype(spec.dtype).reshape(spec.shape)
            return sample

        return load

    # -- access

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._samples[index]()

    def labels(self, index: int) -> np.ndarray | None:
        """Next-token labels stored with sample ``index`` (None: derive them from input_ids)."""
        return self._labels[index]()

    def head(self, count: int) -> list[dict[str, np.ndarray]]:
        return [self[i] for i in range(min(count, len(self)))]

    def reader(self, limit: int | None = None) -> StreamingReader:
        return StreamingReader(self, limit)


class StreamingReader(CalibrationDataReader):
    """onnxruntime's calibration reader over :class:`CalibrationData`, one sample in memory at a time."""

    def __init__(self, data: CalibrationData, limit: int | None = None):
        self.data = data
        self.limit = len(data) if limit is None else min(limit, len(data))
        self.served = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.served >= self.limit:
            return None
        sample = self.data[self.served]
        self.served += 1
        return sample

    def rewind(self) -> None:
        self.served = 0

    def __len__(self) -> int:
        return self.limit

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.rewind()
        while (sample := self.get_next()) is not None:
            yield sample


def load_data(source: str | Path, ir) -> CalibrationData:
    """Samples in ``source`` for the inputs of ``ir`` (see the module docs for the formats)."""
    return CalibrationData(source, model_inputs(ir))


# --------------------------------------------------------------------------- writing


def write_input_list(samples, folder: str | Path, name: str = "input_list.txt") -> Path:
    """Raw files plus ``input_list.txt`` in the converter's format (``name:=path`` per input, one line per sample)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, sample in enumerate(samples):
        entries = []
        for key, value in sample.items():
            raw = out / f"{index:05d}_{_safe(key)}.raw"
            np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False).tofile(raw)
            entries.append(f"{key}:={raw.name}")
        lines.append(" ".join(entries))
    path = out / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
