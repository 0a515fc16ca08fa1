"""The pass API: what a rewrite declares about itself and what it returns.

A pass is a small class registered with :func:`register_pass`::

    @register_pass
    class DropIdentity(Pass):
        name = "drop-identity"
        summary = "Identity(X) -> X"
        lossless = True

        @dataclass
        class Options:
            keep_outputs: bool = True

        def run(self, ir, ctx):
            ...
            return PassResult(changed=n > 0, stats={"removed": n})

What it declares, the pass manager enforces:

============  =================================================================
``lossless``  False: runs only with ``allow_lossy``; verification records the
              deviation instead of rolling back.
``requires``  properties the graph must have first (``"static-shapes"``); the
              pass is skipped with the reason when they do not hold.
``Options``   a dataclass: typed options with defaults, settable from the
              textual pipeline (``name{key=value}``).
============  =================================================================

A pass works in place on ``ir.graph``.  It must not modify constant arrays in place
(they may be memory maps of the input's weights, and the manager's rollback copy
shares them): make a new ``gs.Constant`` instead.  Built-in and plugin passes use
exactly this API.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import itertools
import pkgutil
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from qnnpasses.errors import BadInputError, PipelineSpecError
from qnnpasses.ir.model import IRModel

Stat = typing.Union[int, float, str]
ENTRY_POINT_GROUP = "qnnpasses.passes"
STATIC_SHAPES = "static-shapes"
KNOWN_REQUIREMENTS = frozenset({STATIC_SHAPES})


@dataclass
class PassResult:
    """What a pass did: whether the graph changed, its own counters, and notes for humans."""

    changed: bool
    stats: dict[str, Stat] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class PassContext:
    """What the pipeline run gives every pass besides the graph."""

    allow_lossy: bool = False
    shapes: dict[str, list[int]] = field(default_factory=dict)  # --shape NAME=D0,D1,...
    calibration: Any = None  # an iterable of input dicts (--calib), when given
    verbose: bool = False
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)
    _taken: set[str] | None = field(default=None, repr=False)
    _taken_graph: int | None = field(default=None, repr=False)

    def unique_name(self, ir: IRModel, prefix: str) -> str:
        """A node or tensor name not yet used in the graph, starting with ``prefix``.

        The graph's names are collected once per pass (the manager calls
        :meth:`forget_names` before each), not per call: passes ask for thousands.
        """
        if self._taken is None or self._taken_graph != id(ir.graph):
            self._taken = set(ir.graph.tensors().keys()) | {n.name for n in ir.graph.nodes}
            self._taken_graph = id(ir.graph)
        while True:
            candidate = f"{prefix}_qp{next(self._counter)}"
            if candidate not in self._taken:
                self._taken.add(candidate)
                return candidate

    def forget_names(self) -> None:
        """Drop the cached set of taken names (the graph may have changed)."""
        self._taken = self._taken_graph = None


@dataclass
class NoOptions:
    """For passes without options."""


class Pass:
    """Base class of every rewrite; see the module docstring."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    requires: ClassVar[frozenset[str]] = frozenset()
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None, **values: Any):
        if options is not None and values:
            raise TypeError("give either an Options instance or keyword values, not both")
        self.options = options if options is not None else self.Options(**values)

    def run(self, ir: IRModel, ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def planned_input_shapes(self, ir: IRModel, ctx: PassContext) -> dict[str, list[int]] | None:
        """The static input shapes this pass will set, if it sets any (fix-shapes does).

        The manager makes its verification inputs with these shapes, so that the same
        inputs run before and after the pass.
        """
        return None

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls.Options))

    def explicit_options(self) -> dict[str, Any]:
        """The options whose values differ from the defaults, for the textual form."""
        default = self.Options()
        return {
            f.name: getattr(self.options, f.name)
            for f in dataclasses.fields(self.options)
            if getattr(self.options, f.name) != getattr(default, f.name)
        }

    def __repr__(self) -> str:
        return f"<pass {self.name} {self.explicit_options() or ''}>"


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Pass]] = {}
_ORIGINS: dict[str, str] = {}
_builtins_loaded = False


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: validate a pass's declaration and make it known by name."""
    problems = []
    if not issubclass(cls, Pass):
        problems.append("must subclass qnnpasses.passmanager.api.Pass")
    if not cls.name or cls.name != cls.name.strip() or any(c in cls.name for c in ",{}()= "):
        problems.append(f"needs a name without spaces or ,{{}}()= (got {cls.name!r})")
    if not cls.summary:
        problems.append("needs a one-line summary")
    if not dataclasses.is_dataclass(cls.Options):
        problems.append("Options must be a dataclass")
    unknown = set(cls.requires) - KNOWN_REQUIREMENTS
    if unknown:
        problems.append(f"requires unknown properties {sorted(unknown)}")
    if problems:
        raise TypeError(f"pass {cls.__qualname__}: " + "; ".join(problems))
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        existing = _REGISTRY[cls.name]
        if (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"pass name '{cls.name}' is already registered by {existing.__module__}.{existing.__qualname__}")
    _REGISTRY[cls.name] = cls
    _ORIGINS[cls.name] = cls.__module__
    return cls


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    import qnnpasses.passes as package

    # one package per family (attention, norm, layout, ...); its public modules are passes
    for family in pkgutil.iter_modules(package.__path__):
        if not family.ispkg or family.name.startswith("_"):
            continue
        family_package = importlib.import_module(f"{package.__name__}.{family.name}")
        for info in pkgutil.iter_modules(family_package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{family_package.__name__}.{info.name}")


def load_entry_point_plugins() -> list[str]:
    """Import every plugin registered in the ``qnnpasses.passes`` entry-point group."""
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            raise BadInputError(f"plugin entry point '{ep.name}' ({ep.value}) failed to load: {exc}") from None
        loaded.append(ep.name)
    return loaded


def load_plugin_file(path: str | Path) -> str:
    """Import a plugin module from a file path; its passes register as it imports."""
    file = Path(path)
    if not file.is_file():
        raise BadInputError(f"plugin file not found: {file}")
    module_name = f"qnnpasses_plugin_{file.stem}_{abs(hash(str(file.resolve()))) % 10**8}"
    if module_name in sys.modules:
        return module_name
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise BadInputError(f"cannot import plugin file {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise BadInputError(f"plugin file {file} failed to import: {type(exc).__name__}: {exc}") from None
    return module_name


def registered_passes() -> dict[str, type[Pass]]:
    _load_builtins()
    return dict(sorted(_REGISTRY.items()))


def pass_origin(name: str) -> str:
    return _ORIGINS.get(name, "?")


def get_pass(name: str) -> type[Pass]:
    passes = registered_passes()
    if name not in passes:
        raise PipelineSpecError(f"unknown pass '{name}' (known: {', '.join(passes)})")
    return passes[name]


# --------------------------------------------------------------------------- options


def parse_option_value(pass_cls: type[Pass], key: str, text: str) -> Any:
    """Convert an option's text from a pipeline spec into the type its dataclass declares."""
    fields = {f.name: f for f in dataclasses.fields(pass_cls.Options)}
    if key not in fields:
        known = ", ".join(fields) or "none"
        raise PipelineSpecError(f"pass '{pass_cls.name}' has no option '{key}' (options: {known})")
    hints = typing.get_type_hints(pass_cls.Options)
    try:
        return _convert(hints[key], text)
    except ValueError as exc:
        raise PipelineSpecError(f"pass '{pass_cls.name}' option '{key}': {exc}") from None


def _convert(hint: Any, text: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        non_none = [a for a in args if a is not type(None)]
        if text.lower() in ("none", "") and len(non_none) < len(args):
            return None
        return _convert(non_none[0], text)
    if origin in (tuple, list):
        item = args[0] if args else str
        values = tuple(_convert(item, part) for part in text.split(":") if part != "")
        return values if origin is tuple else list(values)
    if hint is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got '{text}'")
    if hint is int:
        try:
            return int(text, 0)
        except ValueError:
            raise ValueError(f"expected an integer, got '{text}'") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got '{text}'") from None
    if hint is str:
        return text
    raise ValueError(f"unsupported option type {hint}")


def format_option_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ":".join(format_option_value(v) for v in value)
    return str(value)
