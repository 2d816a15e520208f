"""wide: token-level dynamic width pruning for Llama-family language models.

    import wide
    model = wide.wrap(hf_model, wide.WideConfig(target_sparsity=0.5))
    ...                                   # wide.training.train.train(...) or `wide calibrate`
    wide.save_routers(model, "routers/")
    model = wide.load(fresh_hf_model, "routers/")
    model = wide.from_pretrained("smollm2-135m-50")   # routers shipped in the package
"""

import sys as _sys

from .method.config import WideConfig
from .method.modeling import freeze_backbone, router_parameters, unwrap, wrap
from .method.offsets import calibrate_offsets
from .method.sparsity import forward_sparsity, sparsity_loss, track_sparsity, union_penalty
from .engine.inference import AcceleratedModel, accelerate, generate
from .io.serialization import CheckpointError, save_routers
from .method import fine
from .io import pretrained
from .method.fine import FineConfig
from .method.routers import TokenRouter
from .io.pretrained import from_pretrained, load  # directories and shipped names alike

# wide.fine and wide.pretrained are modules of the public API (wide.fine.attach,
# wide.pretrained.names): `import wide.fine` / `from wide.pretrained import ...` name the same module
# objects as wide.method.fine / wide.io.pretrained. No other old module path (wide.inference, ...)
# is kept: README, "How the code is laid out".
_sys.modules[__name__ + ".fine"] = fine
_sys.modules[__name__ + ".pretrained"] = pretrained

__version__ = "0.1.0"

__all__ = [
    "WideConfig", "wrap", "unwrap", "load", "save_routers", "from_pretrained", "CheckpointError",
    "calibrate_offsets", "forward_sparsity", "freeze_backbone", "router_parameters",
    "sparsity_loss", "union_penalty", "track_sparsity", "accelerate", "generate", "AcceleratedModel", "pretrained",
    "fine", "FineConfig", "TokenRouter",
]
