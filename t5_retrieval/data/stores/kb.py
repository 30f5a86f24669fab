"""Knowledge base: KILT pages -> ~100-word passages, stored as sharded jsonl with a manifest.

Layout of a passage store directory (written by `t5r data kb`)::

    manifest.json               counts, shard names, chunking settings
    passages-00000.jsonl        {"id", "wikipedia_id", "title", "text", "span"} in id order
    passages-00000.offsets.npy  byte offset of every line, for random access by `get`
    page_map.tsv                passage_id <TAB> wikipedia_id, in id order (the passage -> page map)
    t5r_checksums.json          size and sha256 of every file, verified when the store is opened

Writes stream page by page into a temporary directory that is renamed into place only after the
manifest and the checksums are written, so an interrupted run never leaves something that looks
finished, and a store altered or truncated afterwards is refused when opened. The same
layout holds the 36M-passage KILT KB (sharded files, no whole-KB list in memory while writing).
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from t5_retrieval import checksums
from t5_retrieval.artefact_io import remove_stale_temporaries, replaced_on_success
from t5_retrieval.data.records import DataError, Passage, check_id, id_field, read_jsonl, require, text_field
from t5_retrieval.data.text import PASSAGE_TEMPLATE, format_passage
from t5_retrieval.errors import ConfigError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PAGE_MAP = "page_map.tsv"
FORMAT = "t5r.passages/1"
SECTION = "Section::::"
BULLET = "BULLET::::"

# A chunk span: (first paragraph index, last paragraph index) in the page's `text` list, inclusive.
Span = tuple[int, int]


def passage_text(p: Passage, template: str = PASSAGE_TEMPLATE) -> str:
    """The passage string the model sees (`text.format_passage`)."""
    return format_passage(p.title, p.text, template)


# ----------------------------------------------------------------------------------------------
# Chunking


def _clean_paragraph(paragraph: str) -> str:
    paragraph = paragraph.strip()
    if paragraph.startswith(BULLET):
        paragraph = paragraph[len(BULLET):].lstrip("- ").strip()
    return paragraph


def chunk_page(wikipedia_id: str, title: str, paragraphs: list[str],
               words_per_passage: int = 100) -> list[tuple[Passage, Span]]:
    """Splits one page into passages of about `words_per_passage` words that never cross a section.

    "Section::::" paragraphs start a new section and are not passage text; a first paragraph equal
    to the title (the KILT knowledge source stores the title as paragraph 0) is skipped. A section
    of n words becomes ceil(n / words_per_passage) chunks of near-equal length, so there are no
    tiny trailing passages. Paragraph indices in the spans refer to the original `paragraphs`
    list, which is what KILT provenance `start_paragraph_id`/`end_paragraph_id` index.
    """
    sections: list[list[tuple[int, list[str]]]] = [[]]
    for index, raw in enumerate(paragraphs):
        if raw.startswith(SECTION):
            sections.append([])
            continue
        if index == 0 and raw.strip() == title.strip():
            continue
        words = _clean_paragraph(raw).split()
        if words:
            sections[-1].append((index, words))
    out: list[tuple[Passage, Span]] = []
    for section in sections:
        tagged = [(index, word) for index, words in section for word in words]
        if not tagged:
            continue
        n_chunks = -(-len(tagged) // words_per_passage)
        bounds = [round(i * len(tagged) / n_chunks) for i in range(n_chunks + 1)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            chunk = tagged[lo:hi]
            passage = Passage(id=f"{wikipedia_id}_{len(out)}", wikipedia_id=wikipedia_id, title=title,
                              text=" ".join(w for _, w in chunk))
            out.append((passage, (chunk[0][0], chunk[-1][0])))
    return out


class _UniqueKeys:
    """Refuses a key (page or passage id) seen on an earlier line of the same source file.

    Only the keys are held; the earlier line is found by reading the file again, on the error path."""

    def __init__(self, path: str, what: str, key_of: Callable[[Any], str | None]):
        self.path, self.what, self.key_of = path, what, key_of
        self.seen: set[str] = set()

    def add(self, key: str, line_no: int) -> None:
        if key in self.seen:
            first = next(n for n, row in self._rows() if self.key_of(row) == key)
            raise DataError(f"{self.path}:{line_no}: {self.what} {key!r} is also on line {first}; "
                            f"each {self.what} must appear once in the knowledge source")
        self.seen.add(key)

    def _rows(self) -> Iterator[tuple[int, Any]]:
        if self.path.endswith(".tsv"):
            with open(self.path, encoding="utf-8", newline="") as f:
                yield from enumerate(csv.reader(f, delimiter="\t"), start=1)
        else:
            yield from read_jsonl(self.path)


def iter_knowledge_source(path: str, words_per_passage: int = 100) -> Iterator[tuple[Passage, Span]]:
    """Streams passages from a KILT knowledge source (jsonl: wikipedia_id, wikipedia_title, text)."""
    pages = _UniqueKeys(path, "page (wikipedia_id)", lambda row: str(row.get("wikipedia_id")).strip())
    for line_no, row in read_jsonl(path):
        # Ids as the KILT scorer compares them (`records.check_id`): `"demo00002 "` is the page `demo00002`.
        wikipedia_id = id_field(row, "wikipedia_id", path, line_no)
        pages.add(wikipedia_id, line_no)
        title = text_field(row, "wikipedia_title", path, line_no)
        text = require(row, "text", path, line_no)
        if not isinstance(text, list) or not all(isinstance(p, str) for p in text):
            raise DataError(f"{path}:{line_no}: field 'text' must be a list of paragraph strings")
        yield from chunk_page(wikipedia_id, title, text, words_per_passage)


def iter_dpr_tsv(path: str) -> Iterator[tuple[Passage, Span | None]]:
    """Streams passages from DPR's `psgs_w100.tsv` (id, text, title; header line optional).

    DPR passages carry no page id: the title is the page key, as in DPR's own evaluation.
    """
    csv.field_size_limit(sys.maxsize)
    ids = _UniqueKeys(path, "passage id", lambda fields: fields[0].strip() if fields else None)
    with open(path, encoding="utf-8", newline="") as f:
        for line_no, fields in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if line_no == 1 and fields[:3] == ["id", "text", "title"]:
                continue
            if not fields:
                continue
            if len(fields) != 3:
                raise DataError(f"{path}:{line_no}: expected 3 tab-separated fields (id, text, title), "
                                f"got {len(fields)}")
            pid, text, title = fields
            pid = check_id(pid, "id", path, line_no)
            check_id(title, "title", path, line_no)  # the page key: one line of page_map.tsv
            ids.add(pid, line_no)
            if text.startswith('"') and text.endswith('"'):
                text = text[1:-1].replace('""', '"')
            yield Passage(id=pid, wikipedia_id=title, title=title, text=text), None


def iter_passages_jsonl(path: str) -> Iterator[tuple[Passage, Span | None]]:
    """Streams already-chunked passages (jsonl: id, wikipedia_id, title, text), e.g. mini-KILT's
    `kb/passages.jsonl`; they are stored as they are."""
    ids = _UniqueKeys(path, "passage id", lambda row: str(row.get("id")).strip())
    for line_no, row in read_jsonl(path):
        fields = [id_field(row, f, path, line_no) for f in ("id", "wikipedia_id")]
        fields += [text_field(row, f, path, line_no) for f in ("title", "text")]
        ids.add(fields[0], line_no)
        span = row.get("span")
        if span is not None and not (isinstance(span, list) and len(span) == 2 and all(
                isinstance(i, int) and not isinstance(i, bool) for i in span)):
            raise DataError(f"{path}:{line_no}: field 'span' must be [first paragraph, last paragraph] or null "
                            f"(got {json.dumps(span)[:60]})")
        yield Passage(*fields), (span[0], span[1]) if span is not None else None


def source_format(path: str) -> str:
    """"dpr_tsv" for `.tsv`; for jsonl, "passages" when the first row has a string `text` and an `id`,
    else "knowledge_source" (KILT pages with a list of paragraphs)."""
    if path.endswith(".tsv"):
        return "dpr_tsv"
    for _, row in read_jsonl(path):
        return "passages" if isinstance(row.get("text"), str) and "id" in row else "knowledge_source"
    raise DataError(f"{path}: empty knowledge source")


def iter_source(path: str, words_per_passage: int = 100) -> Iterator[tuple[Passage, Span | None]]:
    """Reads any supported knowledge source layout (see `source_format`)."""
    kind = source_format(path)
    if kind == "dpr_tsv":
        return iter_dpr_tsv(path)
    if kind == "passages":
        return iter_passages_jsonl(path)
    return iter_knowledge_source(path, words_per_passage)


# ----------------------------------------------------------------------------------------------
# Writing


def _shard_name(index: int) -> str:
    return f"passages-{index:05d}.jsonl"


def write_passage_store(passages: Iterable[tuple[Passage, Span | None]], out_dir: str, *,
                        passages_per_shard: int = 1_000_000, overwrite: bool = False,
                        metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Streams passages into a store at out_dir; returns the manifest.

    Everything goes to `out_dir.tmp-<host>-<pid>` first; the manifest is written last and the directory
    renamed into place, so a crash leaves no directory with a manifest. Duplicate ids are an error.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
    for path in remove_stale_temporaries(os.path.dirname(out_dir), f"{glob.escape(os.path.basename(out_dir))}.tmp-*"):
        log.info("removed %s, left by a crashed build", path)
    with replaced_on_success(out_dir) as tmp:
        os.makedirs(tmp)
        manifest = _write_store(passages, tmp, passages_per_shard, metadata)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)  # the rename replaces only an empty directory
    return manifest


def _write_store(passages: Iterable[tuple[Passage, Span | None]], tmp: str, passages_per_shard: int,
                 metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The store's files, written into `tmp`; returns the manifest (written last)."""
    seen: set[str] = set()
    pages: set[str] = set()
    shards: list[dict[str, Any]] = []
    shard_file = None
    offsets: list[int] = []

    def close_shard() -> None:
        nonlocal shard_file
        if shard_file is not None:
            shard_file.close()
            name = shards[-1]["file"]
            np.save(os.path.join(tmp, name.replace(".jsonl", ".offsets.npy")), np.asarray(offsets, np.int64))
            shard_file = None

    with open(os.path.join(tmp, PAGE_MAP), "w", encoding="utf-8") as page_map:
        for passage, span in passages:
            if passage.id in seen:
                raise DataError(f"duplicate passage id {passage.id!r} (page {passage.wikipedia_id!r})")
            if "\t" in passage.id or "\n" in passage.id or "\t" in passage.wikipedia_id:
                raise DataError(f"passage id {passage.id!r} / page id {passage.wikipedia_id!r} contains a tab or newline")
            seen.add(passage.id)
            pages.add(passage.wikipedia_id)
            if shard_file is None or shards[-1]["num_passages"] >= passages_per_shard:
                close_shard()
                shards.append({"file": _shard_name(len(shards)), "num_passages": 0})
                shard_file = open(os.path.join(tmp, shards[-1]["file"]), "wb")
                offsets = []
            row = {"id": passage.id, "wikipedia_id": passage.wikipedia_id, "title": passage.title,
                   "text": passage.text, "span": list(span) if span is not None else None}
            offsets.append(shard_file.tell())
            shard_file.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
            shards[-1]["num_passages"] += 1
            page_map.write(f"{passage.id}\t{passage.wikipedia_id}\n")
        close_shard()
    if not seen:
        source = (metadata or {}).get("source", "the knowledge source")
        raise DataError(f"{source}: no passages (every page's text is empty); a knowledge source needs text")
    manifest = {"format": FORMAT, "num_passages": len(seen), "num_pages": len(pages), "shards": shards,
                "page_map": PAGE_MAP, **(metadata or {})}
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    checksums.record(tmp)
    return manifest


