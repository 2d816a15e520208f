"""Evaluation text never enters calibration data: calibration documents that share a 13-word
sequence with the held-out split or with a zero-shot task are dropped before packing."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY_WORDS, write_tiny_run
from transformers import AutoTokenizer

from wide import data
from wide.commands import runs
from wide.data import NGRAM, decontam, decontaminate, ngram_hashes


def test_ngrams_ignore_case_punctuation_and_spacing():
    a = ngram_hashes("The cat, the DOG -- and the red house sat under a big blue tree.", n=4)
    b = ngram_hashes("the cat the dog and the red house sat under a big blue tree", n=4)
    assert a.dtype == np.uint64 and len(a) == 14 - 4 + 1 and np.array_equal(a, b)
    assert ngram_hashes("only five words are here", n=13).size == 0
    assert not np.array_equal(ngram_hashes("a b c d", n=4), ngram_hashes("a b d c", n=4))


def test_decontaminate_reports_what_it_drops():
    ref = np.unique(ngram_hashes("one two three four five six", n=3))
    docs = [("clean", "seven eight nine ten eleven"), ("hit", "zero one two three nine"), ("short", "one two")]
    keep, rep = decontaminate(docs, {"task": ref, "other": np.zeros(0, dtype=np.uint64)}, n=3)
    assert keep == [True, False, True]
    assert rep["dropped"] == 1 and rep["kept"] == 2 and rep["dropped_names"] == ["hit"]
    assert rep["documents_hit"] == {"task": 1, "other": 0} and rep["ngrams_hit"]["task"] == 1
    assert rep["dropped_chars"] == len("zero one two three nine")


def _words(g, n):
    return " ".join(TINY_WORDS[int(i)] for i in g.integers(0, len(TINY_WORDS), n))


def _grams(words, n=NGRAM):
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A corpus whose calibration split holds a copy of a held-out document and a document that
    quotes an evaluation passage; the zero-shot tasks are replaced by rows holding that passage."""
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    g = np.random.default_rng(0)
    docs = [_words(g, 60) for _ in range(30)]
    passage = _words(g, 20)
    path = tmp_path / "corpus.jsonl"
    for attempt in range(50):  # place the two planted documents where the split puts them in calibration
        copy_of, at = attempt % len(docs), [3 + attempt, 10 + attempt]
        base = data.split_articles([(f"corpus.jsonl:{i + 1}", d) for i, d in enumerate(docs)], 0.25)
        held = [d for _, d in base[1]]
        planted_docs = list(docs)
        planted_docs.insert(at[0], held[copy_of % len(held)] + " " + _words(g, 30))
        planted_docs.insert(at[1], _words(g, 30) + " " + passage + " " + _words(g, 30))
        path.write_text("\n".join(json.dumps({"text": d}) for d in planted_docs) + "\n")
        train = data.load_documents(str(path), split="train", heldout_fraction=0.25)
        heldout = data.load_documents(str(path), split="heldout", heldout_fraction=0.25)
        if planted_docs[at[0]] in train and planted_docs[at[1]] in train and \
                any(h in planted_docs[at[0]] for h in heldout):
            break
    else:
        pytest.fail("could not plant the documents in the calibration split")
    rows = {task: [{"question": "which one", "passage": passage if task == "boolq" else "unrelated words",
                    "choices": {"text": ["a", "b"]}}] for task in data.ZERO_SHOT_TASKS}
    monkeypatch.setattr(decontam, "load_zero_shot", lambda task, cache_dir=None: rows[task])
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    args = SimpleNamespace(data=str(path), eval_data=None, text_field="text", heldout_fraction=0.25, seq_len=16,
                           decontaminate="all")
    return SimpleNamespace(args=args, tok=tok, heldout=heldout, passage=passage, common=common, root=tmp_path)


def _stream_words(ids, tok):
    return tok.convert_ids_to_tokens(ids.flatten().tolist())


def test_no_heldout_or_eval_ngram_enters_the_calibration_ids(planted):
    p = planted
    forbidden = set().union(*(_grams(h.split()) for h in p.heldout)) | _grams(p.passage.split())
    ids, report = runs.calibration(p.args, p.tok)
    assert not _grams(_stream_words(ids, p.tok)) & forbidden
    assert report["dropped"] == 2 and report["documents_hit"]["heldout"] == 1 and report["documents_hit"]["boolq"] == 1
    # The check is what keeps them out: without it both would be in the ids.
    loose, _ = runs.calibration(SimpleNamespace(**{**vars(p.args), "decontaminate": "none"}), p.tok)
    leaked = _grams(_stream_words(loose, p.tok)) & forbidden
    assert leaked & _grams(p.passage.split()) and leaked - _grams(p.passage.split())
    # The held-out check alone lets the evaluation passage through, and only it.
    partial, rep = runs.calibration(SimpleNamespace(**{**vars(p.args), "decontaminate": "heldout"}), p.tok)
    assert rep["dropped"] == 1 and _grams(_stream_words(partial, p.tok)) & forbidden <= _grams(p.passage.split())


def test_calibrate_records_the_decontamination(planted):
    from wide.cli import main

    p = planted
    common = [*p.common[:2], "--data", p.args.data, "--seq-len", "16", "--heldout-fraction", "0.25", "--device", "cpu"]
    assert main(["calibrate", *common, "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--offsets", "none",
                 "--ffn-group-size", "32", "--out", str(p.root / "run")]) == 0
    rep = json.loads((p.root / "run" / "run.json").read_text())["decontamination"]
    assert rep["mode"] == "all" and rep["dropped"] == 2 and set(rep["sources"]) == {"heldout", *data.ZERO_SHOT_TASKS}


@pytest.mark.slow
def test_measured_overlap_of_the_default_corpus():
    """The numbers docs/data.md reports (the real gensim Wikipedia pages and the seven tasks)."""
    wiki = data.CACHE_DIR / "wiki" / f"enwiki-gensim-4.4.0.v{data._WIKI_CLEANER_VERSION}.json"
    tasks = [data.CACHE_DIR / "zero_shot" / t / ".complete" for t in data.ZERO_SHOT_TASKS]
    if not wiki.is_file() or not all(t.is_file() for t in tasks):
        pytest.skip("the Wikipedia pages and zero-shot tasks are not cached")
    docs, rep = data.calibration_documents("wiki")
    assert (rep["documents"], rep["dropped"]) == (95, 4)
    assert sorted(rep["dropped_names"]) == ["Alaska", "Angola", "Articles of Confederation", "Atomic number"]
    assert {k: v for k, v in rep["documents_hit"].items() if v} == {"boolq": 3, "heldout": 1}
    assert len(docs) == 91
