"""bench/routing_tradeoff.py regenerates the committed quality-vs-speed table of the routing rules
from the committed results."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_table_regenerates_from_committed_results(tmp_path):
    spec = importlib.util.spec_from_file_location("routing_tradeoff", ROOT / "bench" / "routing_tradeoff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path)]) == 0
    rows = {r["routing"]: r for r in json.loads((tmp_path / "routing_tradeoff.json").read_text())["rows"]}
    assert set(rows) == set(mod.RULES)
    assert rows["token"]["ppl_vs_token"] == 1.0
    assert all(rows[t]["ppl"] > 0 and "TTFT 4k" in rows[t] for t in ("tile16", "tile64", "tile128"))
    assert set(rows["batch_shared"]["decode_ratio"]) == {"8", "32"} and "TPOT B=32" in rows["batch_shared"]
    committed = (ROOT / "bench/results/routing/routing_tradeoff.md").read_text()
    assert (tmp_path / "routing_tradeoff.md").read_text() == committed
