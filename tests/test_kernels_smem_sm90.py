"""Every tl.dot kernel has a config that fits an H100/H200's shared memory in every dtype it
accepts, every config a prune keeps (or a heuristic picks without autotuning) fits, and every
config of the fine GEMVs' autotuner list compiles for sm_90 and fits. Compiled
for sm_90 offline, in a child process without the interpreter (tests/sm90.py). fp32 matters
most: its dots run in tf32x3 (kernels/fp32_dot), which stages each operand twice, so fp32 tiles
need more than twice the bf16 bytes (the GPU smoke once died on it: 320 KB asked, 227 KB there)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sm90

# The compiles take about 3 CPU minutes in one process: on a loaded 2-core machine 10 minutes of
# wall time or more (615 s measured at a load average of 5), which pytest's 15-minute limit
# would turn into a failure that says nothing about the kernels. The limits here catch a hang.
pytestmark = [pytest.mark.skipif(not sm90.ptxas_available(), reason="Triton's NVIDIA backend / ptxas missing"),
              pytest.mark.timeout(7200)]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sizes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(HERE / "sm90.py")], env=env, capture_output=True, text=True,
                       timeout=6000)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    if "unsupported" in out:
        pytest.skip(f"this Triton's offline compile API is not the one tests/sm90.py speaks: {out['unsupported']}")
    return out


def test_every_kernel_family_is_covered(sizes):
    fams = {k.split("-")[0] for k in sizes}
    assert fams == {"prefill_attention", "decode_attention", "gemm_k", "gemm_mn", "fine_gemv"}
    assert len(sizes) == 2 + 4 + 3 + 6 + 3  # fine_gemv: gate|up, q|k|v, down reading gate|up sums


def test_autotuned_attention_has_a_config_that_fits(sizes):
    bad = {k: v["sizes"] for k, v in sizes.items()
           if v["need"] == "any" and min(v["sizes"].values()) > sm90.SM90_SMEM}
    assert not bad, f"no config fits sm_90's {sm90.SM90_SMEM} B: {bad}"


def test_pruned_heuristic_and_fine_configs_all_compile_and_fit(sizes):
    bad = {k: {c: b for c, b in v["sizes"].items() if b > sm90.SM90_SMEM} for k, v in sizes.items()
           if v["need"] == "all" and max(v["sizes"].values()) > sm90.SM90_SMEM}
    assert not bad, f"configs over sm_90's {sm90.SM90_SMEM} B: {bad}"


def test_the_fp32_attention_config_was_needed(sizes):
    # the failure this file exists for: without the small fp32 tile, no prefill config fits
    v = sizes["prefill_attention-fp32-d128"]["sizes"]
    assert sum(b > sm90.SM90_SMEM for b in v.values()) >= 4 and min(v.values()) <= sm90.SM90_SMEM
