"""bench/ab_summary.py: base and new figures are matched by name across rounds."""
import json

from conftest import load_script


def _mod():
    return load_script("bench/ab_summary.py")


def _write(root, name, bench, records):
    d = root / name
    d.mkdir()
    (d / f"{bench}.json").write_text(json.dumps({"records": records}))


def test_ab_summary_matches_rounds(tmp_path):
    k = dict(op="gemm_k", shape="o", T=1, sparsity=0.5)
    e = dict(op="e2e_tpot", B=1, engine="routed", sparsity=0.5)
    rounds = [(10.0, 10.1, 12.0, 3.3, 3.4), (10.2, 12.0, 12.1, 3.4, 3.3)]
    for r, (kb, kn, qn, eb, en) in enumerate(rounds, start=1):
        q = dict(k, shape="q")
        _write(tmp_path, f"kernels-base-{r}", "kernels",
               [dict(k, dense_us=20.0, routed_us=kb), dict(q, dense_us=20.0, routed_us=kb)])
        _write(tmp_path, f"kernels-new-{r}", "kernels",
               [dict(k, dense_us=20.0, routed_us=kn), dict(q, dense_us=20.0, routed_us=qn)])
        _write(tmp_path, f"e2e-base-{r}", "e2e", [dict(e, ms=eb), dict(e, op="e2e_ttft", prompt_len=8, ms=1.0)])
        _write(tmp_path, f"e2e-new-{r}", "e2e", [dict(e, ms=en), dict(e, ms=en, model="qwen2.5-7b")])
    (tmp_path / "notes").mkdir()  # not a round folder
    ab = _mod()
    assert ab.main([str(tmp_path)]) == 0
    rows = {r["figure"]: r for r in json.loads((tmp_path / "ab.json").read_text())["rows"]}
    # Qwen's figure has no base twin and the TTFT no new one: neither is compared.
    assert set(rows) == {"gemm_k o T=1 s=0.5 dense_us", "gemm_k o T=1 s=0.5 routed_us",
                         "gemm_k q T=1 s=0.5 dense_us", "gemm_k q T=1 s=0.5 routed_us",
                         "tpot B=1 routed s=0.5 ms"}
    o = rows["gemm_k o T=1 s=0.5 routed_us"]
    assert o["rounds"] == [2, 2] and abs(o["new_over_base"] - 11.05 / 10.1) < 1e-9
    assert o["within_spread"]  # 9.4 % slower, but the new side's rounds spread 17 %
    assert not rows["gemm_k q T=1 s=0.5 routed_us"]["within_spread"]  # 19 % slower, spreads <= 2 %
    assert rows["tpot B=1 routed s=0.5 ms"]["within_spread"]
    assert "4 of 5 figures within spread" in (tmp_path / "ab.md").read_text()
