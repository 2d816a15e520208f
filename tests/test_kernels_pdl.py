"""Programmatic dependent launch (wide.kernels.pdl) for the decode launches: on unless
WIDE_PDL=0, never on the CPU or under the interpreter, and, compiled for sm_90 offline (tests/sm90.py,
a child process without the interpreter), each kernel that takes it waits on the previous
kernel and lets the next one in, with Triton's launch_pdl option set."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sm90
from wide.kernels import pdl

HERE = Path(__file__).resolve().parent


def test_never_off_cuda_and_off_when_asked(monkeypatch):
    cpu = torch.device("cpu")
    for value in (None, "1"):  # the default, and asked for: still no CUDA device (and the interpreter on)
        if value is None:
            monkeypatch.delenv("WIDE_PDL", raising=False)
        else:
            monkeypatch.setenv("WIDE_PDL", value)
        assert pdl.launch_kwargs(cpu) == {} and not pdl.enabled(cpu)
    if torch.cuda.is_available():
        monkeypatch.setenv("WIDE_PDL", "0")
        assert pdl.launch_kwargs(torch.device("cuda")) == {}


def test_on_by_default_where_it_runs(monkeypatch):
    """The switch itself, with the device checks passed: on unless WIDE_PDL=0."""
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setattr(pdl, "interpret_mode", lambda: False)
    monkeypatch.setitem(pdl._CAPABILITY, 0, 9)
    dev = torch.device("cuda", 0)
    monkeypatch.delenv("WIDE_PDL", raising=False)
    assert pdl.enabled(dev) and pdl.launch_kwargs(dev) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("WIDE_PDL", "0")
    assert not pdl.enabled(dev) and pdl.launch_kwargs(dev) == {}
    monkeypatch.setitem(pdl._CAPABILITY, 0, 8)  # Ampere: no griddepcontrol
    monkeypatch.delenv("WIDE_PDL")
    assert not pdl.enabled(dev)


@pytest.mark.skipif(not sm90.ptxas_available(), reason="Triton's NVIDIA backend / ptxas missing")
@pytest.mark.timeout(1800)
def test_decode_launches_compile_with_pdl_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(HERE / "sm90.py"), "--pdl"], env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    if "unsupported" in out:
        pytest.skip(f"this Triton's offline compile API is not the one tests/sm90.py speaks: {out['unsupported']}")
    kernels = ("fine_gemv", "norm_route", "rope_decode", "decode_attention_split", "decode_attention_combine")
    assert out == {k: [True, True, True] for k in kernels}, out
