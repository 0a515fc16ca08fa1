"""The pass API: what a rewrite declares about itself and what it returns.

A pass is a small class registered with :func:`register_pass`::

    @register_pass
    class DropIdentity(Pass):
        name = "drop-identity"
        summary = "Identity(X) -> X"
        contract = EXACT
        requires = frozenset({"folded"})
        ensures = frozenset()

        @dataclass
        class Options:
            keep_outputs: bool = True

        def run(self, ir, ctx):
            ...
            return PassResult(changed=n > 0, stats={"removed": n})

What it declares, the pass manager enforces:

==============  ===============================================================
``contract``    what the pass guarantees about the outputs (below); the manager
                verifies exactly that under ``--verify``.
``requires``    properties (:func:`register_property`) the graph must have first.
                One with a checker that does not hold: the pass is skipped with
                the reason.  Every one orders the pass after the passes that
                ``ensure`` it when a pipeline is derived (:func:`derive_order`).
``ensures``     properties that hold after the pass; checked where a checker exists.
``Options``     a dataclass: typed options with defaults, settable from the
                textual pipeline (``name{key=value}``).
``anchor_ops``  op types one of which every match contains; a graph without any
                is left alone without running the pass.
==============  ===============================================================

Contracts:

==================================  ==================================================
``EXACT``                           rounding-level: verified with the tight tolerance
                                    (``--atol/--rtol/--min-cosine``) on every case.
``approximate(atol=, rtol=,         within its stated tolerance, verified with it.
min_cosine=, why=)``                Runs by default only when that tolerance is
                                    small (:data:`SMALL_TOLERANCE`); a larger one
                                    (``mha-to-gqa``) needs ``--allow-lossy``.
``assumes("what", holds_on=...)``   exact where the assumption holds: verified with
                                    the tight tolerance on the verification cases
                                    that satisfy it (``holds_on``, e.g. inputs
                                    without fully masked rows, calibration data).
``changes_interface("what")``       input/output shapes, dtypes or names change:
                                    verified with the tight tolerance through the
                                    pass's mapping (:meth:`Pass.planned_input_shapes`,
                                    :meth:`Pass.output_renames`,
                                    :meth:`Pass.map_reference`, dtype narrowing).
==================================  ==================================================

Whether a pass changed the graph is decided by the manager from the graph (a
structural fingerprint), not from ``PassResult.changed``.  A pass works in place on
``ir.graph``.  It must not modify constant arrays in place (they may be memory maps of
the input's weights, and the manager's rollback copy shares them): make a new
``gs.Constant`` instead.  Built-in and plugin passes use exactly this API.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import itertools
import math
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

# --------------------------------------------------------------------------- contracts

EXACT_KIND, APPROXIMATE_KIND, ASSUMES_KIND, INTERFACE_KIND = "exact", "approximate", "assumes", "changes-interface"

# Verification cases (qnnpasses.backends.cpu.verification_cases makes them):
CASE_RANDOM = "random"             # seeded random values, masks of ones
CASE_PADDED_RIGHT = "padded-right"  # mask inputs with zeros at the end (padding keys/queries)
CASE_PADDED_LEFT = "padded-left"    # zeros at the start: causal models get fully masked query rows
CASE_MASKED = "masked"              # scattered zeros in masks, the first position kept
CASE_ROW_MASKED = "row-masked"      # query x key masks with their first query row all masked
CASE_CAUSAL = "causal"              # query x key masks lower-triangular (aligned at the last key)
CASE_EXTREME = "extreme"            # large-magnitude float inputs, the largest valid token ids
CASE_GIVEN = "given"                # --inputs / --calib samples
ALL_CASES = frozenset({CASE_RANDOM, CASE_PADDED_RIGHT, CASE_PADDED_LEFT, CASE_MASKED, CASE_ROW_MASKED, CASE_CAUSAL,
                       CASE_EXTREME, CASE_GIVEN})

# An approximation whose stated tolerance is within these bounds runs by default;
# a looser one needs allow_lossy (--allow-lossy).
SMALL_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3, "min_cosine": 0.9999}


@dataclass(frozen=True)
class Contract:
    """What a pass guarantees about the model's outputs; see the module docstring."""

    kind: str
    statement: str = ""                    # why (approximate) / the assumption / the interface change
    atol: float | None = None              # approximate: its own tolerance
    rtol: float | None = None
    min_cosine: float | None = None
    holds_on: frozenset[str] = ALL_CASES   # the verification cases it is checked on

    @property
    def needs_opt_in(self) -> bool:
        """True when the pass runs only with ``allow_lossy``."""
        if self.kind != APPROXIMATE_KIND:
            return False
        return not (self.atol <= SMALL_TOLERANCE["atol"] and self.rtol <= SMALL_TOLERANCE["rtol"]
                    and self.min_cosine >= SMALL_TOLERANCE["min_cosine"])

    def tolerance(self, atol: float, rtol: float, min_cosine: float) -> tuple[float, float, float]:
        """The tolerance this contract is verified with, given the run's tight one."""
        if self.kind == APPROXIMATE_KIND:
            return self.atol, self.rtol, self.min_cosine
        return atol, rtol, min_cosine

    def describe(self) -> str:
        if self.kind == EXACT_KIND:
            return "exact"
        if self.kind == APPROXIMATE_KIND:
            bound = f"atol={self.atol:g}, rtol={self.rtol:g}, cosine>={self.min_cosine:g}"
            lossy = ", needs --allow-lossy" if self.needs_opt_in else ""
            return f"approximate ({bound}{lossy}): {self.statement}"
        if self.kind == ASSUMES_KIND:
            return f"exact assuming {self.statement} (verified on: {', '.join(sorted(self.holds_on))})"
        return f"changes the interface: {self.statement}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "text": self.describe()}
        if self.statement:
            out["statement"] = self.statement
        if self.kind == APPROXIMATE_KIND:
            out.update(atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine, needs_opt_in=self.needs_opt_in)
        if self.holds_on != ALL_CASES:
            out["verified_on"] = sorted(self.holds_on)
        return out


