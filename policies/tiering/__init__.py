"""Tiering policies: where pages live (device, host) and when they move. One module per
policy; importing this package imports (and so registers) every module in it."""

from kvlib.policies import import_modules

import_modules(__name__, __path__)
