"""WideConfig refuses bad values from its field metadata alone: the parser and the library
check the same declarations."""
import pytest

from wide.config import WideConfig


@pytest.mark.parametrize("kw,msg", [
    (dict(sparse_target="x"), r"sparse_target must be one of \('attention', 'ffn', 'all', 'none'\), got 'x'"),
    (dict(loss_mode="y"), "loss_mode must be one of"),
    (dict(router_input="z"), "router_input must be one of"),
    (dict(target_sparsity=1.5), r"target_sparsity must lie in \[0.0, 1.0\], got 1.5"),
    (dict(router_rank=0), "router_rank must be >= 1"),
    (dict(tau_end=0.0), "tau_end must be > 0"),
    (dict(attn_target=0.3), "set both attn_target and ffn_target"),
])
def test_bad_values_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        WideConfig(**kw)


def test_defaults_and_roundtrip():
    cfg = WideConfig(sparse_target="ffn", loss_mode="groups", router_input="normed")
    assert WideConfig.from_dict(cfg.to_dict()) == cfg
