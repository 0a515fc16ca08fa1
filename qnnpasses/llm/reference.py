"""The original export as Hugging Face users run it: a growing KV cache on onnxruntime CPU.

The yardstick of ``qnnpasses generate --compare``: the dynamic-KV export (``past_key_values.*``
in, ``present.*`` out) runs greedily in fp32 on the CPU, the cache growing by each step's
``present`` outputs, exactly as ``generate()`` drives it.  It is fed by its own Hugging Face
names where it has them (:func:`qnnpasses.llm.roles.named_roles`), never by the roles the build
found from the graph, so a wrong reading of the graph cannot verify itself; an export with other
names is fed by the roles found from its graph (``fed_by`` says which).
An export whose new-token axis is fixed to 1 is fed one token at a time.
"""

from __future__ import annotations

import os

import numpy as np

from qnnpasses.backends.cpu import cpu_session
from qnnpasses.errors import BadInputError
from qnnpasses.ir.load import load_model
from qnnpasses.llm.roles import export_roles, reference_roles, roles_dict

_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
          "tensor(float16)": np.float16}


class ReferenceModel:
    """The original dynamic-KV export on onnxruntime CPU (fp32)."""

    def __init__(self, path: str | os.PathLike):
        import onnxruntime as ort

        self.path = os.fspath(path)
        self._roles = None  # found from the graph on first need (_structural_roles)
        if not os.path.isfile(self.path):
            raise BadInputError(f"{self.path}: no such file")
        try:  # quiet: a failing run is reported once, by our own message; mapped: weights stay in the file
            self.session = cpu_session(self.path, mapped=True, quiet=True)
            self._quiet = ort.RunOptions()
            self._quiet.log_severity_level = 4
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own message, shortened to one line
            raise BadInputError(f"{os.path.basename(self.path)}: onnxruntime cannot load it: "
                                f"{str(exc).strip().splitlines()[0][:300]}") from None
        meta = {i.name: i for i in self.session.get_inputs()}
        self.out_names = [o.name for o in self.session.get_outputs()]
        source = reference_roles(list(meta), self.out_names, lambda: roles_dict(self._structural_roles()))
        self.fed_by = source["fed_by"]
        self.input_ids, self.mask, self.positions, self.logits_name = (
            source["input_ids"], source["attention_mask"], source["position_ids"], source["logits"])
        self.past = source["past_key"] + source["past_value"]
        self.present = source["present_key"] + source["present_value"]
        heads = {n: meta[n].shape[1] for n in self.past}
        dims = {n: meta[n].shape[3] for n in self.past}
        if not all(isinstance(v, int) for v in [*heads.values(), *dims.values()]):
            # a builder export names the head dim: the graph's structure binds it (lower-gqa)
            roles = self._structural_roles()
            heads, dims = dict.fromkeys(self.past, roles.kv_heads), dict.fromkeys(self.past, roles.head_dim)
        self.types = {name: _TYPES[m.type] for name, m in meta.items() if m.type in _TYPES}
        self.past_shapes = {n: [1, heads[n], 0, dims[n]] for n in self.past}
        ids_shape = meta[self.input_ids].shape
        self.one_token = len(ids_shape) == 2 and ids_shape[1] == 1  # the new-token axis is fixed to 1

    def _structural_roles(self):
        """The roles found from the graph (once: loading and lowering the export is not free)."""
        if self._roles is None:
            try:
                self._roles = export_roles(load_model(self.path))
            except BadInputError as exc:
                raise BadInputError(f"{os.path.basename(self.path)}: {exc}") from None
        return self._roles

    def _empty_cache(self) -> dict[str, np.ndarray]:
        cache = {}
        for name, shape in self.past_shapes.items():
            heads, dim = shape[1], shape[3]
            if not isinstance(heads, int) or not isinstance(dim, int):
                raise BadInputError(f"{os.path.basename(self.path)}: past input {name} has symbolic heads/head_dim")
            cache[name] = np.zeros((1, heads, 0, dim), self.types[name])
        return cache

    def _call(self, ids: list[int], start: int, cache: dict[str, np.ndarray]) -> np.ndarray:
        feeds = dict(cache)
        feeds[self.input_ids] = np.asarray([ids], dtype=self.types[self.input_ids])
        feeds[self.mask] = np.ones((1, start + len(ids)), dtype=self.types[self.mask])
        if self.positions:
            feeds[self.positions] = np.arange(start, start + len(ids), dtype=self.types[self.positions])[None]
        out = dict(zip(self.out_names, self.session.run(self.out_names, feeds, self._quiet)))
        cache.update({p: out[q] for p, q in zip(self.past, self.present)})
        return np.asarray(out[self.logits_name][0], dtype=np.float32)

    def _feed(self, ids: list[int], start: int, cache: dict[str, np.ndarray]) -> np.ndarray:
        if not self.one_token:
            return self._call(ids, start, cache)
        return np.concatenate([self._call([t], start + k, cache) for k, t in enumerate(ids)])

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after ``prompt_ids`` (the cache grows every step)."""
        cache, tokens = self._empty_cache(), []
        logits = self._feed(list(prompt_ids), 0, cache)
        while len(tokens) < max_new_tokens:
            tokens.append(int(np.argmax(logits[-1])))
            if len(tokens) == max_new_tokens:
                break
            logits = self._feed(tokens[-1:], len(prompt_ids) + len(tokens) - 1, cache)
        return tokens

    def cannot_compute(self, new_tokens: int) -> str | None:
        """Why the export cannot compute ``new_tokens`` tokens after a cached one (None: it can).

        An exporter can bake the length it traced into the graph (TorchScript's SDPA with grouped-query
        attention reshapes the query to the traced length): the graph then fails, or computes garbage,
        at any other length.  Both are caught: it must run, and its logits for the tokens must equal
        those of the same tokens fed one at a time."""
        if self.one_token:
            return None
        ids = [int(i) % 2 + 1 for i in range(new_tokens + 1)]
        try:
            together = self._call(ids[1:], 1, self._prime(ids[:1]))
        except BadInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own message, shortened to one line
            return f"{new_tokens} new tokens at once: {_ort_message(exc)}"
        try:
            cache = self._prime(ids[:1])
            apart = np.concatenate([self._call([t], 1 + k, cache) for k, t in enumerate(ids[1:])])
        except Exception as exc:  # noqa: BLE001
            return f"one new token at a time: {_ort_message(exc)}"
        worst = float(np.abs(together - apart).max())
        if worst > 1e-3 * max(1.0, float(np.abs(apart).max())):
            return f"{new_tokens} new tokens at once: its logits differ from one at a time by {worst:.3g}"
        return None

    def _prime(self, ids: list[int]) -> dict[str, np.ndarray]:
        cache = self._empty_cache()
        self._call(ids, 0, cache)
        return cache

    def cache(self, ids: list[int]) -> dict[str, np.ndarray]:
        """Every past input's entries after reading ``ids`` from an empty cache."""
        cache = self._empty_cache()
        self._feed(list(ids), 0, cache)
        return cache

    def cache_ranges(self, sequences: list[list[int]]) -> dict[str, float]:
        """The largest magnitude each past input reaches over ``sequences``, each read from an empty cache."""
        peaks = dict.fromkeys(self.past, 0.0)
        for ids in sequences:
            cache = self.cache(ids)
            for name in self.past:
                peaks[name] = max(peaks[name], float(np.abs(cache[name]).max(initial=0.0)))
        return peaks

    def logits(self, ids: list[int]) -> np.ndarray:
        """The logits of every position of ``ids`` (``[len(ids), vocab]``), from an empty cache."""
        return self._feed(list(ids), 0, self._empty_cache())


def _ort_message(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0]
    return f"onnxruntime: {message.rpartition('Status Message: ')[2][:200]}"


def leading_matches(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
