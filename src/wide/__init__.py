"""wide: token-level dynamic width pruning for Llama-family language models.

    import wide
    model = wide.wrap(hf_model, wide.WideConfig(target_sparsity=0.5))
    ...                                   # wide.train.train(...) or `wide calibrate`
    wide.save_routers(model, "routers/")
    model = wide.load(fresh_hf_model, "routers/")
    model = wide.from_pretrained("smollm2-135m-50")   # routers shipped in the package
"""

from .config import WideConfig
from .modeling import (
    calibrate_offsets,
    forward_sparsity,
    freeze_backbone,
    router_parameters,
    sparsity_loss,
    track_sparsity,
    union_penalty,
    unwrap,
    wrap,
)
from .inference import AcceleratedModel, accelerate, generate
from .serialization import CheckpointError, save_routers
from . import fine, pretrained
from .fine import FineConfig
from .routers import TokenRouter
from .pretrained import from_pretrained, load  # directories and shipped names alike

__version__ = "0.1.0"

__all__ = [
    "WideConfig", "wrap", "unwrap", "load", "save_routers", "from_pretrained", "CheckpointError",
    "calibrate_offsets", "forward_sparsity", "freeze_backbone", "router_parameters",
    "sparsity_loss", "union_penalty", "track_sparsity", "accelerate", "generate", "AcceleratedModel", "pretrained",
    "fine", "FineConfig", "TokenRouter",
]
