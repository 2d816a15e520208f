"""Router analysis outputs, and the comparison's table / JSON / plot writers."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

import wide
from wide.evaluation import analysis
from wide.commands import compare
from wide.evaluation.evaluate import TASKS
from wide.method.state import get_state


def test_analysis_counts_by_hand(tmp_path):
    model = tiny_model("llama")
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32, attn_group_size=2))  # 2 attn, 3 ffn groups
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    fixed = {(l, k): (torch.rand(2, 8, get_state(model).geometry.groups(k), generator=g) > 0.5).float()
             for l in range(2) for k in ("attn", "ffn")}
    fixed[(1, "attn")][:] = torch.tensor([1.0, 0.0])  # one mask for every token
    get_state(model).mask_fn = lambda layer, kind, x: fixed[(layer, kind)]
    res = analysis.analyze(model, [ids], tmp_path / "an")
    assert res["tokens"] == 16
    for (l, k), m in fixed.items():
        info = res["layers"][k][l]
        flat = m.reshape(-1, m.shape[-1])
        assert info["sparsity"] == pytest.approx(1 - float(flat.mean()))
        assert info["fire_rate"] == pytest.approx(flat.mean(0).tolist())
        assert info["distinct_masks"] == len({tuple(r) for r in flat.int().tolist()})
        assert sum(info["groups_run_hist"]) == 16
    assert res["layers"]["attn"][1]["distinct_masks"] == 1
    assert res["layers"]["attn"][1]["top_masks"][0] == {"mask": "10", "share": 1.0}
    whole = torch.cat([fixed[k].reshape(16, -1) for k in sorted(fixed)], 1)
    assert res["distinct_model_masks"] == len({tuple(r) for r in whole.int().tolist()})
    saved = json.loads((tmp_path / "an.json").read_text())
    assert saved["layers"]["ffn"][0]["fire_rate"] == res["layers"]["ffn"][0]["fire_rate"]
    assert (tmp_path / "an.png").stat().st_size > 1000
    assert res["layers"]["ffn"][0]["tile_skip"]["64"]["tokens"] != res["layers"]["ffn"][0]["tile_skip"]["64"]["tokens"]
    assert res["tile_skip"]["ffn"]["64"]["iid"] == pytest.approx(
        sum(analysis.tile_skip_iid(fixed[(l, "ffn")].reshape(16, -1).bool(), 64) for l in range(2)) / 2)
    assert res["tile_skip"]["ffn"]["64"]["tokens"] is None  # 16 tokens: no whole tile of 64


def test_tile_skip_by_hand():
    # 8 tokens, 3 groups, tiles of 4: group 0 runs only in the first tile, group 1 in every
    # token, group 2 in tokens 1 and 6 (one per tile). Empty blocks: (tile 2, group 0) -> 1/6.
    m = torch.zeros(8, 3, dtype=torch.bool)
    m[:4, 0] = True
    m[:, 1] = True
    m[[1, 6], 2] = True
    assert analysis.tile_skip(m, 4) == pytest.approx(1 / 6)
    # Sorted by pattern: 010 x3, 011, 110 x3, 111 -> tile 1 never runs group 0, tile 2 runs
    # every group: 1/6 again, but another block.
    assert analysis.tile_skip(m, 4, "sorted") == pytest.approx(1 / 6)
    assert analysis.tile_skip(m, 16) != analysis.tile_skip(m, 16)  # no whole tile: NaN
    # i.i.d. baseline: mean over groups of (1 - p)^4 with p = (1/2, 1, 1/4)
    assert analysis.tile_skip_iid(m, 4) == pytest.approx(((0.5 ** 4) + 0 + 0.75 ** 4) / 3)
    # A mask that alternates in long runs is far more skippable than its i.i.d. baseline.
    runs = torch.zeros(256, 4, dtype=torch.bool)
    runs[:128, :2] = True
    runs[128:, 2:] = True
    assert analysis.tile_skip(runs, 64) == pytest.approx(0.5)
    assert analysis.tile_skip_iid(runs, 64) < 1e-12
    with pytest.raises(ValueError, match="order"):
        analysis.tile_skip(m, 4, "random")


def test_analysis_excludes_padding():
    model = tiny_model("llama")
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32))
    masks = analysis.collect_masks(model, [torch.randint(0, 96, (2, 5))])
    assert all(m.shape[0] == 10 for m in masks.values())
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    seen = []
    get_state(model).mask_observers.append(lambda l, k, m, v: seen.append(float(v.sum())))
    model(input_ids=torch.randint(0, 96, (2, 5)), attention_mask=am)
    assert set(seen) == {8.0}


def fake_records():
    recs = [{"op": "quality", "model": "tiny", "name": "dense", "label": "Dense", "method": "dense", "stage": 0,
             "target": None, "sparsity": 0.0, "group_sparsity": 0.0, "ppl": 10.0, "bpb": 1.0}]
    for name, fam, stage, acc, ppl in [("wide", "wide", 1, 0.5, 20.0), ("dynamic_depth", "dynamic_depth", 1, 0.4, 40.0),
                                       ("wide_lora", "wide", 2, 0.55, 15.0)]:
        recs.append({"op": "quality", "model": "tiny", "name": name, "label": compare.METHOD_ROWS[name][2],
                     "method": fam, "stage": stage, "target": 0.5, "sparsity": 0.5, "group_sparsity": 0.45,
                     "ppl": ppl, "bpb": 1.5, **{t: acc for t in TASKS}, "avg": acc})
    recs[0].update({t: 0.6 for t in TASKS}, avg=0.6)
    return recs


def compare_args(**kw):
    """What write_outputs reads of a `wide compare` namespace."""
    return SimpleNamespace(**{**dict(
        steps=2, recovery_steps=2, batch_size=4, grad_accum=1, seq_len=16, seed=0, lr=2e-3, recovery_lr=2e-4, limit=5,
        max_eval_sequences=2, targets=[0.5], dtype="float32", tasks=list(TASKS), device="cpu", loss="kd",
        kd_temperature=1.0, mix_weight=0.5, amp="bf16", data="wiki", eval_data=None, decontaminate="all",
        sparsity_warmup=0.0, router_init="random", router_rank=16, router_input="residual", tau_start=5.0,
        tau_end=0.5, sparsity_coef=20.0, ffn_group_size=32, budget="global", lora_r=16, offsets="global"), **kw})


def test_comparison_outputs(tmp_path):
    recs = fake_records()
    args = compare_args()
    compare.write_outputs(recs, tmp_path / "q", args, command="wide compare --steps 2")
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["command"] == "wide compare --steps 2" and len(doc["records"]) == 4
    assert doc["settings"]["loss"] == "kd" and doc["settings"]["amp"] == "bf16" and doc["settings"]["eval_data"] == "wiki"
    assert doc["settings"]["ffn_group_size"] == 32 and doc["settings"]["offsets"] == "global"  # what seeds must share
    wide_rec = next(r for r in doc["records"] if r["name"] == "wide")
    for key in ("op", "model", "method", "stage", "sparsity", "group_sparsity", "ppl", "bpb", *TASKS, "avg"):
        assert key in wide_rec
    assert wide_rec["rel_avg_vs_depth"] == pytest.approx(25.0)
    assert wide_rec["rel_ppl_vs_depth"] == pytest.approx(-50.0)
    md = (tmp_path / "q.md").read_text()
    assert "| WIDE (calibration) | 1 | 50% |" in md and "+25.0%" in md
    assert (tmp_path / "q.png").stat().st_size > 1000
    # stems with a dot are taken literally (run.v1 and run.v2 both wrote run.json before)
    for stem in ("run.v1", "run.v2"):
        compare.write_outputs(recs, tmp_path / "dots" / stem, args, command="wide compare")
    assert sorted(p.name for p in (tmp_path / "dots").iterdir()) == [
        "run.v1.json", "run.v1.md", "run.v1.png", "run.v2.json", "run.v2.md", "run.v2.png"]


def test_comparison_outputs_on_the_linear_axis_show_and_plot_linear_sparsity(tmp_path, monkeypatch):
    # issue 49, defect 1: with --axis linear the table showed "FLOP sparsity 0.000" for TEAL and
    # learned thresholds (they skip no routable group) and no linear column, and the plot put
    # them all at x = 0 on a FLOP axis; the run's own axis was only in the JSON
    import matplotlib.axes

    recs = [{"op": "quality", "model": "tiny", "name": "dense", "label": "Dense", "method": "dense", "stage": 0,
             "target": None, "sparsity": 0.0, "group_sparsity": 0.0, "linear_sparsity": 0.0, "ppl": 10.0}]
    for name, linear, ppl in (("teal", 0.497, 14.0), ("learned", 0.503, 12.0), ("wide", 0.5, 30.0)):
        recs.append({"op": "quality", "model": "tiny", "name": name, "label": compare.METHOD_ROWS[name][2],
                     "method": name, "stage": 1, "target": 0.5, "sparsity": 0.61 if name == "wide" else 0.0,
                     "group_sparsity": 0.0, "linear_sparsity": linear, "ppl": ppl})
    xs, labels = [], []
    plot, xlabel = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, x, *a, **k: xs.append(list(x)) or plot(ax, x, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel",
                        lambda ax, text, *a, **k: labels.append(text) or xlabel(ax, text, *a, **k))
    compare.write_outputs(recs, tmp_path / "lin", compare_args(axis="linear", tasks=[]), command="wide compare")
    md = (tmp_path / "lin.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]
    table = {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert "linear sparsity" in rows[0] and "FLOP sparsity" not in rows[0], rows[0]
    assert table["TEAL (uniform)"]["linear sparsity"] == "0.497"
    assert table["Learned thresholds (no routers)"]["linear sparsity"] == "0.503"
    assert table["WIDE (calibration)"]["linear sparsity"] == "0.500"
    assert "linear-layer MACs" in md
    assert sorted(xs) == [[0.497], [0.5], [0.503]]  # ppl only: no task was scored
    assert labels and all("linear" in text for text in labels), labels
    # the FLOP axis (the default) stays as it was
    xs.clear(), labels.clear()
    compare.write_outputs(recs, tmp_path / "flop", compare_args(tasks=[]), command="wide compare")
    assert "| FLOP sparsity |" in (tmp_path / "flop.md").read_text()
    assert sorted(xs) == [[0.0], [0.0], [0.61]] and all("FLOP" in text for text in labels)
