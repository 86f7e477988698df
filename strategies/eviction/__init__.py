"""Eviction strategies: which stored tokens to drop. One module per strategy; importing this
package imports (and so registers) every module in it."""

from kvlib.strategies import import_modules

import_modules(__name__, __path__)
