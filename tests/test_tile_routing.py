"""Structured routing (docs/routing_structure.md): tile-coherent causal masks (route_tile) and
batch-shared decode, in the masked HF path."""
import dataclasses
import math
from copy import deepcopy

import pytest
import torch
from conftest import tiny_model

import wide
from wide.cli import main
from wide.method.config import WideConfig
from wide.method.modeling import batch_shared_decode, plan_tiles, recording_masks
from wide.method.state import get_state
from wide.method.routers import batch_shared_runs, group_runs


def routed(tile: int = 1, seed: int = 0, **kw):
    # 4 attention groups of one head, 6 FFN groups of 16 channels: random routers skip about half.
    kw = {"ffn_group_size": 16, "attn_group_size": 1, **kw}
    return wide.wrap(tiny_model("llama"), WideConfig(route_tile=tile, **{"router_init": "random", **kw}), seed=seed)


def ids_of(b, t, seed=0):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


def masks_of(model, **inputs) -> dict:
    """(layer, kind) -> bool masks [B, T, G] of one forward, or of a decode loop's steps."""
    with recording_masks(model) as seen, torch.no_grad():
        model(**inputs)
    return {k: torch.cat(v, dim=1) for k, v in seen.items()}


def left_padded(seed=0):
    ids = ids_of(2, 11, seed)
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, :3] = 0  # the second text is 8 tokens long
    return ids, am


def decode_loop(model, ids, am, prefill: int, position_ids=None) -> dict:
    """Prefill ``prefill`` tokens, then one token per step on the KV cache, as generate does."""
    with recording_masks(model) as seen, torch.no_grad():
        kw = {} if position_ids is None else {"position_ids": position_ids[:, :prefill]}
        out = model(input_ids=ids[:, :prefill], attention_mask=am[:, :prefill], use_cache=True, **kw)
        for t in range(prefill, ids.shape[1]):
            kw = {} if position_ids is None else {"position_ids": position_ids[:, t:t + 1]}
            out = model(input_ids=ids[:, t:t + 1], attention_mask=am[:, :t + 1], cache=out.cache, use_cache=True,
                        **kw)
    return {k: torch.cat(v, dim=1) for k, v in seen.items()}


def generate_positions(am):
    return (am.cumsum(-1) - 1).masked_fill(am == 0, 0)  # what HF generate passes


# ---------------------------------------------------------------- the tile rule


@pytest.mark.parametrize("tile,source", [(1, "first"), (4, "first"), (8, "first"), (4, "previous"), (8, "previous")])
def test_masks_are_causal(tile, source):
    model = routed(tile, tile_source=source)
    ids = ids_of(2, 20)
    before = masks_of(model, input_ids=ids)
    for t in (0, 5, 9, 15, 16):
        changed = ids.clone()
        changed[:, t + 1:] = ids_of(2, 20, seed=t + 1)[:, t + 1:]
        after = masks_of(model, input_ids=changed)
        for key, m in before.items():
            assert torch.equal(after[key][:, :t + 1], m[:, :t + 1]), (t, key)
        # Later masks do move, where a tile begins whose decision reads a changed token: its own
        # first token ("first"), or the tile before it ("previous": a tile starting at t + 1
        # reads only tokens up to t, and keeps its mask).
        moved = any(not torch.equal(after[k], m) for k, m in before.items())
        first = t + 1 if source == "first" else t + 2
        assert moved == any(p % tile == 0 for p in range(first, 20)), t


