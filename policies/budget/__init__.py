"""Budget allocations: how a token budget splits over layers and heads. One module per
allocation; importing this package imports (and so registers) every module in it."""

from kvlib.policies import import_modules

import_modules(__name__, __path__)
