"""Recompute policies: what a layer stores instead of keys and values, which are recomputed from
it when read. One module per policy; importing this package imports (and so registers) every
module in it."""

from kvlib.policies import import_modules

import_modules(__name__, __path__)
