"""batch_shared_mask (one group set per decode batch) against wide.method.routers.batch_shared_runs.

Runs on the CPU through Triton's interpreter; on a CUDA machine run with TRITON_INTERPRET=0."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from wide.kernels.batch_shared import batch_shared_mask, batch_shared_mask_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"


@pytest.mark.parametrize("kind", ["random", "all", "none", "one_row", "huge"])
@pytest.mark.parametrize("B,G", [(1, 8), (3, 8), (8, 112), (32, 112), (5, 1), (17, 30)])
def test_matches_reference_and_stays_under_cap(B, G, kind):
    gen = torch.Generator().manual_seed(100 * B + G)
    m = torch.randn(B, G, generator=gen)
    if kind == "all":
        m = m.abs() + 0.1
    elif kind == "none":
        m = -m.abs() - 0.1
    elif kind == "one_row":  # one sequence wants groups, the others none
        m = -m.abs() - 0.1
        m[B // 2] = m[B // 2].abs()
    elif kind == "huge":  # beyond the clamp of the integer sums: no overflow, same set
        m = m * 1e12
    m = m.to(DEVICE)
    out = batch_shared_mask(m)
    ref = batch_shared_mask_reference(m)
    assert out.dtype == torch.bool and out.shape == (B, G)
    assert torch.equal(out.cpu(), ref.cpu())
    assert torch.equal(out, out[:1].expand(B, G))  # one set for the whole batch
    cap = -(-int((m >= 0).sum()) // B)
    assert int(out[0].sum()) == cap  # the union is the set: never above the mean width (ceil)
    if B == 1:
        assert torch.equal(out[0], m[0] >= 0)  # a batch of one keeps its own groups


def test_a_batch_of_one_keeps_its_own_groups_even_at_tiny_margins():
    # Units round down: -5e-7 (skip) stays below +5e-7 (run). Rounded toward zero both were 0,
    # and the tie went to group 0, a group the token itself skips.
    m = torch.tensor([[-5e-7, 5e-7, -1e-3, 2.0, 0.0, -0.0]], device=DEVICE)
    own = (m[0] >= 0).cpu()
    assert torch.equal(batch_shared_mask(m)[0].cpu(), own)
    assert torch.equal(batch_shared_mask_reference(m)[0].cpu(), own)


def test_row_order_does_not_matter():
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(8, 112, generator=gen).to(DEVICE)
    perm = torch.randperm(8, generator=gen).to(DEVICE)
    assert torch.equal(batch_shared_mask(m), batch_shared_mask(m[perm]))


def test_ties_go_to_the_lower_group():
    m = torch.tensor([[1.0, 1.0, 1.0, -1.0]], device=DEVICE).expand(2, 4).contiguous()
    m[:, 3] = -5.0
    m[0, 0] = -1.0  # scores 0, 2, 2, -10; 5 active of 8 -> keep 3
    out = batch_shared_mask(m)
    assert out[0].tolist() == [True, True, True, False]
    m2 = torch.tensor([[0.5, 0.5, 0.5, -1.0], [-0.5, -0.5, -0.5, -1.0]], device=DEVICE)
    assert batch_shared_mask(m2)[0].tolist() == [True, True, False, False]  # 3 of 6 -> 2, lower indices


def test_bad_input():
    with pytest.raises(ValueError, match="float32"):
        batch_shared_mask(torch.zeros(2, 3, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        batch_shared_mask(torch.zeros(6, device=DEVICE))
    assert batch_shared_mask(torch.zeros(0, 4, device=DEVICE)).shape == (0, 4)
