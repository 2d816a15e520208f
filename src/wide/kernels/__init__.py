from .attention import (  # noqa: F401
    decode_attention,
    decode_attention_reference,
    prefill_attention,
    prefill_attention_reference,
)
from .routing import RouteIndex, RouterPartials, build_route, route_reference  # noqa: F401
from .gemm_mn import gemm_mn, ffn_up, gemm_mn_reference, ffn_up_reference  # noqa: F401
from .gemm_k import gemm_k, gemm_k_reference  # noqa: F401