EXACT = Contract(EXACT_KIND)


def approximate(*, why: str, atol: float = 0.0, rtol: float = 0.0, min_cosine: float = 1.0) -> Contract:
    """Outputs move by at most ``atol + rtol*max|ref|`` with cosine >= ``min_cosine``, because ``why``.

    ``atol=math.inf, min_cosine=-1`` states no bound: the deviation is recorded, never enforced.
    """
    if not why:
        raise TypeError("approximate(...) needs why=: what the approximation is")
    if atol < 0 or rtol < 0 or not -1.0 <= min_cosine <= 1.0:
        raise TypeError("approximate(...): atol, rtol >= 0 and -1 <= min_cosine <= 1")
    return Contract(APPROXIMATE_KIND, why, float(atol), float(rtol), float(min_cosine))


def assumes(what: str, *, holds_on: typing.Iterable[str] = (CASE_RANDOM, CASE_GIVEN)) -> Contract:
    """Exact when ``what`` holds; verified on the cases in ``holds_on`` (inputs that satisfy it)."""
    cases = frozenset(holds_on)
    if not what or not cases or cases - ALL_CASES:
        raise TypeError(f"assumes(...) needs the assumption and cases from {sorted(ALL_CASES)}")
    return Contract(ASSUMES_KIND, what, holds_on=cases)


def changes_interface(what: str) -> Contract:
    """Input/output shapes, dtypes or names change (``what``); verified through the pass's mapping."""
    if not what:
        raise TypeError("changes_interface(...) needs a description of the change")
    return Contract(INTERFACE_KIND, what)


# --------------------------------------------------------------------------- properties


@dataclass(frozen=True)
class Property:
    """A named fact about a graph that passes require or ensure.

    ``check(ir)`` returns ``""`` when the property holds, else the reason it does not;
    a property without a checker only orders passes (the manager cannot test it).
    """

    name: str
    summary: str
    check: typing.Callable[[IRModel], str] | None = None


_PROPERTIES: dict[str, Property] = {}


def register_property(name: str, summary: str, check: typing.Callable[[IRModel], str] | None = None) -> Property:
    """Declare a property passes may require or ensure (plugins declare their own first)."""
    if not name or any(c in name for c in ",{}()= "):
        raise TypeError(f"property name needs no spaces or ,{{}}()= (got {name!r})")
    existing = _PROPERTIES.get(name)
    if existing is not None and (existing.summary, existing.check) != (summary, check):
        raise TypeError(f"property '{name}' is already registered: {existing.summary}")
    _PROPERTIES[name] = Property(name, summary, check)
    return _PROPERTIES[name]


def registered_properties() -> dict[str, Property]:
    return dict(sorted(_PROPERTIES.items()))


def get_property(name: str) -> Property:
    if name not in _PROPERTIES:
        raise PipelineSpecError(f"unknown property '{name}' (known: {', '.join(sorted(_PROPERTIES))})")
    return _PROPERTIES[name]


def _static_shapes_reason(ir: IRModel) -> str:
    from qnnpasses.ir.shapes import has_static_shapes

    if has_static_shapes(ir.graph):
        return ""
    return "needs static input shapes; give --shape NAME=D0,D1,... or run fix-shapes first"


STATIC_SHAPES = register_property("static-shapes", "every graph input and output has static dims",
                                  _static_shapes_reason).name
