"""Deprecated name of :mod:`kvlib.strategies` (kept for one release).

"Policy" and "strategy" were two words for one thing; kvlib says "strategy". Importing
``kvlib.policies`` (or any ``kvlib.policies.<kind>.<module>``) warns once and gives the very
module objects of ``kvlib.strategies``: no strategy module is imported twice, so each class is
registered once and ``isinstance`` checks hold across both names.
"""

import sys
import warnings

import kvlib.strategies

warnings.warn("kvlib.policies is deprecated: import kvlib.strategies", DeprecationWarning, stacklevel=2)

_OLD, _NEW = __name__, kvlib.strategies.__name__
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_NEW + "."):
        sys.modules[_OLD + _name[len(_NEW) :]] = _module
sys.modules[_OLD] = kvlib.strategies
