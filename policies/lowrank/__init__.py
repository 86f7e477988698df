"""Low-rank codecs: sealed pages stored in a smaller basis or with fewer channels. One module
per policy (``basis`` holds the fitting they share); importing this package imports (and so
registers) every module in it."""

from kvlib.policies import import_modules

import_modules(__name__, __path__)
