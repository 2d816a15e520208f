"""WideConfig refuses bad values from its field metadata alone: the parser and the library
check the same declarations."""
import pytest

from wide.method.config import WideConfig


@pytest.mark.parametrize("kw,msg", [
    (dict(sparse_target="x"), r"sparse_target must be one of \('attention', 'ffn', 'all', 'none'\), got 'x'"),
    (dict(loss_mode="y"), "loss_mode must be one of"),
    (dict(router_input="z"), "router_input must be one of"),
    (dict(target_sparsity=1.5), r"target_sparsity must lie in \[0.0, 1.0\), got 1.5"),
    # every group skipped is not a model (issue 41, defect 4)
    (dict(target_sparsity=1.0), r"target_sparsity must lie in \[0.0, 1.0\), got 1.0"),
    (dict(attn_target=1.0, ffn_target=0.5), r"attn_target must lie in \[0.0, 1.0\), got 1.0"),
    (dict(attn_target=0.5, ffn_target=1.0), r"ffn_target must lie in \[0.0, 1.0\), got 1.0"),
    (dict(router_rank=0), "router_rank must be >= 1"),
    (dict(tau_end=0.0), "tau_end must be > 0"),
    (dict(attn_target=0.3), "set both attn_target and ffn_target"),
])
def test_bad_values_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        WideConfig(**kw)


def test_a_zero_target_is_allowed():
    assert WideConfig(target_sparsity=0.0).target_sparsity == 0.0
    assert WideConfig(attn_target=0.0, ffn_target=0.0).attn_target == 0.0


def test_defaults_and_roundtrip():
    cfg = WideConfig(sparse_target="ffn", loss_mode="groups", router_input="normed")
    assert WideConfig.from_dict(cfg.to_dict()) == cfg
