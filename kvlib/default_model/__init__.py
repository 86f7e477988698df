"""kvlib's embedded default model: a small byte-level Llama trained by :mod:`.train`.

The weights (``model.safetensors``, ``config.json``) ship inside the package, so ``kvlib compare``
runs out of the box with no network. :func:`load_default_model` returns the model and its
:class:`ByteTokenizer`; :data:`MODEL_DIR` is the folder ``transformers`` can load directly.
"""

from kvlib.default_model.files import MODEL_DIR, load_default_model
from kvlib.default_model.tokenizer import ByteTokenizer

__all__ = ["MODEL_DIR", "ByteTokenizer", "load_default_model"]
