"""The one check of an output directory that every writing command makes: it must not be, or be
inside, an artefact of another kind.

An artefact is recognised by the files its writer leaves (below). Writing another command's files
into one, or into a directory inside it, breaks it: an index or passage store verifies that its
checksum record lists every file it holds, so `t5r eval --output_dir=<index>` would leave the index
unloadable, and `t5r train --model_dir=<index>` would mix checkpoints into it. A command may write
into an artefact of its own kind (`t5r encode` resumes an embeddings directory, `t5r train` a model
directory, `t5r index` rewrites an index), never into one inside any artefact.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Collection

from t5_retrieval import checksums
from t5_retrieval.errors import UserError

INDEX = "index"
PASSAGE_STORE = "passage store"
EMBEDDINGS = "embeddings directory"
MODEL = "model directory"
SAVEDMODEL = "SavedModel export"
HF_EXPORT = "Hugging Face export"
ENSEMBLE = "DPR-MUF ensemble"
UNFINISHED = "unfinished artefact"  # a writer's pending marker and no record yet (`t5r index` killed)
ARTEFACT = "artefact"  # a checksum record of a kind not named above (a checkpoint step, the demo slice)

# The files each writer leaves, named here as strings so that this check imports no model or
# TensorFlow code; tests/test_input_refusals.py checks them against the writers' own constants.
INDEX_JSON = "index.json"  # retrieval.stored_index.INDEX_JSON
MANIFEST = "manifest.json"  # data.stores.kb.MANIFEST and data.stores.embedding_store.MANIFEST
PAGE_MAP = "page_map.tsv"  # data.stores.kb.PAGE_MAP
IDS_FILE = "passage_ids.txt"  # data.stores.embedding_store.IDS_FILE
SHARD_SIDECAR = "shard-*.npy" + checksums.SIDECAR_SUFFIX  # an embedding shard's own record
MODEL_CONFIG = "model_config.json"  # checkpoint.CONFIG_FILE
QUERY_SIDE = "query_side.json"  # checkpoint.QUERY_SIDE_FILE
EXPORT_JSON = "t5r_export.json"  # export.savedmodel.EXPORT_JSON
RETRIEVAL_JSON = "t5r_retrieval.json"  # export.hf.RETRIEVAL_JSON
ENSEMBLE_JSON = "ensemble.json"  # fusion.muf.ENSEMBLE_JSON


def _has(*names: str) -> Callable[[set[str]], str | None]:
    return lambda files: names[-1] if all(n in files for n in names) else None


def _any_matching(pattern: str) -> Callable[[set[str]], str | None]:
    return lambda files: next((f for f in sorted(files) if fnmatch.fnmatch(f, pattern)), None)


def _either(*names: str) -> Callable[[set[str]], str | None]:
    return lambda files: next((n for n in names if n in files), None)


# (kind, test of a directory's file names returning the file that shows it), most specific first:
# an index holds passage_ids.txt as embeddings do, a Hugging Face export a model_config.json.
_KINDS: list[tuple[str, Callable[[set[str]], str | None]]] = [
    (INDEX, _has(INDEX_JSON)),
    (SAVEDMODEL, _has(EXPORT_JSON)),
    (HF_EXPORT, _has(RETRIEVAL_JSON)),
    (ENSEMBLE, _has(ENSEMBLE_JSON)),
    (PASSAGE_STORE, _has(MANIFEST, PAGE_MAP)),
    (EMBEDDINGS, lambda files: _has(MANIFEST, IDS_FILE)(files) or _any_matching(SHARD_SIDECAR)(files)),
    (MODEL, _either(MODEL_CONFIG, QUERY_SIDE)),
    (ARTEFACT, _has(checksums.CHECKSUMS_FILE)),
    (UNFINISHED, _has(checksums.PENDING_FILE)),
]


def kind_of(directory: str) -> tuple[str, str] | None:
    """(kind, the file that shows it) of the artefact `directory` is, or None for a plain directory."""
    try:
        files = set(os.listdir(directory))
    except OSError:  # missing, not a directory, or unreadable: nothing there to break
        return None
    for kind, shown_by in _KINDS:
        marker = shown_by(files)
        if marker:
            return kind, os.path.join(directory, marker)
    return None


def check_output_dir(path: str, flag: str, command: str, own_kinds: Collection[str] = ()) -> None:
    """Raises UserError when `path` (the value of `flag`) is an artefact of a kind not in
    `own_kinds`, or lies inside any artefact (the nearest one is named). Symbolic links are
    followed: writing through one writes where it points."""
    real = os.path.realpath(path)
    found = kind_of(real) if os.path.isdir(real) else None
    if found and found[0] not in own_kinds:
        kind, marker = found
        raise UserError(f"{flag}={path}: is {_article(kind)} {kind} ({marker} shows it); {command} would write its "
                        "files among the artefact's and leave it unloadable: choose a new directory")
    parent = os.path.dirname(real)
    while parent != os.path.dirname(parent):
        found = kind_of(parent)
        if found:
            kind, marker = found
            raise UserError(f"{flag}={path}: is inside the {kind} {parent} ({marker} shows it); {command} would add "
                            f"files the {kind} does not list and leave it unloadable: choose a directory outside it")
        parent = os.path.dirname(parent)


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiouAEIOU" else "a"
