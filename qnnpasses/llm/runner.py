"""The generation loop of a deployed prefill + decode pair (``llm.json``, ``qnnpasses-llm/1``).

:class:`Runner` owns the KV cache: one buffer of ``context`` slots per layer for keys and one
for values, in the graphs' own form (:mod:`qnnpasses.llm.kv_layout`), and ``valid_len``, the
number of entries held.  One call of a graph takes up to its ``tokens`` new tokens after them,
fed as the bundle's runtime feeds them (:mod:`qnnpasses.llm.feed`: the cache left-aligned in
our bundles, right-aligned in onnxruntime-genai's), and the real tokens' new K/V are stored at
entries ``valid_len ..``.
The prompt goes through the prefill graph in chunks of M while a chunk fits
(``valid_len <= context - M``); what remains, and every generated token, goes through the
decode graph.  Decoding is greedy unless a sampler chooses the tokens
(:mod:`qnnpasses.llm.sampling`), and stops after ``max_new_tokens``, at an end-of-sequence id
(``stop_ids``), or when prompt + new tokens fill the context.

``on="cpu"`` runs the ``.onnx`` parts on onnxruntime's CPU provider; ``on="htp"`` runs the
compiled EPContext parts when the manifest names them (else the ``.onnx`` parts) on the QNN
HTP backend with CPU fallback disabled: fp16 mode for float graphs, integer mode (SoC named)
for quantized ones.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from qnnpasses.llm.feed import ALIGNMENTS, call_feed, new_slots, store_new
from qnnpasses.llm.kv_layout import CacheLayout, LayoutError
from qnnpasses.llm.manifest import ManifestError, absolute_logits, load_manifest

ON = ("htp", "cpu")


class RunnerError(ValueError):
    """Unusable manifest, graph files or prompt; the message is one line for the user."""


@dataclass
class Generation:
    """What :meth:`Runner.generate` did.  Times are wall seconds on this host."""

    tokens: list[int]
    prompt_tokens: int
    stopped: str  # "max_new_tokens", "eos" or "context_full"
    prefill_calls: int = 0  # graph calls that took the prompt (prefill chunks, then decode steps)
    decode_calls: int = 0  # decode steps for generated tokens
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    load_seconds: float = 0.0
    on: str = "cpu"
    files: dict[str, list[str]] = field(default_factory=dict)
    #: with ``keep_logits``: the logits of every fed position (prompt + new tokens but the last),
    #: i.e. exactly what teacher forcing on this generation's own tokens computes
    logits: np.ndarray | None = field(default=None, repr=False)

    @property
    def decode_seconds_per_token(self) -> float | None:
        return self.decode_seconds / self.decode_calls if self.decode_calls else None

    @property
    def time_to_first_token(self) -> float | None:
        """Wall seconds from the prompt's first graph call to the first new token (sessions already open)."""
        return self.prefill_seconds if self.tokens else None

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed: generated tokens after the first, per wall second of decode steps."""
        return self.decode_calls / self.decode_seconds if self.decode_calls and self.decode_seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("logits")
        data.update(decode_seconds_per_token=self.decode_seconds_per_token,
                    time_to_first_token=self.time_to_first_token, tokens_per_second=self.tokens_per_second)
        return data


def htp_graph_session(path: Path, *, fp16: bool, shared: bool, target: Any, compiled: bool,
                      compensate: bool = True) -> Any:
    """A session on the HTP with the options ``qnnpasses llm`` compiled with: onnxruntime's graph
    optimizations off (its fusions would undo rewrites the HTP needs, e.g. the fp16-safe
    RMSNorm), graph-boundary Q/DQ on the HTP for quantized graphs, no CPU fallback; a quantized
    graph not yet compiled gets what compiling gives it (:mod:`qnnpasses.quant.norm_rounding`;
    ``compensate=False``: the graph as written, for measuring what the compensation does)."""
    from qnnpasses.backends.htp import htp_session

    config = {"ep.share_ep_contexts": "1"} if shared else {}
    extra = None if fp16 else {"offload_graph_io_quantization": "0"}
    model: Path | str | bytes = path
    if not fp16 and not compiled and compensate:
        from qnnpasses.quant.norm_rounding import htp_model

        model, more, _ = htp_model(path)
        config.update(more)
    return htp_session(model, fp16=fp16, disable_cpu_fallback=True, session_config=config or None, optimize=False,
                       extra_options=extra, target=target)


def _cpu_session(path: Path) -> Any:
    from qnnpasses.backends.cpu import cpu_session

    return cpu_session(path, mapped=True)  # the pair's weights stay in its files


class _Graph:
    """One graph of the pair: its roles, its part files and (once opened) their sessions."""

    def __init__(self, manifest: dict[str, Any], name: str, on: str, target: Any,
                 sessions: Callable[[Path, _Graph], Any] | None = None):
        spec = manifest["graphs"][name]
        self.name = name
        self.tokens, self.past = int(spec["tokens"]), int(spec["past"])
        self.roles, self.io = spec["roles"], spec["io"]
        self.root = Path(manifest["dir"])
        self.compiled = on == "htp" and all(p.get("compiled") for p in spec["parts"])
        self.files = [p["compiled"] if self.compiled else p["onnx"] for p in spec["parts"]]
        missing = [f for f in self.files if not (self.root / f).is_file()]
        if missing:
            raise RunnerError(f"{name} graph: missing file {missing[0]} in {self.root}")
        self.on, self.target, self.factory = on, target, sessions
        self.fp16 = str(manifest.get("precision", "fp16")) == "fp16"
        self.shared = self.compiled and manifest.get("weight_sharing") == "shared"
        self.sessions: list[Any] = []
        self.outputs: list[list[str]] = []

    def open(self) -> None:
        """Create the sessions (on the HTP this prepares or loads the graphs: slow)."""
        for f in self.files[len(self.sessions):]:
            path = self.root / f
            if self.factory is not None:
                session = self.factory(path, self)
            elif self.on == "htp":
                session = htp_graph_session(path, fp16=self.fp16, shared=self.shared, target=self.target,
                                            compiled=self.compiled)
            else:
                session = _cpu_session(path)
            self.sessions.append(session)
            self.outputs.append([o.name for o in session.get_outputs()])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every part in order, each fed by name from everything produced so far."""
        values = dict(feeds)
        for session, names in zip(self.sessions, self.outputs):
            wanted = {i.name: values[i.name] for i in session.get_inputs()}
            values.update(zip(names, session.run(names, wanted)))
        return values


