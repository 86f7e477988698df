"""Quantization codecs: how many bits a sealed page's keys and values keep. One module per
policy (``uniform`` holds the group quantizers they share); importing this package imports
(and so registers) every module in it."""

from kvlib.policies import import_modules

import_modules(__name__, __path__)
