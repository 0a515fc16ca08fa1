"""Several ONNX models, one external-data file: each distinct weight stored once.

A prefill + decode pair (and the parts of each) hold the same weights; saved one by one, each
file carries its own copy.  :func:`share_external_data` rewrites models of one folder so that
their external initializers point into one data file in which every distinct tensor (same
dtype, shape and bytes) is written once.  onnxruntime resolves ``location`` relative to the
model file and maps aligned ranges, so sessions on two of the models read the same pages.

Only the ``external_data`` entries of the protos change: every model computes exactly what it
computed.  Tensors stored inline stay inline.  The new files are written under temporary names
and renamed into place at the end, and the old data files are removed only when no model reads
them any more; a failure leaves the folder as it was.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from qnnpasses.ir.load import _external_sources
from qnnpasses.ir.model import ExternalSource, _all_initializers, _external_key, _write_external, source_bytes

_CHUNK = 64 << 20


@dataclass(frozen=True)
class SharedData:
    """What :func:`share_external_data` did: tensors it saw, bytes before and after."""

    data_file: str | None  # None: no model had external data
    tensors: int
    unique: int
    bytes_before: int
    bytes_after: int

    def as_dict(self) -> dict:
        return {"data_file": self.data_file, "tensors": self.tensors, "unique_tensors": self.unique,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def _digest(source: ExternalSource, views: dict[Path, mmap.mmap]) -> bytes:
    if source.length == 0:
        return b""
    view = views.get(source.path)
    if view is None:
        with open(source.path, "rb") as fh:
            view = views[source.path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    digest = hashlib.blake2b(digest_size=20)
    for start in range(source.offset, source.offset + source.length, _CHUNK):
        digest.update(view[start:min(start + _CHUNK, source.offset + source.length)])
    return digest.digest()


def share_external_data(models: list[str | Path], data_name: str) -> SharedData:
    """Point the external initializers of ``models`` (one folder) into ``data_name`` there,
    each distinct tensor once; see the module docstring."""
    paths = [Path(m) for m in models]
    folder = paths[0].parent
    if any(p.parent != folder for p in paths):
        raise ValueError("share_external_data: the models must be in one folder")
    protos = [onnx.load(str(p), load_external_data=False) for p in paths]
    target = (folder / data_name).resolve()
    still_read = _data_files(folder, [p for p in folder.glob("*.onnx") if p not in paths])
    if target in still_read:
        raise ValueError(f"share_external_data: another model of the folder reads {data_name}")
    tmp_data = folder / f".{data_name}.tmp-{os.getpid()}"
    tmp_models = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in paths]
    old_files: set[Path] = set()
    written: dict[tuple, list] = {}  # (dtype, dims, digest) -> the external_data entries of its copy
    by_range: dict[ExternalSource, tuple] = {}
    views: dict[Path, mmap.mmap] = {}
    count = before = 0
    try:
        with open(tmp_data, "wb") as out:
            for path, proto in zip(paths, protos):
                sources = _external_sources(proto, folder, path.name)
                for tensor in _all_initializers(proto.graph):
                    source = sources.get(_external_key(tensor))
                    if source is None:
                        continue
                    count += 1
                    before += source.length
                    old_files.add(source.path)
                    key = by_range.get(source)
                    if key is None:
                        key = by_range[source] = (tensor.data_type, tuple(tensor.dims), _digest(source, views))
                    if key in written:
                        del tensor.external_data[:]
                        tensor.external_data.extend(written[key])
                    else:
                        _write_external(tensor, source_bytes(source), out, target, source)
                        written[key] = list(tensor.external_data)
            after = out.tell()
        for proto, tmp in zip(protos, tmp_models):
            tmp.write_bytes(proto.SerializeToString())
    except BaseException:
        for tmp in (tmp_data, *tmp_models):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        for view in views.values():
            view.close()
    if not count:  # nothing external: no data file
        tmp_data.unlink()
        for tmp in tmp_models:
            tmp.unlink()
        return SharedData(None, 0, 0, 0, 0)
    os.replace(tmp_data, target)
    for tmp, path in zip(tmp_models, paths):
        os.replace(tmp, path)
    for old in old_files - {target} - still_read:
        old.unlink(missing_ok=True)
    return SharedData(data_name, count, len(written), before, after)


def _data_files(folder: Path, models: list[Path]) -> set[Path]:
    """The external-data files the other models of the folder read."""
    return {source.path for path in models
            for source in _external_sources(onnx.load(str(path), load_external_data=False), folder, path.name).values()}