class Runner:
    """Drive the pair in ``directory`` (the folder holding ``llm.json``) on ``on``.

    On the HTP the sessions name ``target`` (default: the one the manifest records, the device
    the bundle was compiled for).  Sessions open on first use (:meth:`open`), so a bad prompt is
    refused before the slow part.  ``sessions``: a hook ``(part file, graph) -> session`` that
    makes the sessions instead (a probe that runs the graphs otherwise; :func:`htp_graph_session`
    is the default on the HTP).
    """

    def __init__(self, directory: str | Path, on: str = "htp", target: Any = None,
                 sessions: Callable[[Path, _Graph], Any] | None = None):
        if on not in ON:
            raise RunnerError(f"unknown target {on!r} (expected one of {', '.join(ON)})")
        if not Path(directory).exists():
            raise RunnerError(f"{directory}: no such folder")
        try:
            self.manifest = load_manifest(directory)
        except ManifestError as exc:
            raise RunnerError(f"{directory}: {exc}") from None
        m = self.manifest
        self.on = on
        try:
            self.context, self.layers, self.vocab = int(m["context"]), int(m["layers"]), int(m["vocab"])
            self.kv_heads, self.head_dim = int(m["kv_heads"]), int(m["head_dim"])
        except (TypeError, ValueError):
            raise RunnerError(f"{directory}: context, layers, vocab, kv_heads and head_dim must be integers") from None
        try:
            self.layout = CacheLayout(m)
        except LayoutError as exc:
            raise RunnerError(f"{directory}: {exc}") from None
        alignment = m.get("kv_alignment", "left")
        if alignment not in ALIGNMENTS:
            raise RunnerError(f"{directory}: unknown kv_alignment {alignment!r} (known: {', '.join(ALIGNMENTS)})")
        self.right = alignment == "right"
        from qnnpasses.backends.targets import from_dict
        from qnnpasses.errors import BadInputError

        try:
            self.target = target or from_dict(m.get("target"))
        except BadInputError as exc:
            raise RunnerError(f"{directory}: llm.json names an unknown target: {exc}") from None
        self.graphs = {name: _Graph(m, name, on, self.target, sessions) for name in ("prefill", "decode")}
        self.load_seconds = 0.0
        self.keys = [self.layout.empty("key", self.context) for _ in range(self.layers)]
        self.values = [self.layout.empty("value", self.context) for _ in range(self.layers)]
        self.valid_len = 0
        #: per graph: [calls, wall seconds] of every :meth:`step` so far
        self.timings: dict[str, list[float]] = {"prefill": [0, 0.0], "decode": [0, 0.0]}

    def open(self) -> None:
        """Create every session now (timed as ``load_seconds``); later calls do nothing."""
        if all(len(g.sessions) == len(g.files) for g in self.graphs.values()):
            return
        start = time.perf_counter()
        for graph in self.graphs.values():
            graph.open()
        self.load_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ one step

    def reset(self) -> None:
        """Forget the cache (the buffers' stale contents are masked out by ``valid_len``)."""
        self.valid_len = 0

    def check_ids(self, ids: list[int] | np.ndarray, what: str = "prompt") -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise RunnerError(f"{what} token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        return ids

    def step(self, graph_name: str, ids: list[int]) -> np.ndarray:
        """Run ``ids`` (at most the graph's token count) at positions ``valid_len ..``;
        store their K/V, advance ``valid_len``; the logits ``[len(ids), vocab]`` (float32)."""
        self.open()
        graph = self.graphs[graph_name]
        count, v, roles = len(ids), self.valid_len, graph.roles
        if not 0 < count <= graph.tokens:
            raise RunnerError(f"{graph_name} takes 1..{graph.tokens} tokens, got {count}")
        if v > graph.past or v + count > self.context:
            raise RunnerError(f"{graph_name}: {v} cached + {count} new tokens do not fit context {self.context}")
        spec = self.manifest["graphs"][graph_name]
        cache = {roles[f"past_{kind}"][i]: buffers[i] for kind, buffers in (("key", self.keys), ("value", self.values))
                 for i in range(self.layers)}
        feeds = call_feed(spec, ids, v, cache, self.layout, self.right)
        start = time.perf_counter()
        out = graph.run(feeds)
        self.timings[graph_name][0] += 1
        self.timings[graph_name][1] += time.perf_counter() - start
        store_new(spec, out, count, v, cache, self.layout, self.right)
        self.valid_len = v + count
        return absolute_logits(out, roles)[0, new_slots(spec, count, self.right)]

    def feed(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Append ``ids`` to the cache: prefill chunks while they fit, then decode steps.
        (the logits of every fed token ``[len(ids), vocab]``, the number of graph calls).

        Right-aligned bundles take the short chunk first, as onnxruntime-genai pads a prompt on
        the left to whole windows; ours take it last."""
        prefill, logits, done = self.graphs["prefill"], [], 0
        while done < len(ids):
            use_prefill = len(ids) - done > 1 and self.valid_len <= prefill.past
            size = prefill.tokens if use_prefill else 1
            if use_prefill and self.right and done == 0:
                size = (len(ids) - 1) % prefill.tokens + 1
            chunk = ids[done : done + size]
            logits.append(self.step("prefill" if use_prefill else "decode", chunk))
            done += len(chunk)
        return (np.concatenate(logits) if logits else np.zeros((0, self.vocab), np.float32)), len(logits)

    # ------------------------------------------------------------------ the loops

    def check_prompt(self, prompt_ids: list[int] | np.ndarray) -> list[int]:
        """``prompt_ids`` as ints; RunnerError when empty, longer than the context or out of vocabulary."""
        ids = self.check_ids(prompt_ids)
        if not ids:
            raise RunnerError("the prompt is empty")
        if len(ids) > self.context:
            raise RunnerError(f"the prompt has {len(ids)} tokens, more than the context ({self.context})")
        return ids

    def generate(self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int, keep_logits: bool = False, *,
                 choose: Callable[[np.ndarray], int] | None = None, stop_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Generation from an empty cache: prefill the prompt, then decode.

        ``choose`` picks each token from its logits row (default: argmax, greedy); generation stops
        after a token in ``stop_ids`` (kept in ``tokens``); ``on_token`` sees each token as it comes."""
        ids = self.check_prompt(prompt_ids)
        if max_new_tokens < 0:
            raise RunnerError("max_new_tokens must not be negative")
        choose = choose or (lambda row: int(np.argmax(row)))
        stop = {int(t) for t in stop_ids}
        self.open()
        self.reset()
        result = Generation(tokens=[], prompt_tokens=len(ids), stopped="max_new_tokens", on=self.on,
                            load_seconds=self.load_seconds, files={n: g.files for n, g in self.graphs.items()})
        budget = min(max_new_tokens, self.context - len(ids))
        if budget < max_new_tokens:
            result.stopped = "context_full"
        if budget == 0:
            return result
        start = time.perf_counter()
        logits, result.prefill_calls = self.feed(ids)
        kept = [logits] if keep_logits else []
        result.tokens.append(choose(logits[-1]))
        result.prefill_seconds = time.perf_counter() - start
        while True:
            if on_token is not None:
                on_token(result.tokens[-1])
            if result.tokens[-1] in stop:
                result.stopped = "eos"
                break
            if len(result.tokens) >= budget:
                break
            start = time.perf_counter()
            logits, _ = self.feed(result.tokens[-1:])
            result.tokens.append(choose(logits[-1]))
            result.decode_seconds += time.perf_counter() - start
            result.decode_calls += 1
            kept += [logits] if keep_logits else []
        if keep_logits:
            result.logits = np.concatenate(kept)
        return result

    def score(self, prompt_ids: list[int] | np.ndarray, continuation: list[int] | np.ndarray) -> np.ndarray:
        """Teacher forcing: the logits of every position of ``prompt + continuation``
        (``[len, vocab]``), the prompt fed as :meth:`generate` feeds it, each continuation
        token through the decode graph as if it had been generated."""
        ids = self.check_prompt(prompt_ids)
        rest = self.check_ids(continuation, "continuation")
        if len(ids) + len(rest) > self.context:
            raise RunnerError(f"{len(ids) + len(rest)} tokens do not fit the context ({self.context})")
        self.reset()
        logits = [self.feed(ids)[0]]
        for token in rest:
            logits.append(self.feed([token])[0])
        return np.concatenate(logits)
