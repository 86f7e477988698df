"""Deprecated name of :mod:`kvlib.policy` (kvlib 0.1 said "strategy"; kept for one release).

Importing ``kvlib.strategy`` warns once and gives the module :mod:`kvlib.policy` itself, so its
classes are the very same objects (``Strategy`` is :class:`~kvlib.policy.Policy`).
"""

import sys
import warnings

import kvlib.policy

warnings.warn("kvlib.strategy is deprecated: import kvlib.policy", DeprecationWarning, stacklevel=2)

kvlib.policy.Strategy = kvlib.policy.Policy
sys.modules[__name__] = kvlib.policy
