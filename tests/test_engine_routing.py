"""The engine's routing rules (wide.engine.routing_rules): tile-coherent routers and batch-shared decode
on the static-cache engine give the logits of the masked HF path that implements the same rules
(wide.method.modeling), prefill and decode, on both backends (the kernels under the interpreter)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402

import wide  # noqa: E402
from wide.method.modeling import batch_shared_decode  # noqa: E402

TINY = dict(hidden_size=64, head_dim=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)


def routed(seed=0, **cfg):
    model = wide.wrap(tiny_model("llama", seed=seed, **TINY), wide.WideConfig(ffn_group_size=32, **{"router_init": "random", **cfg}), seed=seed)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(seed + 1))
    wide.calibrate_offsets(model, [ids], target=0.5, mode="per_module", rounds=1)
    return model


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def ids_of(b, t, seed=3):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


# The rules' tile arithmetic is the engine's host code, the same on both backends: every tile
# size runs on "torch". The kernels' paths differ by source only (the previous-tile rule's sums
# ride in the norm launch), so "triton" takes one tile size per source, the ragged 3 among them
# (each interpreted case costs about 20 CPU-s).
@pytest.mark.parametrize("tile,source,backend", [
    (4, "first", "triton"), (3, "previous", "triton"),
    *[(t, s, "torch") for t, s in ((4, "first"), (8, "first"), (4, "previous"), (3, "previous"))]])
def test_tiled_routers_prefill_and_decode_match_masked_path(tile, source, backend):
    # prompt of 10 tokens: decode resumes mid-tile (the stored mask) and crosses tile starts;
    # up to 17, the step after tile 8's start at 16, each rule also reuses a fresh decision
    model = routed(route_tile=tile, tile_source=source)
    ids = ids_of(2, 21)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng = wide.accelerate(model, backend=backend)
    assert eng.routing == f"tile{tile}" + ("prev" if source == "previous" else "")
    assert rel(eng.logits(ids), ref) < 1e-5
    for B in (2, 1):
        eng.setup_cache(B, 32)
        eng.prefill(ids[:B, :10])
        for t in range(10, 18):
            masks = []
            out = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long), record=masks)
            assert rel(out, ref[:B, t]) < 1e-5, (B, t)
            if t % tile and t > 10:  # inside a tile: the tile's stored mask, not a fresh decision
                assert all(torch.equal(m, prev) for (_, _, m), prev in zip(masks, last))
            last = [m.clone() for _, _, m in masks]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("source", ["first", "previous"])
def test_steps_inside_every_tile_skip_the_routers(backend, source, monkeypatch):
    # With the host's positions, a step where no sequence starts a tile runs on the stored masks
    # without evaluating a router, and gives the same logits as the step that evaluates them.
    model = routed(route_tile=4, tile_source=source)
    ids = ids_of(2, 21)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng = wide.accelerate(model, backend=backend)
    calls = []
    for name in ("mask", "margins"):
        f = getattr(eng.ops, name)
        monkeypatch.setattr(eng.ops, name, lambda *a, f=f, **k: calls.append(1) or f(*a, **k))
    import wide.engine.ops as ops_module
    kernel = ops_module.norm_route
    monkeypatch.setattr(ops_module, "norm_route", lambda *a, **k: (calls.append(1) if len(a) > 4 and a[4] is not None
                                                                  else None) or kernel(*a, **k))
    for B in (1, 2):
        eng.setup_cache(B, 32)
        eng.prefill(ids[:B, :10])
        for t in range(10, 17):  # tile starts at 12 and 16, steps inside tiles on either side
            starts = [t % 4 == 0] * B
            assert eng.rule.reuses([t] * B) == (not any(starts))
            calls.clear()
            masks = []
            out = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long), record=masks, positions=[t] * B)
            assert rel(out, ref[:B, t]) < 1e-5, (B, t)
            assert (len(calls) == 0) == (not any(starts)), (B, t, len(calls))
    assert not eng.rule.reuses([5, 8])  # one sequence starting a tile is enough to route


def test_generate_skips_routers_inside_tiles_and_keeps_the_tokens():
    model = routed(route_tile=4)
    prompt = ids_of(1, 7, seed=11)[0].tolist()
    eng = wide.accelerate(model, backend="torch")
    got = eng.generate([prompt], max_new_tokens=9).tokens[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(9):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[len(prompt):]


@pytest.mark.parametrize("source", ["first", "previous"])
def test_tiled_prefill_right_padded_batch_continues_each_tile(source):
    # two prompts of different lengths in one right-padded batch: each decodes as it would alone
    model = routed(route_tile=4, tile_source=source)
    ids = ids_of(2, 20, seed=9)
    eng = wide.accelerate(model, backend="triton")
    lens = torch.tensor([13, 10])
    eng.setup_cache(2, 32)
    eng.prefill(ids[:, :13], lens)
    with torch.no_grad():
        refs = [model(input_ids=ids[b:b + 1]).logits[0] for b in range(2)]
    for step in range(4):  # each crosses a tile start (16 and 12)
        pos = lens + step
        out = eng.decode(ids[torch.arange(2), pos], pos)
        for b in range(2):
            assert rel(out[b], refs[b][pos[b]]) < 1e-5, (step, b)


@pytest.mark.parametrize("rule", ["token", "tile4", "tile4prev", "tile3prev"])
def test_prefill_without_lengths_is_prefill_with_full_lengths(rule):
    # Without lens the rules leave out their padding ops (the host-bound eager 4k prefill of
    # tile16prev, bench/results/routing); what they hand on to decode must not change. 10 tokens:
    # the last tile is partial for tiles of 4 and 3.
    tile = {"tile4": dict(route_tile=4), "tile4prev": dict(route_tile=4, tile_source="previous"),
            "tile3prev": dict(route_tile=3, tile_source="previous")}.get(rule, {})
    model = routed(**tile)
    ids = ids_of(2, 10)
    a, b = (wide.accelerate(model, backend="torch") for _ in range(2))
    for eng in (a, b):
        eng.setup_cache(2, 32)
    out_a = a.prefill(ids).clone()
    out_b = b.prefill(ids, torch.full((2,), 10, dtype=torch.long))
    assert torch.equal(out_a, out_b)
    for attr in ("store", "sums"):
        sa, sb = getattr(a.rule, attr, {}), getattr(b.rule, attr, {})
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), attr
    pos = torch.full((2,), 10, dtype=torch.long)
    assert torch.equal(a.decode(ids[:, 0], pos), b.decode(ids[:, 0], pos))


def hf_shared_steps(model, ids, start: int):
    """(t, logits [B, V]) of the masked HF path decoding ids[:, t] for t >= start under the
    batch-shared rule, after a prefill of ids[:, :start]."""
    with torch.no_grad(), batch_shared_decode(model):
        out = model(input_ids=ids[:, :start], use_cache=True)
        for t in range(start, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
            yield t, out.logits[:, -1]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_batch_shared_decode_matches_masked_path(backend):
    model = routed(seed=4)
    ids = ids_of(3, 16, seed=5)
    eng = wide.accelerate(model, backend=backend, batch_shared=True)
    assert eng.routing == "batch_shared"
    with torch.no_grad():
        assert rel(eng.logits(ids), model(input_ids=ids).logits) < 1e-5  # prefill is per token
    eng.setup_cache(3, 32)
    eng.prefill(ids[:, :8])
    for t, ref in hf_shared_steps(model, ids[:, :12], 8):
        masks = []
        got = eng.decode(ids[:, t], torch.full((3,), t, dtype=torch.long), record=masks)
        assert rel(got, ref) < 1e-5, t
        for _, _, m in masks:
            assert torch.equal(m, m[:1].expand_as(m))  # one set for the batch


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_batch_shared_at_batch_one_is_per_token_routing_without_the_choice(backend, monkeypatch):
    # A batch of one's shared set is its own mask, so the engine takes the per-token path
    # (router deferred to the GEMVs on the kernels) and never runs the batch-wide choice.
    model = routed(seed=6)
    ids = ids_of(1, 14, seed=7)
    token = wide.accelerate(model, backend=backend)
    shared = wide.accelerate(model, backend=backend, batch_shared=True)
    monkeypatch.setattr(shared.ops, "shared_mask", lambda m: pytest.fail("batch-wide choice at batch 1"))
    for eng in (token, shared):
        eng.setup_cache(1, 32)
        eng.prefill(ids[:, :8])
    for t, ref in hf_shared_steps(model, ids[:, :11], 8):
        pos = torch.full((1,), t, dtype=torch.long)
        got, want = [], []
        a = shared.decode(ids[:, t], pos, record=got)
        assert torch.equal(a, token.decode(ids[:, t], pos, record=want)), t
        assert all(torch.equal(x[2], y[2]) for x, y in zip(got, want))
        assert rel(a, ref) < 1e-5, t  # the masked path's batch-shared rule at batch 1


def test_batch_shared_refusals():
    with pytest.raises(ValueError, match="per-token routers only"):
        wide.accelerate(routed(route_tile=4), backend="torch", batch_shared=True)
    with pytest.raises(ValueError, match="routed-engine option"):
        wide.accelerate(routed(), backend="torch", mode="dense", batch_shared=True)


@pytest.mark.parametrize("rule", ["token", "tile4", "tile4prev", "batch_shared"])
def test_decode_step_survives_a_graph_captures_warm_up(rule):
    # A CUDA-graph capture first runs the step twice eagerly (wide.engine.graphs.warm_up), then the
    # replay runs it once more: what the step leaves behind must be what one run leaves. The
    # previous-tile rule's running sums grow by the step's row, so the warm-up puts them back
    # (rule.step_state); on the H200 the graph missed that and drifted from eager by 0.65
    # (experiments/results/routing/routing_check_prev.json). Steps 10-13 cross a tile start at 12.
    from wide.engine.graphs import warm_up
    tile = {"tile4": dict(route_tile=4), "tile4prev": dict(route_tile=4, tile_source="previous")}.get(rule, {})
    model = routed(**tile)
    ids = ids_of(2, 14)
    engines = [wide.accelerate(model, backend="torch", batch_shared=rule == "batch_shared") for _ in range(3)]
    for eng in engines:
        eng.setup_cache(2, 32)
        eng.prefill(ids[:, :10])
    once, captured, unkept = engines
    drift = 0.0
    for t in range(10, 14):
        pos = torch.full((2,), t, dtype=torch.long)
        ref = once.decode(ids[:, t], pos).clone()
        for eng, keep in ((captured, captured.rule.step_state()), (unkept, [])):
            eng.pos.copy_(pos)
            eng.tok.copy_(ids[:, t])
            step = lambda eng=eng: eng._decode_eager(eng.tok, eng.pos)  # noqa: E731
            with torch.no_grad():  # as decode() runs it
                warm_up(step, keep)
                out = step()
            if eng is captured:
                assert torch.equal(out, ref), t
            else:
                drift = max(drift, rel(out, ref))
    # the test can tell: without the put-back, only the rule with running sums drifts
    assert (drift > 1e-3) == (rule == "tile4prev"), drift