def build_kb(source: str, out_dir: str, *, words_per_passage: int = 100, passages_per_shard: int = 1_000_000,
             overwrite: bool = False) -> dict[str, Any]:
    """`t5r data kb`: knowledge source (KILT pages, passages jsonl or DPR tsv) -> passage store."""
    if words_per_passage < 1 or passages_per_shard < 1:
        raise ConfigError(f"words_per_passage ({words_per_passage}) and passages_per_shard ({passages_per_shard}) "
                          "must be >= 1")
    return write_passage_store(
        iter_source(source, words_per_passage), out_dir, passages_per_shard=passages_per_shard,
        overwrite=overwrite,
        metadata={"source": os.path.abspath(source), "source_format": source_format(source),
                  "words_per_passage": words_per_passage})


# ----------------------------------------------------------------------------------------------
# Reading


def _rebuild_hint(directory: str, manifest: dict[str, Any]) -> str:
    """The command that writes this store again (a store lives at `<data_dir>/kb`)."""
    if "source" not in manifest or os.path.basename(os.path.normpath(directory)) != "kb":
        return "rebuild it with `t5r data kb`"
    data_dir = os.path.dirname(os.path.normpath(os.path.abspath(directory)))
    return (f"rebuild it: t5r data kb --source={manifest['source']} --data_dir={data_dir} "
            f"--words_per_passage={manifest.get('words_per_passage', 100)} --overwrite")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(manifest: dict[str, Any], path: str, files: set[str]) -> None:
    """DataError naming the field of a manifest that does not describe a store of the files `files`
    (its record's): counts, the shards and the page map, each a file of the store."""
    fix = "rebuild the store with `t5r data kb`"
    for field in ("num_passages", "num_pages"):
        if not _count(manifest.get(field)):
            raise DataError(f"{path}: field {field!r} is {json.dumps(manifest.get(field))[:60]}, expected a count; {fix}")
    if manifest.get("page_map") not in files:
        raise DataError(f"{path}: field 'page_map' is {json.dumps(manifest.get('page_map'))[:60]}, expected a file of "
                        f"the store; {fix}")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise DataError(f"{path}: field 'shards' is {json.dumps(shards)[:60]}, expected a list; {fix}")
    for i, shard in enumerate(shards):
        name = shard.get("file") if isinstance(shard, dict) else None
        if (not isinstance(name, str) or not name.endswith(".jsonl") or name not in files
                or name.replace(".jsonl", ".offsets.npy") not in files or not _count(shard.get("num_passages"))):
            raise DataError(f"{path}: shards[{i}] is {json.dumps(shard)[:60]}, expected {{\"file\": a .jsonl file "
                            f"of the store, \"num_passages\": a count}}; {fix}")


