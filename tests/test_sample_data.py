"""`wide sample-data`: token shards sampled from a model, reproducible from their seed,
resumable, verified on load, and trainable with --data DIR."""

import json

import numpy as np
import pytest
from conftest import write_tiny_run
from transformers import AutoModelForCausalLM, AutoTokenizer

from wide import data
from wide.base import fileio
from wide.commands import sampling_data
from wide.cli import main
from wide.data import AssetError, read_token_shards
from wide.commands.sampling_data import SampleArgs, sample_data

SAMPLE = ["--device", "cpu", "--tokens", "300", "--shard-tokens", "128", "--batch-size", "4", "--max-new-tokens", "20"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    return tmp_path, common


def shas(d):
    return [s["sha256"] for s in json.loads((d / "manifest.json").read_text())["shards"]]


def test_same_seed_same_tokens_other_seed_other_tokens(tiny):
    import os
    import stat

    tmp, common = tiny
    old = os.umask(0o022)
    try:
        for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
            assert main(["sample-data", *common[:2], *SAMPLE, "--seed", seed, "--out", str(tmp / name)]) == 0
    finally:
        os.umask(old)
    # outputs others may read: the modes the umask gives (issue 41, defect 10; shards were 0600)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp / "a").iterdir()} == {0o644}
    assert shas(tmp / "a") == shas(tmp / "b") and len(shas(tmp / "a")) == 3
    assert not set(shas(tmp / "a")) & set(shas(tmp / "c"))
    man = json.loads((tmp / "a" / "manifest.json").read_text())
    assert man["complete"] and man["tokens"] >= 300 and man["settings"]["sampling"]["seed"] == 3
    assert man["settings"]["model"]["config_sha256"] == fileio.sha256_file(tmp / "model" / "config.json")
    assert man["settings"]["tokenizer"]["separator"] == 0 and man["wide"]["version"]
    assert man["command"].startswith("wide ") and [s["target"] for s in man["shards"]] == [128, 128, 44]
    docs = read_token_shards(tmp / "a")
    assert sum(len(d) + 1 for d in docs) == man["tokens"] and all(len(d) for d in docs)
    from safetensors.numpy import load_file

    shard = load_file(str(tmp / "a" / "shard_00000.safetensors"))
    assert shard["tokens"].dtype == np.int32 and shard["offsets"].dtype == np.int64
    assert all(int(d.max()) < 96 for d in docs)  # ids of the tiny model


def test_resume_keeps_verified_shards_and_resamples_the_rest(tiny, monkeypatch):
    tmp, common = tiny
    out = tmp / "s"
    assert main(["sample-data", *common[:2], *SAMPLE, "--out", str(out)]) == 0
    first = shas(out)
    (out / "shard_00001.safetensors").write_bytes(b"damaged")  # a shard that no longer matches its sha256
    calls = []
    real = sampling_data.sample_shard
    monkeypatch.setattr(sampling_data, "sample_shard", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    assert main(["sample-data", *common[:2], *SAMPLE, "--out", str(out)]) == 0
    assert calls == [1] and shas(out) == first  # only the damaged one, sampled again to the same bytes
    # More tokens later: every full shard is kept, the partial last one is sampled to its new target.
    calls.clear()
    assert main(["sample-data", *common[:2], *SAMPLE[:2], "--tokens", "400", *SAMPLE[4:], "--out", str(out)]) == 0
    assert calls == [2, 3] and shas(out)[:2] == first[:2]
    # Other settings are refused, naming them.
    assert main(["sample-data", *common[:2], *SAMPLE, "--temperature", "0.7", "--out", str(out)]) == 2


def test_shards_are_verified_on_load_and_need_their_tokenizer(tiny, capsys):
    tmp, common = tiny
    out = tmp / "s"
    assert main(["sample-data", *common[:2], *SAMPLE, "--out", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(tmp / "model")
    ids = data.pack_documents(data.load_documents(str(out)), tok, 8)
    docs = read_token_shards(out)
    assert ids.flatten().tolist() == data._token_stream(docs, 0)[:ids.numel()].tolist()
    with pytest.raises(ValueError, match="no held-out split"):
        data.load_documents(str(out), split="heldout")
    f = out / "shard_00002.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(AssetError, match="sha256 mismatch"):
        read_token_shards(out)
    f.write_bytes(bytes(raw[:-1]) + bytes([raw[-1] ^ 1]))
    other = AutoTokenizer.from_pretrained(tmp / "model")
    other.add_tokens(["extra"])
    with pytest.raises(ValueError, match="sampled with another tokenizer"):
        data.pack_documents(data.load_documents(str(out)), other, 8)
    # An interrupted sampling run cannot be trained on.
    man = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**man, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        read_token_shards(out)


def test_calibration_prompts_come_from_the_calibration_split(tiny):
    tmp, common = tiny
    model = AutoModelForCausalLM.from_pretrained(tmp / "model")
    tok = AutoTokenizer.from_pretrained(tmp / "model")
    held = data.load_documents(str(tmp / "docs.jsonl"), split="heldout", heldout_fraction=0.25)
    train = data.load_documents(str(tmp / "docs.jsonl"), split="train", heldout_fraction=0.25)
    prompts = data.pack_documents(train, tok, 5)
    args = SampleArgs(tokens=120, shard_tokens=120, batch_size=3, max_new_tokens=6, prompt_source="calibration",
                      prompt_tokens=5)
    man = sample_data(model, tok, args, tmp / "p", model_info=sampling_data.model_fingerprint(tmp / "model"),
                      dtype="float32", prompts=prompts, prompt_info={"source": "calibration"}, progress=False)
    docs = read_token_shards(tmp / "p")
    starts = {tuple(r) for r in prompts.tolist()}
    assert man["complete"] and all(tuple(d[:5].tolist()) in starts for d in docs)
    held_words = {" ".join(h.split()[i:i + 5]) for h in held for i in range(len(h.split()) - 4)}
    train_words = {" ".join(t.split()[i:i + 5]) for t in train for i in range(len(t.split()) - 4)}
    starts_text = {" ".join(tok.convert_ids_to_tokens(list(s))) for s in starts}
    assert starts_text & train_words and not starts_text & (held_words - train_words)


def test_cli_prompts_from_calibration_then_train_kd_on_the_shards_and_evaluate(tiny):
    tmp, common = tiny
    data_args = ["--data", str(tmp / "docs.jsonl"), "--heldout-fraction", "0.25", "--decontaminate", "heldout"]
    assert main(["sample-data", *common[:2], *data_args, *SAMPLE, "--prompt-source", "calibration",
                 "--prompt-tokens", "4", "--out", str(tmp / "s")]) == 0
    man = json.loads((tmp / "s" / "manifest.json").read_text())
    assert man["settings"]["prompts"]["data"] == str((tmp / "docs.jsonl").resolve())
    assert man["settings"]["prompts"]["decontaminate"] == "heldout"
    train = ["--model", str(tmp / "model"), "--data", str(tmp / "s"), "--eval-data", str(tmp / "docs.jsonl"),
             "--seq-len", "16", "--heldout-fraction", "0.25", "--decontaminate", "heldout", "--device", "cpu",
             "--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "1",
             "--ffn-group-size", "32", "--loss", "kd", "--seed", "7"]
    assert main(["calibrate", *train, "--out", str(tmp / "r")]) == 0
    run = json.loads((tmp / "r" / "run.json").read_text())
    assert run["data"]["data"] == str((tmp / "s").resolve()) and run["decontamination"]["eval_source"].endswith(
        "docs.jsonl")
    assert main(["eval", *common, "--routers", str(tmp / "r" / "routers"), "--tasks", "--out", str(tmp / "e")]) == 0
    rec = json.loads((tmp / "e.json").read_text())["records"][0]
    assert (rec["loss"], rec["tokens"], rec["seed"]) == ("kd", 2 * 2 * 16, 7)


def test_shard_targets():
    assert SampleArgs(tokens=300, shard_tokens=128).shard_targets() == [128, 128, 44]
    assert SampleArgs(tokens=256, shard_tokens=128).shard_targets() == [128, 128]
    with pytest.raises(ValueError, match="top_p"):
        SampleArgs(top_p=0)


def test_sampled_documents_are_decontaminated_once_then_from_the_cache(tiny, monkeypatch):
    tmp, common = tiny
    assert main(["sample-data", *common[:2], *SAMPLE, "--out", str(tmp / "s")]) == 0
    tok = AutoTokenizer.from_pretrained(tmp / "model")
    docs = read_token_shards(tmp / "s")
    texts = tok.batch_decode([d.tolist() for d in docs])
    k = max(range(len(texts)), key=lambda i: len(texts[i].split()))  # the sample with the most words
    assert len(texts[k].split()) >= 3
    refs = {"planted": np.unique(data.ngram_hashes(texts[k], 3))}
    keep, report = data._shard_decontamination(docs, tok, refs, 3, tmp / "cache")
    assert not keep[k] and report["documents_hit"]["planted"] >= 1 and report["documents"] == len(docs)
    monkeypatch.setattr(tok, "batch_decode", lambda *a, **kw: pytest.fail("decoded again"))
    assert data._shard_decontamination(docs, tok, refs, 3, tmp / "cache") == (keep, report)
