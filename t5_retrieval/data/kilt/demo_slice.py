"""The real-data demo slice: a few thousand queries of mini-KILT and a KB around their gold pages.

    t5r data slice --mini_kilt=DIR --out=t5_retrieval/demo_data/mini_kilt_slice.tar.gz

Deterministic (seeded sampling, sorted output, a tar with fixed metadata and a gzip without a
timestamp), so rebuilding it from the same mini-KILT gives the same bytes. What it takes:

- queries: a seeded TRAIN_FRACTION of every task's train file (so the tasks keep mini-KILT's
  proportions, which the registered mixture rates assume) and up to DEV_PER_TASK of its dev file;
  nothing from any other split;
- KB: mini-KILT's paragraph passages (`kb/passages.jsonl`) of every gold page of those queries,
  plus passages of seeded random other pages up to KB_PAGES pages, as distractors.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
from collections.abc import Iterable

import t5_retrieval
from t5_retrieval import checksums
from t5_retrieval.artefact_io import open_replaced_on_success, replaced_on_success
from t5_retrieval.data.records import DataError, read_jsonl

TASKS = ("fever", "wow", "hotpotqa", "trex", "entityquestions", "entity_linking")
TRAIN_FRACTION = 0.2
DEV_PER_TASK = 100
KB_PAGES = 3000
SEED = 20261123
ROOT = "mini_kilt_slice"
# The committed slice, package data of t5_retrieval (the wheel carries it).
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(t5_retrieval.__file__)), "demo_data",
                       "mini_kilt_slice.tar.gz")


def _gold_pages(row: dict) -> set[str]:
    return {str(p["wikipedia_id"]).strip() for out in row.get("output", [])
            for p in out.get("provenance", []) or [] if "wikipedia_id" in p}


def _sample(rows: list[dict], count: int, rng: random.Random) -> list[dict]:
    """`count` rows chosen by `rng`, kept in file order."""
    keep = sorted(rng.sample(range(len(rows)), min(count, len(rows))))
    return [rows[i] for i in keep]


def build_slice(mini_kilt: str) -> dict[str, bytes]:
    """Archive member name -> content."""
    rng = random.Random(SEED)
    files: dict[str, bytes] = {}
    gold: set[str] = set()
    for task in TASKS:
        for split in ("train", "dev"):
            rows = [row for _, row in read_jsonl(os.path.join(mini_kilt, f"{task}-{split}-kilt.jsonl"))]
            count = round(TRAIN_FRACTION * len(rows)) if split == "train" else DEV_PER_TASK
            chosen = _sample(rows, count, rng)
            for row in chosen:
                gold |= _gold_pages(row)
            files[f"{task}-{split}-kilt.jsonl"] = _jsonl(chosen)
    passages = [row for _, row in read_jsonl(os.path.join(mini_kilt, "kb", "passages.jsonl"))]
    pages = sorted({str(p["wikipedia_id"]) for p in passages})
    missing = gold - set(pages)
    if missing:
        raise DataError(f"{mini_kilt}/kb/passages.jsonl: {len(missing)} gold pages missing, e.g. {sorted(missing)[:3]}")
    others = [p for p in pages if p not in gold]
    distractors = set(rng.sample(others, max(0, min(len(others), KB_PAGES - len(gold)))))
    kept = gold | distractors
    files["kb/passages.jsonl"] = _jsonl(p for p in passages if str(p["wikipedia_id"]) in kept)
    files["stats.json"] = (json.dumps({"kb_pages": len(kept), "gold_pages": len(gold), "seed": SEED,
                                       "train_fraction": TRAIN_FRACTION, "dev_per_task": DEV_PER_TASK,
                                       "tasks": {t: {s: files[f"{t}-{s}-kilt.jsonl"].count(b"\n")
                                                     for s in ("train", "dev")} for t in TASKS}},
                                      indent=1, sort_keys=True) + "\n").encode()
    return files


def _jsonl(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows).encode("utf-8")


def write_archive(files: dict[str, bytes], path: str) -> None:
    """A .tar.gz whose bytes depend only on `files` (fixed mtimes, owners, order; no gzip timestamp)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(f"{ROOT}/{name}")
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[name]))
    with open_replaced_on_success(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(buffer.getvalue())
    checksums.record_file(path)


def extract(archive: str, out_dir: str) -> str:
    """Unpacks the slice under `out_dir` (once); returns its KILT-format directory.

    The archive is checked against its recorded sha256 first, unpacked into a temporary directory
    that gets its own checksums and is renamed into place; a later run verifies what it reuses."""
    target = os.path.join(out_dir, ROOT)
    rebuild = f"delete {target} and rerun: it is unpacked again from {archive}"
    if os.path.exists(target):
        checksums.verify(target, "unpacked demo slice", rebuild)
        return target
    checksums.verify_file(archive, "demo slice archive",
                          "reinstall t5-retrieval, or rebuild it: t5r data slice --mini_kilt=<mini-KILT dir> "
                          f"--out={archive}")
    with replaced_on_success(target) as tmp:
        os.makedirs(tmp)
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(tmp, filter=_below_root)
        checksums.record(tmp)
    return target


def _below_root(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Extracts `<ROOT>/x` as `x` (with the "data" filter's checks): the archive's one top directory
    is the target itself."""
    name = member.name.removeprefix(f"{ROOT}/")
    if name == member.name:
        return None  # ROOT's own entry
    return tarfile.data_filter(member.replace(name=name, deep=False), dest)
