"""The inference engine: ``inference`` (``accelerate``, the static-cache prefill/decode loops,
``generate``), ``fine_engine`` (decode with per-element sparsity), ``ops`` (operations per
backend), ``routing_rules``, ``graphs`` (CUDA-graph capture) and ``sampling``. Reads the method
and the kernels."""
