"""The pass-contract declarations, with a fallback while the contract API is not in api.py yet."""

from __future__ import annotations

try:  # pragma: no cover - depends on the pass-contract API landing
    from qnnpasses.passmanager.api import EXACT, changes_interface
except ImportError:  # pragma: no cover
    EXACT = "exact"

    def changes_interface(reason: str) -> str:
        return f"changes-interface: {reason}"

__all__ = ["EXACT", "changes_interface"]
