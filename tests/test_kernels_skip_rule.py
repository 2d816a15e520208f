"""skip_rule (the skip_smallest / skip_upto attention masks in one launch) against the rules' own
PyTorch form, wide.method.group_rules.

Runs on the CPU through Triton's interpreter; on a CUDA machine run with TRITON_INTERPRET=0."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from wide.kernels.skip_rule import skip_rule, skip_rule_reference  # noqa: E402
from wide.method.group_rules import SkipSmallest, SkipUpTo  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"


def margins(shape, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(*shape, generator=gen)
    if kind == "ties":  # few distinct values: ties everywhere, broken by group index
        m = torch.randint(-2, 3, shape, generator=gen).float()
    elif kind == "all_run":  # every margin >= 0: skip_upto skips nothing
        m = m.abs()
    elif kind == "none_run":  # every margin < 0: skip_upto skips k, as skip_smallest
        m = -m.abs() - 1e-3
    elif kind == "nan":
        m[..., 0] = float("nan")
    return m.to(DEVICE)


@pytest.mark.parametrize("upto", [False, True])
@pytest.mark.parametrize("kind", ["random", "ties", "all_run", "none_run", "nan"])
@pytest.mark.parametrize("rows,G,k", [(1, 3, 1), (1, 8, 3), (5, 8, 6), (37, 3, 2), (130, 5, 1), (2, 64, 17)])
def test_matches_the_rules(rows, G, k, kind, upto):
    m = margins((rows, G), kind, seed=rows * 100 + G + k)
    out = skip_rule(m, k, upto=upto)
    ref = skip_rule_reference(m, k, upto=upto)
    rule = (SkipUpTo if upto else SkipSmallest)(k)
    assert out.dtype == torch.bool and out.shape == (rows, G)
    assert torch.equal(out.cpu(), ref.cpu()) and torch.equal(ref.cpu(), rule.runs(m).cpu())
    if kind != "nan":
        skipped = (~out).sum(-1)
        if upto:
            assert bool((skipped <= k).all())
        else:
            assert bool((skipped == k).all())  # exactly k per row


def test_prefill_shapes_and_strided_rows():
    # [B, T, G] margins (prefill) and a row-strided view (a slice of wider router output)
    m = margins((2, 33, 8), "random", seed=3)
    assert torch.equal(skip_rule(m, 2, upto=True).cpu(), skip_rule_reference(m, 2, upto=True).cpu())
    wide = margins((9, 16), "ties", seed=4)
    view = wide[:, 4:12]
    assert torch.equal(skip_rule(view, 1).cpu(), skip_rule_reference(view, 1).cpu())
    empty = m[:0]
    assert skip_rule(empty, 1).shape == empty.shape


def test_half_margins_and_bad_k():
    m = margins((6, 8), "ties", seed=5).half()
    assert torch.equal(skip_rule(m, 3).cpu(), skip_rule_reference(m.float(), 3).cpu())
    for k in (0, 8):
        with pytest.raises(ValueError, match="skips at least 1"):
            skip_rule(m, k)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled for a CUDA GPU (scripts/gpu_smoke.py runs it there)")
def test_cases_on_gpu():
    for upto in (False, True):
        for kind in ("random", "ties", "nan"):
            for rows, G, k in ((1, 8, 3), (8, 8, 6), (4096, 8, 3), (3, 112, 40)):
                test_matches_the_rules(rows, G, k, kind, upto)
    test_prefill_shapes_and_strided_rows()
    m = margins((64, 8), "ties", seed=9).bfloat16()
    assert torch.equal(skip_rule(m, 3, upto=True), skip_rule_reference(m.float(), 3, upto=True))
