"""Checkpoints on disk: the tensor layout, the loader, each weight format, the quantisation schemes,
the converters (``dsv4-convert-config``, ``dsv4-convert-model``) and ``dsv4-make-tiny``.

Modules: ``layout`` (every stored tensor's name / dtype / shape), ``shards`` (safetensors headers
checked, tensors read lazily), ``loader`` (validate, dequantise, fill a ``Transformer``),
``fp8_mxfp4`` (the original FP8 block / MXFP4 expert formats), ``int8_int4`` / ``mx`` / ``hif8``
(the converted formats), ``qscheme`` (which linear is stored how), ``digest`` (the weights
digest, cached), ``convert_config``, ``convert_model``, ``make_tiny``.

Kept free of imports: ``engine.config`` and ``engine.ops`` import single format modules from here.
"""