@pytest.mark.parametrize("tile", [4, 8])
def test_tokens_of_a_tile_share_the_first_tokens_mask(tile):
    model = routed(tile)
    ids = ids_of(3, 19)
    masks = masks_of(model, input_ids=ids)
    for key, m in masks.items():
        firsts = m[:, torch.arange(19) // tile * tile]
        assert torch.equal(m, firsts), key
    # Layer 0's attention router reads the embeddings, so its decisions at the tile-first
    # positions are the per-token router's there.
    per_token = masks_of(routed(1), input_ids=ids)[(0, "attn")]
    assert torch.equal(masks[(0, "attn")], per_token[:, torch.arange(19) // tile * tile])


def test_previous_tile_source_routes_each_tile_on_the_mean_of_the_tile_before():
    tile = 4
    model = routed(tile, tile_source="previous")
    ids = ids_of(3, 18)
    masks = masks_of(model, input_ids=ids)
    for key, m in masks.items():
        assert torch.equal(m, m[:, torch.arange(18) // tile * tile]), key
    # Layer 0's attention router reads the embeddings: tile 0 decides on its first token's,
    # tile k on the mean of tile k-1's (the ragged last tile: the full one before it).
    emb = model.get_input_embeddings()(ids).float()
    router = model.wide_routers[0].router("attn")
    sources = [emb[:, 0]] + [emb[:, k - tile:k].mean(1) for k in range(tile, 18, tile)]
    want = torch.stack([router.runs(s) for s in sources], dim=1)
    assert torch.equal(masks[(0, "attn")][:, ::tile], want)
    assert not torch.equal(masks[(0, "attn")], masks_of(routed(tile), input_ids=ids)[(0, "attn")])


def test_tile_one_is_the_per_token_rule():
    model = routed(1)
    state = get_state(model)
    inputs = {}
    state.input_observers.append(lambda layer, kind, x: inputs.__setitem__((layer, kind), x))
    masks = masks_of(model, input_ids=ids_of(2, 9))
    for (layer, kind), x in inputs.items():
        assert torch.equal(masks[(layer, kind)], model.wide_routers[layer].router(kind).runs(x))


def train_steps(model, steps=3, tile_rule=True, am=None):
    """Losses and final router parameters of a few stage-1 steps. ``tile_rule=False`` replaces
    the routers' decision by the per-token expression wide used before route_tile existed."""
    state = get_state(model)
    if not tile_rule:
        state.mask_fn = lambda layer, kind, x: model.wide_routers[layer].router(kind).decide(x, state.tau)
    wide.freeze_backbone(model)
    model.train()
    opt = torch.optim.AdamW(wide.router_parameters(model), lr=1e-2)
    ids = ids_of(2, 12)
    torch.manual_seed(3)
    losses = []
    for step in range(steps):
        state.tau = 2.0 - 0.5 * step
        out = model(input_ids=ids, labels=ids, attention_mask=am)
        penalty, _ = wide.sparsity_loss(model)
        (out.loss + penalty).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float((out.loss + penalty).detach()))
    return losses, [p.detach().clone() for p in wide.router_parameters(model)]


def test_tile_one_trains_exactly_as_per_token_routing():
    losses, params = train_steps(routed(1))
    ref_losses, ref_params = train_steps(routed(1), tile_rule=False)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_tiled_training_reaches_the_routers_and_counts_every_token():
    model = routed(4)
    before = [p.detach().clone() for p in wide.router_parameters(model)]
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, -3:] = 0  # right padding: excluded from the rates
    state = get_state(model)
    seen = {}
    state.mask_observers.append(lambda layer, kind, mask, valid: seen.__setitem__((layer, kind), mask))
    train_steps(model, steps=1, am=am)
    after = wide.router_parameters(model)
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    sp = wide.forward_sparsity(model)
    valid = am.float().unsqueeze(-1)
    for (layer, kind), mask in seen.items():
        tiled = mask[:, torch.arange(12) // 4 * 4]  # one sampled decision per tile
        assert torch.equal(mask[0], tiled[0]) and torch.equal(mask[1, :9], tiled[1, :9])  # padding: its own
        expected = float(((1 - mask) * valid).sum() / (valid.sum() * mask.shape[-1]))
        assert float(sp.per_layer[kind][layer].detach()) == pytest.approx(expected, abs=1e-6)
    # A tile's decision counts once per token it covers: the 3-token last tile of row 1 weighs less.
    m = seen[(0, "ffn")]
    tiles = [(r, k) for r in range(2) for k in range(3)]
    weights = [4, 4, 4, 4, 4, 1]
    by_tile = sum(w * float((1 - m[r, 4 * k]).sum()) for (r, k), w in zip(tiles, weights))
    assert float(sp.per_layer["ffn"][0].detach()) == pytest.approx(by_tile / (21 * m.shape[-1]), abs=1e-6)


def test_plan_tiles_handles_padding_and_restarts():
    pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4]])
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    tiles = plan_tiles(pos, valid, 4, continuing=False)
    # Row 0: left padding leads itself, tiles start at positions 0 and 4. Row 1: a packed
    # document restarts at position 0 (index 3) and starts its own tile.
    assert tiles.lead.tolist() == [[0, 1, 2, 2, 2, 2, 6, 6], [0, 0, 0, 3, 3, 3, 3, 7]]
    assert tiles.weight.tolist() == [[0, 0, 4, 0, 0, 0, 2, 0], [3, 0, 0, 4, 0, 0, 0, 1]]
    assert tiles.last.tolist() == [7, 7] and not tiles.resumed.any()
    # A decode step at position 6 continues the tile that began at 4.
    step = plan_tiles(torch.tensor([[6]]), torch.tensor([[True]]), 4, continuing=True)
    assert step.resumed.tolist() == [[True]] and step.weight.tolist() == [[0.0]]


@pytest.mark.parametrize("tile,source", [(1, "first"), (4, "first"), (4, "previous"), (3, "previous")])
@pytest.mark.parametrize("positions", [False, True])
def test_decode_masks_equal_prefill_masks(tile, source, positions):
    model = routed(tile, tile_source=source)
    ids, am = left_padded()
    pid = generate_positions(am) if positions else None
    full = masks_of(model, input_ids=ids, attention_mask=am, **({"position_ids": pid} if positions else {}))
    for prefill in (4, 6):  # the prefill ends mid-tile and on a tile's first token
        steps = decode_loop(model, ids, am, prefill, position_ids=pid)
        for key, m in full.items():
            assert torch.equal(steps[key][0], m[0]), (prefill, key)
            assert torch.equal(steps[key][1, 3:], m[1, 3:]), (prefill, key)  # valid tokens


@pytest.mark.parametrize("positions", [False, True])
def test_left_padding_takes_no_position(positions):
    model = routed(4)
    ids, am = left_padded(seed=6)
    pid = {"position_ids": generate_positions(am)} if positions else {}
    masks = masks_of(model, input_ids=ids, attention_mask=am, **pid)
    firsts = 3 + torch.arange(8) // 4 * 4  # row 1's text starts at index 3, its tiles at 3 and 7
    assert all(torch.equal(m[1, 3:], m[1, firsts]) for m in masks.values())
    if positions:  # the same RoPE positions as the text alone: the same masks
        alone = masks_of(model, input_ids=ids[1:, 3:])
        assert all(torch.equal(masks[k][1:, 3:], m) for k, m in alone.items())


def test_dynamic_depth_decisions_follow_tiles_too():
    # tie_modules: one decision per layer at the attention norm, the FFN follows it.
    model = routed(4, seed=1, tie_modules=True, attn_group_size=None)
    ids, am = left_padded()
    full = masks_of(model, input_ids=ids, attention_mask=am)
    steps = decode_loop(model, ids, am, 6)
    for key, m in full.items():
        assert torch.equal(steps[key][0], m[0]) and torch.equal(steps[key][1, 3:], m[1, 3:]), key
        assert torch.equal(m[0], m[0, torch.arange(11) // 4 * 4]), key
    assert 0 < float(full[(0, "attn")].float().mean()) < 1


@pytest.mark.parametrize("source", ["first", "previous"])
def test_generate_uses_the_prefill_rule(source):
    model = routed(4, tile_source=source)
    ids, am = left_padded(seed=2)
    with recording_masks(model) as seen, torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    steps = {k: torch.cat(v, dim=1) for k, v in seen.items()}
    am_out = torch.cat([am, torch.ones(2, 6, dtype=torch.long)], dim=1)
    full = masks_of(model, input_ids=out[:, :-1], attention_mask=am_out[:, :-1],
                    position_ids=generate_positions(am_out[:, :-1]))
    for key, m in full.items():
        assert torch.equal(steps[key][0], m[0]) and torch.equal(steps[key][1, 3:], m[1, 3:]), key


def test_a_new_prefill_forgets_the_previous_sequences():
    model = routed(4)
    ids, am = left_padded(seed=3)
    decode_loop(model, ids, am, 6)
    other = ids_of(2, 7, seed=9)
    fresh = masks_of(routed(4), input_ids=other)
    assert all(torch.equal(masks_of(model, input_ids=other)[k], m) for k, m in fresh.items())


@pytest.mark.parametrize("source", ["first", "previous"])
def test_offsets_threshold_the_tile_first_tokens(source):
    model = routed(4, target_sparsity=0.4, tile_source=source)
    batches = [ids_of(4, 32, seed=i) for i in range(2)]
    wide.calibrate_offsets(model, batches, mode="per_module")
    with wide.track_sparsity(model) as tracker, torch.no_grad():
        for b in batches:
            model(b)
    sp = tracker.summary()
    for kind in ("attn", "ffn"):
        assert all(r == pytest.approx(0.4, abs=0.05) for r in sp.per_layer[kind]), kind


# ---------------------------------------------------------------- batch-shared decode


def test_batch_shared_runs_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        margin = torch.randn(5, 7, generator=g)
        valid = torch.tensor([True, True, False, True, True])
        shared = batch_shared_runs(margin, valid)
        counts = group_runs(margin[valid]).sum(-1).float()
        assert int(shared.sum()) == math.ceil(float(counts.mean()))
        perm = torch.randperm(5, generator=g)
        assert torch.equal(batch_shared_runs(margin[perm], valid[perm]), shared)
        for row in margin:  # a batch of one keeps exactly its own groups
            assert torch.equal(batch_shared_runs(row[None], torch.tensor([True])), group_runs(row))
    # Group 0's margins sum to 0 or 1 in float32 depending on the order of the rows; summed as
    # integers (exact), the sum and so the choice of one group out of two is the same for every
    # order.
    margin = torch.tensor([[1e8, -0.1], [1.0, -0.1], [-1e8, 0.7]])
    choices = {tuple(batch_shared_runs(margin[list(p)], torch.ones(3, dtype=torch.bool)).tolist())
               for p in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))}
    assert len(choices) == 1 and sum(next(iter(choices))) == 1


def shared_decode(model, ids, am, prefill=5):
    """Masks of each decode step under batch_shared_decode, and each step's per-token counts."""
    counts = {}
    state = get_state(model)

    def observe(layer, kind, x):
        if x.shape[1] == 1:  # a decode step: what each token would run on its own
            counts.setdefault((layer, kind), []).append(model.wide_routers[layer].router(kind).runs(x[:, 0]).sum(-1))

    state.input_observers.append(observe)
    with batch_shared_decode(model):
        masks = decode_loop(model, ids, am, prefill)
    state.input_observers.remove(observe)
    return {k: m[:, prefill:] for k, m in masks.items()}, counts


def test_batch_shared_decode_caps_the_union():
    model = routed(1)
    ids = ids_of(4, 10)
    am = torch.ones(4, 10, dtype=torch.long)
    masks, counts = shared_decode(model, ids, am)
    prefill = masks_of(model, input_ids=ids[:, :5])
    assert all(m.shape[1] == 5 for m in prefill.values())
    for key, m in masks.items():
        assert (m == m[:1]).all(), key  # one set for the batch
        union = m.any(0).sum(-1)  # [steps]
        cap = torch.stack([torch.ceil(c.float().mean()) for c in counts[key]])
        assert torch.equal(union.float(), cap), key
    # Prefill is untouched by the switch.
    with batch_shared_decode(model):
        again = masks_of(model, input_ids=ids[:, :5])
    assert all(torch.equal(again[k], m) for k, m in prefill.items())


@pytest.mark.parametrize("tile", [1, 4])
def test_batch_shared_decode_of_one_sequence_is_per_token_routing(tile):
    model = routed(tile)
    ids = ids_of(1, 10, seed=4)
    am = torch.ones(1, 10, dtype=torch.long)
    shared, _ = shared_decode(model, ids, am)
    alone = decode_loop(model, ids, am, 5)
    assert all(torch.equal(shared[k], m[:, 5:]) for k, m in alone.items())


def test_batch_shared_decode_ignores_the_order_of_the_batch():
    model = routed(1)
    ids, am = ids_of(4, 10, seed=5), torch.ones(4, 10, dtype=torch.long)
    perm = torch.tensor([2, 0, 3, 1])
    masks, _ = shared_decode(model, ids, am)
    permuted, _ = shared_decode(model, ids[perm], am[perm])
    assert all(torch.equal(permuted[k][0], m[0]) for k, m in masks.items())


# ---------------------------------------------------------------- config and CLI


def test_route_tile_round_trips_and_defaults_to_one(tmp_path):
    cfg = WideConfig(route_tile=8)
    assert WideConfig.from_dict(cfg.to_dict()) == cfg
    old = WideConfig().to_dict()
    del old["route_tile"]  # a config written before the field existed
    assert WideConfig.from_dict(old).route_tile == 1
    with pytest.raises(ValueError, match="route_tile must be >= 1"):
        WideConfig(route_tile=0)
    model = routed(4, tile_source="previous")
    wide.save_routers(model, tmp_path / "r")
    loaded = wide.from_pretrained(tmp_path / "r", tiny_model("llama")).wide_state.config
    assert (loaded.route_tile, loaded.tile_source) == (4, "previous")
    assert WideConfig.from_dict(old).tile_source == "first"
    with pytest.raises(ValueError, match="tile_source"):
        WideConfig(tile_source="last")


def test_calibrate_help_names_route_tile(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    assert "--route-tile" in out and "--tile-source" in out


def test_files_from_before_route_tile_and_router_init_still_resume_and_load(tmp_path):
    from wide.io.serialization import config_differences

    old = WideConfig().to_dict()
    del old["route_tile"], old["router_init"]  # what every checkpoint before these fields holds
    assert config_differences(old, WideConfig()) == {}  # router_init only set the start
    assert config_differences(old, WideConfig(route_tile=4)) == {"route_tile": (1, 4)}
    assert config_differences(WideConfig(router_init="random").to_dict(), WideConfig(router_init="dense")) == {}
    # Loading such routers into a model already wrapped with the same (default) config.
    model = routed()
    wide.save_routers(model, tmp_path / "r")
    cfg = tmp_path / "r" / "wide_config.json"
    import json

    meta = json.loads(cfg.read_text())
    del meta["wide_config"]["route_tile"], meta["wide_config"]["router_init"]
    cfg.write_text(json.dumps(meta))
    # a file that old has no manifest either (edited after sealing, this one would fail its own)
    (tmp_path / "r" / "wide_manifest.json").unlink()
    wide.load(routed(), tmp_path / "r", require_manifest=False)


def test_fields_a_file_predates_take_what_wide_did_then():
    # Not today's default: defaults change (the dense router start became one), and an older
    # file must still load and resume as it was trained.
    from wide.method import config as config_module
    from wide.training import train as train_module

    names = {f.name: f for f in dataclasses.fields(WideConfig)}
    for key, then in config_module.PREDATES.items():
        old = WideConfig().to_dict()
        del old[key]
        assert getattr(WideConfig.from_dict(old), key) == then, key
    targs = {f.name for f in dataclasses.fields(train_module.TrainArgs)}
    assert set(config_module.PREDATES) <= set(names) and set(train_module.PREDATES) <= targs
    assert train_module.with_defaults({"steps": 5})["sparsity_warmup"] == train_module.PREDATES["sparsity_warmup"]
    # the file's own values win; what it lacks comes from PREDATES, not from today's defaults
    assert config_module.with_predating({"router_init": "dense"})["router_init"] == "dense"
    assert config_module.with_predating({}) == config_module.PREDATES


@pytest.mark.parametrize("tile,source", [(1, "first"), (4, "first"), (4, "previous")])
def test_beam_search_reorders_the_tile_store(tile, source):
    # Beam search reorders the KV cache between steps; the tile rule's stored masks (each
    # sequence's current tile, and under "previous" its inputs so far) must follow the same beams,
    # or a beam runs another beam's groups. Each returned beam's score (length_penalty 0: its
    # summed log-probs) must then equal those of one full forward over its text, whose masks the
    # tile rule defines.
    model = routed(tile, tile_source=source)
    ids = ids_of(1, 6, seed=4)
    n = 9  # crosses two tile starts after the prompt
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, num_beams=3, num_return_sequences=3, do_sample=False,
                             length_penalty=0.0, early_stopping=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        logp = model(input_ids=out.sequences[:, :-1]).logits.log_softmax(-1)
    want = logp[:, ids.shape[1] - 1:].gather(-1, out.sequences[:, ids.shape[1]:, None]).squeeze(-1).sum(-1)
    assert torch.allclose(out.sequences_scores, want, atol=1e-4), (out.sequences_scores, want)
    copy = deepcopy(model)
    assert copy._reorder_cache.__self__ is copy  # a copy reorders its own store
    wide.unwrap(model)
    assert not hasattr(model, "_reorder_cache")