class PassageStore:
    """Read access to a passage store: streaming iteration, id order, page map, random access.

    The id list and page map load lazily on first use (two strings per passage); `get` seeks into
    the shard with the byte offsets written at build time, so no shard is ever held in memory.
    """

    def __init__(self, directory: str, manifest: dict[str, Any]):
        self.directory = directory
        self.manifest = manifest
        self._ids: list[str] | None = None
        self._page: dict[str, str] | None = None
        self._index: dict[str, int] | None = None
        self._offsets: list[np.ndarray] | None = None
        self._shard_starts: np.ndarray | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> PassageStore:
        directory = os.fspath(directory)
        path = os.path.join(directory, MANIFEST)
        if not os.path.isdir(directory):
            raise DataError(f"{directory}: no such directory" + ("" if os.path.isabs(directory) else
                                                                 f" (in the working directory {os.getcwd()})"))
        if not os.path.lexists(path):
            raise DataError(f"{directory}: no {MANIFEST}; not a passage store, or its build did not finish "
                            "(rebuild it with `t5r data kb`)")
        # The manifest is parsed only after it matched its record entry, the store's other files
        # only after all of them did.
        manifest = checksums.verified_json(directory, MANIFEST, "passage store", "rebuild it with `t5r data kb`",
                                           DataError)
        if manifest.get("format") != FORMAT:
            raise DataError(f"{path}: field 'format' is {manifest.get('format')!r}, expected {FORMAT!r}")
        files = checksums.verify(directory, "passage store", _rebuild_hint(directory, manifest))
        _check_manifest(manifest, path, set(files))
        return cls(directory, manifest)

    def __len__(self) -> int:
        return int(self.manifest["num_passages"])

    @property
    def num_pages(self) -> int:
        return int(self.manifest["num_pages"])

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        """Raw rows in id order, including the paragraph `span`."""
        for shard in self.manifest["shards"]:
            path = os.path.join(self.directory, shard["file"])
            for _, row in read_jsonl(path):
                yield row

    def __iter__(self) -> Iterator[Passage]:
        for row in self.iter_rows():
            yield _passage(row)

    def _load_map(self) -> None:
        if self._ids is not None:
            return
        ids, page = [], {}
        with open(os.path.join(self.directory, self.manifest["page_map"]), encoding="utf-8") as f:
            for line in f:
                pid, _, wikipedia_id = line.rstrip("\n").partition("\t")
                ids.append(pid)
                page[pid] = wikipedia_id
        self._ids, self._page = ids, page

    def ids(self) -> list[str]:
        """Passage ids in store order."""
        self._load_map()
        assert self._ids is not None
        return self._ids

    def page_of(self, passage_id: str) -> str:
        """wikipedia_id of the page a passage came from (KeyError names the unknown id)."""
        self._load_map()
        assert self._page is not None
        try:
            return self._page[passage_id]
        except KeyError:
            raise KeyError(f"passage {passage_id!r} is not in the store at {self.directory}") from None

    def index_of(self, passage_id: str) -> int:
        """Position of a passage in id order."""
        if self._index is None:
            self._index = {pid: i for i, pid in enumerate(self.ids())}
        try:
            return self._index[passage_id]
        except KeyError:
            raise KeyError(f"passage {passage_id!r} is not in the store at {self.directory}") from None

    def _read_row(self, index: int) -> dict[str, Any]:
        if self._offsets is None:
            shards = self.manifest["shards"]
            self._offsets = [np.load(os.path.join(self.directory, s["file"].replace(".jsonl", ".offsets.npy")))
                             for s in shards]
            self._shard_starts = np.cumsum([0] + [s["num_passages"] for s in shards])
        assert self._shard_starts is not None
        shard = int(np.searchsorted(self._shard_starts, index, side="right")) - 1
        offset = int(self._offsets[shard][index - self._shard_starts[shard]])
        path = os.path.join(self.directory, self.manifest["shards"][shard]["file"])
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: passage {index} at byte {offset} is damaged ({str(e)[:100]}); the store is "
                            "truncated or corrupt: rebuild it with `t5r data kb`") from None

    def get(self, passage_id: str) -> Passage:
        return _passage(self._read_row(self.index_of(passage_id)))

    def span_of(self, passage_id: str) -> Span | None:
        """Paragraph span (first, last) of a KILT-built passage; None for DPR tsv passages."""
        span = self._read_row(self.index_of(passage_id))["span"]
        return (int(span[0]), int(span[1])) if span is not None else None

    def passages_by_page(self) -> dict[str, list[str]]:
        """wikipedia_id -> its passage ids in order (built from the page map, no shard reads)."""
        out: dict[str, list[str]] = {}
        self._load_map()
        assert self._ids is not None and self._page is not None
        for pid in self._ids:
            out.setdefault(self._page[pid], []).append(pid)
        return out


def _passage(row: dict[str, Any]) -> Passage:
    return Passage(id=str(row["id"]), wikipedia_id=str(row["wikipedia_id"]), title=str(row["title"]),
                   text=str(row["text"]))
