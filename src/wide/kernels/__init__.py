"""Triton kernels, one op per file, each beside its PyTorch reference. Triton is optional: without
it only the references (and the attention module's) import."""
from .attention import (  # noqa: F401
    decode_attention,
    decode_attention_reference,
    prefill_attention,
    prefill_attention_reference,
)

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the install
    pass
else:
    from .routing import RouteIndex, RouterPartials, build_route, route_reference  # noqa: F401
    from .gemm_mn import gemm_mn, ffn_up, gemm_mn_reference, ffn_up_reference  # noqa: F401
    from .gemm_k import gemm_k, gemm_k_reference  # noqa: F401
    from .norm_route import norm_route, norm_route_reference  # noqa: F401
    from .router_mask import router_mask, router_mask_reference  # noqa: F401
    from .rope import rope_decode, rope_prefill, rope_reference  # noqa: F401
    from .silu_mul import silu_mul, silu_mul_reference  # noqa: F401
    from .batch_shared import batch_shared_mask, batch_shared_mask_reference  # noqa: F401
    from .skip_rule import skip_rule, skip_rule_reference  # noqa: F401
