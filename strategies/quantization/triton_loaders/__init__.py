"""The quantization codecs' Triton tile loaders (:mod:`kvlib.triton_readers`), one module per
codec family. Nothing here is imported with the package: the modules import triton, which is
optional, and are loaded by the codecs' :meth:`~kvlib.codec.TensorCodec.triton_reader` where it
is called (:mod:`kvlib.kernels.paged_attention_triton`)."""
