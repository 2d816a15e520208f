"""The engine's modes, and the one that runs what a checkpoint carries (``mode="auto"``)."""
from __future__ import annotations

from ..method.fine import get_fine

__all__ = ["MODES", "ALIASES", "AUTO", "FINE_SUMS", "carried_mode", "auto_mode"]

MODES = ("coarse", "fine", "hybrid", "dense")
ALIASES = {"routed": "coarse"}  # the name coarse had before fine and hybrid existed
AUTO = "auto"  # the mode that runs whatever the checkpoint carries (carried_mode)
# fine decode on the kernels: q|k|v, o and down add into fp32 sums that RoPE and the next norm
# round and read, or (rounded) each GEMV rounds its own output, as before: wide.engine.fine_engine,
# "fp32 sums"
FINE_SUMS = ("fp32", "rounded")


def carried_mode(routers: bool, thresholds: bool) -> str:
    """The mode that runs everything a checkpoint carries, so that a set of routers and
    thresholds is served as it was evaluated: both (hybrid), thresholds alone (fine), routers
    alone (coarse), or neither (dense: what `wide generate` and the harness already run for
    coarse on a model without routers)."""
    if thresholds:
        return "hybrid" if routers else "fine"
    return "coarse" if routers else "dense"


def auto_mode(model) -> str:
    """:func:`carried_mode` of a loaded model: routers are those of any routed module (a set
    wrapped with ``sparse_target="none"`` carries thresholds only), thresholds ``model.wide_fine``."""
    state = getattr(model, "wide_state", None)
    routers = state is not None and (state.config.routes_attention or state.config.routes_ffn)
    return carried_mode(routers, get_fine(model) is not None)
