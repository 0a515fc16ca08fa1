"""The devices qnnpasses can target: one registry of Snapdragon SoCs and their Hexagon HTP arch.

Every command that talks to the backend (``check``, ``lint``, ``diagnose``, ``compile``,
``quantize``, ``llm``, ``generate``, ``run``, ...) takes ``--soc NAME`` and ``--htp-arch vNN``;
:func:`resolve` turns them into a :class:`Target`, :func:`activate` makes it the one the backend
door (:mod:`qnnpasses.backends.htp`) names in its provider options (``soc_model``, ``htp_arch``)
for this process and the probe children it starts.

Facts (SoC model numbers as QNN's ``QnnTypes.h`` defines them, as ExecuTorch's Qualcomm backend
lists them with their HTP arch): Snapdragon X Elite SC8380XP 60 / v73 (the default: the target
the op-support table was measured for), 8 Gen 2 SM8550 43 / v73, 8s Gen 3 SM8635 68 / v73,
8 Gen 3 SM8650 57 / v75, 8 Elite SM8750 69 / v79, 8 Elite Gen 5 SM8850 87 / v81, SA8295P 39 / v68.

Memory (the peak LPDDR5X rate Qualcomm announced, times the bus width): X Elite LPDDR5X-8533 on a
128-bit bus, 136 GB/s (Qualcomm's X Elite announcement, Oct. 2023); 8 Gen 2 4200 MHz (8400 MT/s),
8 Gen 3 4800 MHz (9600 MT/s), 8 Elite 5300 MHz (10600 MT/s, 84.8 GB/s), each on a 64-bit bus
(the phones' launch specifications).  The others are left unknown.  Decode on a phone is bound
by these bytes per second (:mod:`qnnpasses.llm.footprint`).

What the simulated HTP does with each target is measured by ``tests/test_targets.py`` and
``tools/targets_doc.py`` (``docs/targets.md``): a target it knows prepares, runs and compiles a
float graph in fp16, and the binary differs per target (SoC and arch are compiled in).  A SoC
model the backend does not know leaves every node to the CPU: :func:`qnnpasses.backends.htp.check_target` asks the backend with a three-node graph
and refuses such a target with one line.  The backend does not check that the arch matches the SoC, so
:func:`resolve` does: a ``--htp-arch`` that contradicts ``--soc`` is refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

from qnnpasses.errors import BadInputError

#: The environment variable that carries the active target into child processes.
ENV = "QNNPASSES_TARGET"


@dataclass(frozen=True)
class Target:
    """One device: what the backend is told (``soc_model``, ``htp_arch``) and how users name it."""

    name: str  # short name: "8gen3"
    part: str  # part number: "SM8650"
    product: str  # "Snapdragon 8 Gen 3"
    soc_model: int
    htp_arch: int
    aliases: tuple[str, ...] = ()
    memory_mts: int | None = None  # peak LPDDR transfer rate, MT/s (None: not known here)
    memory_bus_bits: int = 64

    @property
    def memory_bytes_per_second(self) -> float | None:
        """Peak DRAM bandwidth: transfers per second times the bus width in bytes."""
        return self.memory_mts * 1e6 * self.memory_bus_bits / 8 if self.memory_mts else None

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("aliases")
        data["htp_arch"] = f"v{self.htp_arch}"
        data["memory_bytes_per_second"] = self.memory_bytes_per_second
        return data

    def __str__(self) -> str:
        return f"{self.product} ({self.part}, soc_model {self.soc_model}, HTP v{self.htp_arch})"


TARGETS: tuple[Target, ...] = (
    Target("xelite", "SC8380XP", "Snapdragon X Elite", 60, 73, ("x-elite", "snapdragon-x-elite"), 8533, 128),
    Target("8gen2", "SM8550", "Snapdragon 8 Gen 2", 43, 73, ("snapdragon-8-gen-2",), 8400),
    Target("8sgen3", "SM8635", "Snapdragon 8s Gen 3", 68, 73, ("snapdragon-8s-gen-3",)),
    Target("8gen3", "SM8650", "Snapdragon 8 Gen 3", 57, 75, ("snapdragon-8-gen-3",), 9600),
    Target("8elite", "SM8750", "Snapdragon 8 Elite", 69, 79, ("snapdragon-8-elite",), 10600),
    Target("8elitegen5", "SM8850", "Snapdragon 8 Elite Gen 5", 87, 81, ("snapdragon-8-elite-gen-5",)),
    Target("sa8295", "SA8295P", "Snapdragon SA8295P", 39, 68, ("sa8295p",)),
)
DEFAULT = TARGETS[0]
ARCHS = tuple(sorted({t.htp_arch for t in TARGETS}))


def _key(text: str) -> str:
    """``Snapdragon 8 Gen 3``, ``8-gen-3``, ``8gen3``, ``SM8650`` -> one spelling."""
    return re.sub(r"[\s_\-]+", "", text.strip().lower()).removeprefix("snapdragon")


def _index() -> dict[str, Target]:
    index = {}
    for target in TARGETS:
        for name in (target.name, target.part, target.product, *target.aliases):
            index[_key(name)] = target
    return index


def parse_arch(text: str) -> int:
    """``v75`` / ``75`` -> 75; BadInputError for an arch no target in the registry has."""
    match = re.fullmatch(r"[vV]?(\d+)", text.strip())
    arch = int(match.group(1)) if match else None
    if arch not in ARCHS:
        raise BadInputError(f"--htp-arch {text}: unknown HTP arch (known: {', '.join(f'v{a}' for a in ARCHS)})")
    return arch


def resolve(soc: str | None = None, htp_arch: str | None = None) -> Target:
    """The target ``--soc`` / ``--htp-arch`` name (the default when neither is given).

    ``--htp-arch`` alone picks the first SoC of that arch in the registry; both must agree."""
    arch = parse_arch(htp_arch) if htp_arch is not None else None
    if soc is None:
        if arch is None:
            return DEFAULT
        return next(t for t in TARGETS if t.htp_arch == arch)
    target = _index().get(_key(soc))
    if target is None:
        names = ", ".join(f"{t.name} ({t.part})" for t in TARGETS)
        raise BadInputError(f"--soc {soc}: unknown SoC (known: {names})")
    if arch is not None and arch != target.htp_arch:
        raise BadInputError(f"--htp-arch v{arch} contradicts --soc {soc}: the {target.product} has HTP v{target.htp_arch}")
    return target


def from_dict(data: dict[str, object] | None) -> Target:
    """The target a manifest or report recorded (:meth:`Target.as_dict`); the default when absent."""
    if not data:
        return DEFAULT
    return resolve(str(data.get("part") or data.get("name")))


_active: Target | None = None


def activate(target: Target) -> Target:
    """Make ``target`` the one the backend is told about, here and in child processes, and its
    arch's op-support table the one ``load_table("htp")`` returns."""
    from qnnpasses.op_support.table import use_htp_arch

    global _active
    _active = target
    os.environ[ENV] = target.name
    use_htp_arch(target.htp_arch)
    return target


def active() -> Target:
    """The target of this process: the activated one, else the one the parent passed, else the default."""
    if _active is not None:
        return _active
    name = os.environ.get(ENV)
    if name:
        try:
            return activate(resolve(name))
        except BadInputError:
            return DEFAULT
    return DEFAULT
