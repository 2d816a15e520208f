"""bench/routing_tradeoff.py regenerates the committed quality-vs-speed table of the routing rules
from the committed results."""
import json
import pathlib

from conftest import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_table_regenerates_from_committed_results(tmp_path):
    mod = load_script("bench/routing_tradeoff.py")
    assert mod.main(["--out", str(tmp_path)]) == 0
    rows = {r["routing"]: r for r in json.loads((tmp_path / "routing_tradeoff.json").read_text())["rows"]}
    # every rule with a measurement has a row (tile16prev: none committed yet), and only those
    assert {"token", "tile16", "tile64", "tile128", "batch_shared"} <= set(rows) <= set(mod.RULES)
    assert all(len(r) > 1 for r in rows.values())
    assert rows["token"]["ppl_vs_token"] == 1.0
    # quality at the best per-token recipe where the rule was trained there; the first recipe's beside
    assert rows["tile16"]["ppl"] > rows["token"]["ppl"] > 0
    assert all("ppl" not in rows[t] and rows[t]["old_recipe_ppl_vs_token"] > 1 for t in ("tile64", "tile128"))
    assert all("TTFT 4k" in rows[t] and rows[t]["old_recipe_ppl_vs_token"] > 1 for t in ("tile16", "tile64", "tile128"))
    assert rows["token"]["old_recipe_ppl_vs_token"] == 1.0
    assert set(rows["batch_shared"]["decode_ratio"]) == {"8", "32"} and "TPOT B=32" in rows["batch_shared"]
    committed = (ROOT / "bench/results/routing/routing_tradeoff.md").read_text()
    assert (tmp_path / "routing_tradeoff.md").read_text() == committed


def test_old_recipe_alone(tmp_path):
    """--recipe '' is the first table: every tile rule at the scaling grid's recipe, no extra column."""
    mod = load_script("bench/routing_tradeoff.py")
    assert mod.main(["--out", str(tmp_path), "--recipe", ""]) == 0
    rows = {r["routing"]: r for r in json.loads((tmp_path / "routing_tradeoff.json").read_text())["rows"]}
    assert abs(rows["token"]["ppl"] - 110.7) < 0.01
    assert all(rows[t]["ppl"] > rows["token"]["ppl"] for t in ("tile16", "tile64", "tile128"))
    assert "old recipe" not in (tmp_path / "routing_tradeoff.md").read_text()
