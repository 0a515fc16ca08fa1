"""Deprecated: the pass API's earlier home.  Import from :mod:`qnnpasses.api` instead."""

from __future__ import annotations

import warnings

from qnnpasses.api import *  # noqa: F401,F403 - the same names, for plugins written against this path
from qnnpasses.api import __all__  # noqa: F401

warnings.warn("qnnpasses.pass_api is deprecated: import from qnnpasses.api", DeprecationWarning, stacklevel=2)
