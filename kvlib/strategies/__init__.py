"""Deprecated name of :mod:`kvlib.policies` (kvlib 0.1 said "strategy"; kept for one release).

Importing ``kvlib.strategies`` (or any ``kvlib.strategies.<kind>.<module>``) warns once and gives
the very module objects of ``kvlib.policies``: no policy module is imported twice, so each class is
registered once and ``isinstance`` checks hold across both names.
"""

import sys
import warnings

import kvlib.policies

warnings.warn("kvlib.strategies is deprecated: import kvlib.policies", DeprecationWarning, stacklevel=2)

_OLD, _NEW = __name__, kvlib.policies.__name__
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_NEW + "."):
        sys.modules[_OLD + _name[len(_NEW) :]] = _module
sys.modules[_OLD] = kvlib.policies