FOLDED = register_property("folded", "constant and shape arithmetic folded, Constant nodes are initializers").name
INT32_INDICES = register_property("int32-indices", "int64 compute narrowed to int32 where exact").name
NO_GATHERND = register_property("no-gathernd", "GatherND with constant indices lowered to Gather/Slice/Reshape").name
FINITE_MASKS = register_property("finite-masks", "attention masks are finite and NaN guards are gone").name
ATTENTION_REWRITTEN = register_property(
    "attention-rewritten", "attention blocks are in their final form (grouped, rotary as MatMul)").name
NORMS_FUSED = register_property("norms-fused", "RMSNorm/LayerNorm subgraphs fused into single ops").name
GELU_FUSED = register_property("gelu-fused", "GeLU subgraphs fused into Gelu").name
NORMS_FINAL = register_property("norms-final", "normalizations in the form the HTP runs (fused, decomposed or fp16-safe)").name
# Ordering only (no checker: a model may keep what a lowering could not handle, and the passes
# that require these still do their part; the lowerings and fix-shapes note what is left).
CONTRIB_LOWERED = register_property(
    "contrib-lowered", "onnxruntime-only ops (com.microsoft contrib ops, SimplifiedLayerNormalization) lowered to "
    "standard ONNX, so shape inference follows the whole graph").name
DIMS_BOUND = register_property(
    "dims-bound", "symbolic input dims bound to values (fix-shapes), so shape arithmetic can fold").name


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
    target_opset: int | None = None  # --target-opset N: no pass raises the model's opset above it
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
            self._taken = _names_in(ir)
            self._taken_graph = id(ir.graph)
        while True:
            candidate = f"{prefix}_qp{next(self._counter)}"
            if candidate not in self._taken:
                self._taken.add(candidate)
                return candidate

    def forget_names(self) -> None:
        """Drop the cached set of taken names (the graph may have changed)."""
        self._taken = self._taken_graph = None


def _names_in(ir: IRModel) -> set[str]:
    """Every node and tensor name of the graph and its subgraphs (one walk; graphsurgeon's
    ``tensors()`` builds and checks a name map, several times slower)."""
    names: set[str] = set()
    for graph in ir.graphs():
        names.update(t.name for t in graph.inputs)
        names.update(t.name for t in graph.outputs)
        for node in graph.nodes:
            names.add(node.name)
            names.update(t.name for t in node.inputs)
            names.update(t.name for t in node.outputs)
    return names


@dataclass
class NoOptions:
    """For passes without options."""


class Pass:
    """Base class of every rewrite; see the module docstring."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    contract: ClassVar[Contract] = EXACT
    requires: ClassVar[frozenset[str]] = frozenset()
    ensures: ClassVar[frozenset[str]] = frozenset()
    Options: ClassVar[type] = NoOptions
    lossless: ClassVar[bool] = True  # derived from contract (False: needs --allow-lossy); kept for old plugins
    #: op types of which every subgraph the pass rewrites holds at least one (as MLIR's and
    #: onnxscript's rewrite patterns name the op they are rooted at).  When no node of the graph
    #: or of its subgraphs has one, the manager records the pass unchanged without running it
    #: (nor walking the graph around it).  Empty: the pass always runs.
    anchor_ops: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__
        if "lossless" in declared and "contract" not in declared and not declared["lossless"]:
            # a plugin written against the boolean flag: lossy with no stated bound
            cls.contract = approximate(why="declared lossless=False (no stated tolerance)", atol=math.inf,
                                       min_cosine=-1.0)
        cls.lossless = not cls.contract.needs_opt_in

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

    def output_renames(self, ir: IRModel, ctx: PassContext) -> dict[str, str] | None:
        """Graph outputs this pass renames, old name -> new name (a ``changes_interface`` mapping).

        Called before the pass runs; verification compares each old output to its new name.
        """
        return None

    def map_reference(self, reference: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs the rewritten graph must produce, given the outputs before the pass
        (already renamed by :meth:`output_renames`) on the verification ``inputs``: the
        ``changes_interface`` mapping for passes whose outputs change more than their names
        (e.g. a KV output cut to the new positions).  Called after the pass ran; by default
        the outputs stay what they were.
        """
        return reference

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
    if not isinstance(cls.contract, Contract):
        problems.append("contract must be EXACT, approximate(...), assumes(...) or changes_interface(...)")
    for kind in ("requires", "ensures"):
        declared = getattr(cls, kind)
        if isinstance(declared, str) or not all(isinstance(p, str) for p in declared):
            problems.append(f"{kind} must be a set of property names")
            continue
        unknown = set(declared) - set(_PROPERTIES)
        if unknown:
            problems.append(f"{kind} unknown properties {sorted(unknown)} (known: {', '.join(sorted(_PROPERTIES))}; "
                            "declare new ones with register_property)")
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
