"""Trial: batch-1 ffn_up: the CUDA-core GEMV kernel against the tl.dot decode path, same bytes (H200).

Why: at T=1 ``ffn_up`` runs the CUDA-core GEMV (``_gemv_mn_kernel``, FUSED), which can also
finish the batch-1 router; this checks that it is not slower than the tl.dot decode path it
replaced. T=2 with the same mask row twice makes ``ffn_up`` take the tl.dot path while
reading exactly the same weight bytes. Times are CUDA-graph replays with a cold L2
(``time_graph``), so they include the replay's own overhead (same for every row).

    PYTHONPATH=src python experiments/decode_ffn_up_ab.py
"""
import torch
import torch.nn.functional as F

from wide.kernels import ffn_up, gemm_mn
from wide.kernels.gemm_mn import ffn_up_reference
from wide.base.timing import time_graph


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    K, N, G = 4096, 14336, 128  # Llama-3.1-8B gate/up, 50 % of the 112 groups active
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    wg = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
    wu = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
    m = torch.zeros(1, N // G, dtype=torch.bool, device=dev)
    m[0, torch.randperm(N // G)[: N // G // 2]] = True
    ref = ffn_up_reference(x, wg, wu, m, G)
    x2, m2 = x.repeat(2, 1), m.repeat(2, 1)
    for name, y in (("gemv", ffn_up(x, wg, wu, m, G)), ("tl.dot", ffn_up(x2, wg, wu, m2, G)[:1])):
        err = float((y.float() - ref).norm() / ref.norm())
        print(f"{name} rel err {err:.2e}")
        assert err < 1e-2
    wgu = torch.cat([wg, wu])
    for name, fn in [("cublas gate+up (dense)", lambda: F.linear(x, wgu)),
                     ("ffn_up gemv T=1", lambda: ffn_up(x, wg, wu, m, G)),
                     ("ffn_up tl.dot T=2, same mask", lambda: ffn_up(x2, wg, wu, m2, G)),
                     ("gemm_mn gate alone T=1", lambda: gemm_mn(x, wg, m, G))]:
        print(f"{name}: {1000 * time_graph(fn):.1f} us")


if __name__ == "__main__":
    main()
