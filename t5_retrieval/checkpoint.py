"""A model directory on disk, written and read back verified: Orbax checkpoints of the whole
training state plus the data iterator position, the model's config and vocabulary, and a query-side
model's record of its base. Everything that opens a model directory reads it through here
(`inference.load_encoder` then builds the network from it).

One checkpoint = {state: params, optimiser state (incl. TACO), step, RNG} saved as sharded arrays,
and {data: the batch iterator's JSON state}, so a resumed run continues bit-for-bit. The model's
config is stored next to the checkpoints so that inference can rebuild the model from the
directory alone and refuse a checkpoint that does not fit.

Preemption: orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp` and renames it when
complete, so a process killed mid-write leaves only a temporary directory, which the next run's
manager deletes. A finished checkpoint that cannot be read back (truncated or missing files) is
reported with its path and the previous one is used; the unreadable one is moved to
`unreadable_checkpoints/` so that the resumed run can write that step again.

Integrity: orbax stores no checksums, so a flipped byte in an array file would restore silently.
After orbax has finalised a step (every process's files written, the directory renamed), process 0
writes `t5r_checksums.json` into it: the size and sha256 of every file, and of the model directory's
`config.gin` (it names the Task modules that `t5r eval` imports, so it must be the one this step was
trained with). Restoring verifies them first, both ways (an unlisted file fails too); a mismatch
makes the checkpoint unreadable (see above), and so does a checkpoint without the file (killed
between orbax's rename and the file's, or written by an older version: `t5r checksum --accept <step
dir>` records one the user trusts). The training run itself does not check config.gin: it writes
its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from t5_retrieval import artefact_io, checksums
from t5_retrieval.artefact_io import disk_full, is_disk_full, nearly_full, temp_path
from t5_retrieval.data.records import write_json_atomic
from t5_retrieval.data.tokenizers.tokenize import is_wordpiece_path, vocabulary_digest, vocabulary_files
from t5_retrieval.errors import UserError, stderr_kept_unless_discarded
from t5_retrieval.gin_utils import OPERATIVE_CONFIG

CONFIG_FILE = "model_config.json"
UNREADABLE_DIR = "unreadable_checkpoints"
MODEL_FILES = "model_files"  # a step record's entries for files of the model directory
MODEL_DIR_FILES = (OPERATIVE_CONFIG, CONFIG_FILE)  # the files of the model directory a step's record covers
log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint directory that is missing, empty or does not fit the model."""


def manager(directory: str, max_to_keep: int = 3, writer: bool = False) -> ocp.CheckpointManager:
    """A manager of `directory`'s checkpoints. The run that writes them passes `writer=True`, which
    deletes temporary directories left by a killed save; readers (inference) must not, since the
    writer may be saving right now."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False, cleanup_tmp_directories=writer)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=("state", "data"))


def saved_steps(directory: str) -> list[int]:
    """The steps `directory` holds a checkpoint directory of (orbax names them by step), sorted;
    [] for a missing directory."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def reader(directory: str) -> ocp.CheckpointManager:
    """A read-only manager of `directory` private to this process: it neither creates the directory
    nor waits for the job's other processes, so one process of a multi-process job (ANCE's process 0
    mining and evaluating) can load a model while the others wait elsewhere."""
    me = jax.process_index()
    options = ocp.CheckpointManagerOptions(
        create=False, enable_async_checkpointing=False, cleanup_tmp_directories=False,
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "data"))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict[str, Any]) -> None:
    with stderr_kept_unless_discarded() as stderr:
        try:
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(data_state)))
            mngr.wait_until_finished()
        except Exception as e:  # tensorstore reports a full disk in many words, rarely as ENOSPC
            if is_disk_full(e) or nearly_full(str(mngr.directory)):
                # orbax's writer threads have each logged this failure with a traceback, and their
                # callbacks keep printing into a closed event loop for a moment: the user gets one line.
                _wait_for_writer_threads(mngr)
                stderr.discard()
                raise disk_full(str(mngr.directory / str(step)), e) from e
            raise
    if jax.process_count() > 1:  # every process has returned from orbax's save: all files exist
        multihost_utils.sync_global_devices("t5r_checkpoint_saved")
    if jax.process_index() == 0:
        write_checksums(mngr.directory / str(step))


def _wait_for_writer_threads(mngr: ocp.CheckpointManager, seconds: float = 2.0) -> None:
    """After a failed save: lets orbax's threads and tensorstore's callbacks finish failing (and
    printing) before the caller reports, so nothing trails its one-line message."""
    try:
        mngr.close()
    except Exception:  # the save already failed; this only drains it
        pass
    deadline = time.monotonic() + seconds
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    time.sleep(0.2)


def is_step_dir(path: str) -> bool:
    """A checkpoint step directory (named by its step, holding the saved state), not another artefact."""
    return os.path.basename(os.path.abspath(path)).isdigit() and os.path.isdir(os.path.join(path, "state"))


def write_checksums(step_dir: epath.Path) -> None:
    """Records size and sha256 of every file of a finished step, and of the model directory's
    config.gin (the bindings it was trained with, which name the code `t5r eval` imports); written
    whole or not at all."""
    doc = checksums.record_doc({name: checksums.entry(step_dir / name) for name in checksums.files_under(step_dir)})
    model_files = {name: checksums.entry(step_dir.parent / name) for name in MODEL_DIR_FILES
                   if (step_dir.parent / name).exists()}
    if model_files:
        doc[MODEL_FILES] = model_files
    tmp = epath.Path(temp_path(os.fspath(step_dir / checksums.CHECKSUMS_FILE)))  # epath's rename: object stores too
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(step_dir / checksums.CHECKSUMS_FILE)


def verify_checksums(step_dir: epath.Path, model_files: bool = True) -> tuple[int, int]:
    """Raises CheckpointError naming the first missing, resized, altered or unlisted file, or a step
    without checksums (the record `checksums.record_doc` describes, read through epath, so
    checkpoints on object stores are verified too). With `model_files`, the model directory's
    config.gin is checked against the record too. Returns (files, bytes) verified."""
    manifest = step_dir / checksums.CHECKSUMS_FILE
    accept = f"if you trust it, record its checksums as it is now: t5r checksum --accept {step_dir}"
    damaged = "retrain it, or restore another step (--step)"
    if not manifest.exists():
        raise CheckpointError(f"checkpoint {step_dir}: no {checksums.CHECKSUMS_FILE} (the run was killed before "
                              f"writing it, or an older t5-retrieval wrote the checkpoint); {accept}")
    local = _local(step_dir)  # a local step's files are opened as regular files inside it only
    try:
        files, listed = _step_record(step_dir, accept)
        checksums.check_listing(str(step_dir), files, checksums.files_under(step_dir), damaged)
        for name, expected in files.items():
            checksums.check_file(os.path.join(local, name) if local else step_dir / name, expected, str(manifest),
                                 damaged, local)
        for name in MODEL_DIR_FILES if model_files else ():
            if (step_dir.parent / name).exists() and name not in listed:
                raise checksums.ChecksumError(f"{step_dir.parent / name}: not covered by {manifest} "
                                              f"(recorded by an older t5-retrieval); {accept}")
        for name, expected in listed.items() if model_files else ():
            checksums.check_file(os.path.join(os.path.dirname(local), name) if local else step_dir.parent / name,
                                 expected, str(manifest),
                                 f"it differs from the one this checkpoint was trained with; {accept}",
                                 os.path.dirname(local) if local else None)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {step_dir}: unreadable {checksums.CHECKSUMS_FILE} ({e}); {accept}") from None
    except checksums.ChecksumError as e:
        raise CheckpointError(str(e)) from None
    checked = [*files.values(), *(listed.values() if model_files else ())]
    return len(checked), sum(value["size"] for value in checked)


def _local(step_dir: epath.Path) -> str | None:
    """The local path of a step directory; None for one on an object store."""
    path = os.fspath(step_dir)
    return None if "://" in path else path


def _step_record(step_dir: epath.Path, fix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A step's record, parsed and checked: (its files' entries, its entries for files of the model
    directory). A local record is read as a regular file of the step, bounded, of bounded depth."""
    manifest, local = step_dir / checksums.CHECKSUMS_FILE, _local(step_dir)
    if local is None:
        doc = json.loads(manifest.read_text())
    else:
        doc = artefact_io.load_json(os.path.join(local, checksums.CHECKSUMS_FILE), local, checksums.RECORD_BYTES,
                                    checksums.ChecksumError, fix)
    return checksums.parse_record(doc, str(manifest), fix), _listed_model_files(doc, manifest, fix)


def _listed_model_files(doc: Any, manifest: epath.Path, fix: str) -> dict[str, Any]:
    """The record's entries for files of the model directory (config.gin, model_config.json),
    checked like its own."""
    listed = doc.get(MODEL_FILES, {}) if isinstance(doc, dict) else {}
    if not isinstance(listed, dict) or set(listed) - set(MODEL_DIR_FILES):
        raise checksums.ChecksumError(f"{manifest}: field {MODEL_FILES!r} is {json.dumps(listed)[:60]}, "
                                      f"expected {{\"{OPERATIVE_CONFIG}\": an entry, \"{CONFIG_FILE}\": an "
                                      f"entry}}; {fix}")
    return checksums.parse_record(checksums.record_doc(listed), f"{manifest}: {MODEL_FILES}", fix) if listed else {}


def _restore_step(mngr: ocp.CheckpointManager, step: int, args: ocp.args.Composite, what: str,
                  model_files: bool = True) -> Any:
    """`model_files=False` for the training run, which rewrites config.gin from its own flags."""
    try:
        verify_checksums(mngr.directory / str(step), model_files)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {mngr.directory / str(step)} could not be restored as {what}: "
                              f"{e}") from e
    try:
        return mngr.restore(step, args=args)
    except Exception as e:  # tensorstore reports truncated files as a bare Exception
        raise CheckpointError(f"checkpoint {mngr.directory / str(step)} could not be restored as {what} "
                              f"(unreadable, or it does not fit): {type(e).__name__}: {str(e)[:500]}") from e


def _latest_readable(mngr: ocp.CheckpointManager, restore_step: Callable[[int], Any], set_aside: bool
                     ) -> tuple[Any, int] | None:
    """Restores the newest checkpoint that reads; (result, step), or None if there is none.

    Each unreadable checkpoint is logged with its path. Only when an older one reads are the newer
    ones deemed corrupt (and, with `set_aside`, moved away): if none reads, the state probably does
    not fit (e.g. another optimiser), so nothing is moved and the first error is raised.
    """
    failures: list[tuple[int, CheckpointError]] = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            result = restore_step(step)
        except CheckpointError as e:
            log.warning("%s; trying the previous checkpoint", e)
            failures.append((step, e))
            continue
        if failures:
            log.warning("restored %s instead of the unreadable %s", mngr.directory / str(step),
                        ", ".join(str(mngr.directory / str(s)) for s, _ in failures))
            if set_aside:
                _set_aside(mngr, [s for s, _ in failures])
        return result, step
    if failures:
        raise CheckpointError(f"no readable checkpoint in {mngr.directory} (steps "
                              f"{[s for s, _ in failures]}); newest error: {failures[0][1]}") from failures[0][1]
    return None


def _set_aside(mngr: ocp.CheckpointManager, steps: list[int]) -> None:
    """Moves unreadable checkpoints to UNREADABLE_DIR (kept for inspection, out of the step list)."""
    if jax.process_index() == 0:
        target = mngr.directory / UNREADABLE_DIR  # epath: also on object stores
        target.mkdir(parents=True, exist_ok=True)
        for step in steps:
            moved = target / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            (mngr.directory / str(step)).rename(moved)
            log.warning("set aside the unreadable checkpoint %s as %s (kept, not deleted)",
                        mngr.directory / str(step), moved)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("t5r_checkpoint_set_aside")
    mngr.reload()


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None
            ) -> tuple[Any, dict[str, Any]] | None:
    """Restores into the shardings of `abstract_state` (ShapeDtypeStructs); None if no checkpoint.

    Without `step`, the newest readable checkpoint (see `_latest_readable`).
    """
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())

    def restore_step(s: int) -> tuple[Any, dict[str, Any]]:
        restored = _restore_step(mngr, s, args, "this training state", model_files=False)
        return restored["state"], restored["data"]

    if step is not None:
        return restore_step(step)
    found = _latest_readable(mngr, restore_step, set_aside=True)
    return None if found is None else found[0]


def leaf_paths(tree: Any) -> set[str]:
    """Every leaf's path as "/"-joined field names, keys and indices (`opt_state/0/ema/...`), the
    same for a live state and for the dicts and lists orbax's metadata holds."""
    def name(key: Any) -> str:
        return str(next(getattr(key, a) for a in ("name", "key", "idx") if hasattr(key, a)))
    return {"/".join(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def saved_leaf_paths(mngr: ocp.CheckpointManager, step: int) -> set[str] | None:
    """`leaf_paths` of the state saved at `step`, from its metadata (no array is read); None when
    the metadata cannot be read (restoring then reports the checkpoint)."""
    try:
        return leaf_paths(ocp.StandardCheckpointHandler().metadata(mngr.directory / str(step) / "state").tree)
    except Exception:  # a missing or damaged metadata file: the restore that follows says which
        return None


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding, the target orbax restores into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# model_config.json's layout. Version 1 (no field) named the vocabulary by the absolute path it was
# read from (a venv's site-packages, say) and the passage embeddings by their directory, so a model
# directory broke when either moved. Version 2 names the vocabulary by its copy inside the model
# directory and the embeddings by their content: the directory stands alone. `upgrade_config`.
CONFIG_VERSION = 2
VOCABULARY_DIR = "vocabulary"  # in a model directory: a copy of the vocabulary its token ids are of
SENTENCEPIECE_FILE, WORDPIECE_FILE = "spiece.model", "vocab.txt"  # their names there (T5's, BERT's)


def stored_vocabulary_name(source: str) -> str:
    """Where a model directory keeps its copy of the vocabulary at `source`, relative to it."""
    return os.path.join(VOCABULARY_DIR, WORDPIECE_FILE if is_wordpiece_path(source) else SENTENCEPIECE_FILE)


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A model config in this version's layout (CONFIG_VERSION), without touching any file.

    A vocabulary named by an absolute path (version 1, or a config about to be written: training
    records where it read it) becomes its copy inside the model directory, with its content digest
    when the file is there to read; the passage embeddings lose their directory and keep their
    identity (the fingerprint of the model that wrote them, their content digest). What the model
    is stays the same; where its inputs lived is no part of it."""
    out = {**config, "version": CONFIG_VERSION}
    features = dict(config.get("features") or {})
    source = features.get("vocabulary")
    if source and os.path.isabs(source):
        features["vocabulary"] = stored_vocabulary_name(source)
        if not features.get("vocabulary_digest") and os.path.exists(source):
            features["vocabulary_digest"] = vocabulary_digest(source)
    if isinstance(features.get("passage_embeddings"), dict):
        features["passage_embeddings"] = {k: v for k, v in features["passage_embeddings"].items() if k != "directory"}
    if "features" in config:
        out["features"] = features
    return out


def vocabulary_file(directory: str, features: dict[str, Any]) -> str | None:
    """The path of the vocabulary of the model in `directory` (None if it records none): its copy
    there. A version-1 directory records the absolute path it was read from, which is not read: its
    copy at the version-2 place is (the fix `check_vocabulary` names when it is missing).
    A path that leads out of the directory (`../`, or a link) is refused: a model directory
    reads, and `t5r export-hf` ships, no file outside it."""
    recorded = features.get("vocabulary")
    if not recorded:
        return None
    where = f"{os.path.join(directory, CONFIG_FILE)}: field 'features.vocabulary'"
    if not isinstance(recorded, str):
        raise CheckpointError(f"{where} is {json.dumps(recorded)[:60]}, expected a path inside the model directory")
    if os.path.isabs(recorded):
        copies = [os.path.join(directory, VOCABULARY_DIR, name) for name in (SENTENCEPIECE_FILE, WORDPIECE_FILE)]
        return next((copy for copy in copies if os.path.exists(copy)),
                    os.path.join(directory, stored_vocabulary_name(recorded)))
    path = os.path.join(directory, recorded)
    if ".." in os.path.normpath(recorded).split(os.sep) or artefact_io.outside(path, directory):
        raise CheckpointError(f"{where} is {recorded!r}, which leads outside the model directory; a model's "
                              f"vocabulary is its own copy in {os.path.join(directory, VOCABULARY_DIR)}")
    return path


def located_config(directory: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` of the model in `directory` (as stored, its values checked) with its vocabulary named
    by a path that opens from the working directory (what code that reads the vocabulary, or copies
    it on, needs), after `check_vocabulary` found that file the one the model was trained with."""
    check_vocabulary(config.get("features", {}), directory)
    if not (config.get("features") or {}).get("vocabulary"):
        return config
    return {**config, "features": {**config["features"], "vocabulary": vocabulary_file(directory, config["features"])}}


def check_vocabulary(stored: dict[str, Any], checkpoint_dir: str) -> None:
    """Refuses a vocabulary that is missing, or whose content differs from the one the model was
    trained with (its digest, recorded with the features; models trained before it was recorded
    carry none and are not checked). `stored`: the features as recorded."""
    path, recorded = vocabulary_file(checkpoint_dir, stored), stored.get("vocabulary_digest")
    if not path:
        return
    if not os.path.exists(path):
        if os.path.isabs(stored["vocabulary"]):  # an older model directory, recording where it was read from
            place = os.path.join(checkpoint_dir, VOCABULARY_DIR)
            source = stored["vocabulary"]
            copy = (f"copy it in: mkdir -p {place} && cp {source} {path}" if os.path.isfile(source) else
                    f"copy that vocabulary (digest {recorded or 'not recorded'}) to {place}/"
                    f"{SENTENCEPIECE_FILE}, or a WordPiece one to {place}/{WORDPIECE_FILE} "
                    "with its tokenizer_config.json")
            raise CheckpointError(
                f"{checkpoint_dir}: the model's vocabulary {source} (features.vocabulary, recorded by an older "
                f"version) is outside the model directory, which is read from its own copy {path} only, and "
                f"that does not exist; {copy}")
        raise CheckpointError(f"{checkpoint_dir}: the model's vocabulary {path} (features.vocabulary) "
                              "does not exist; copy the whole model directory, vocabulary/ with it")
    current = vocabulary_digest(path)
    if recorded and current != recorded:
        raise CheckpointError(
            f"{checkpoint_dir}: the vocabulary {path} has content digest {current}, but the model was trained "
            f"with digest {recorded}: the file changed since training, and the model's token ids with it")


QUERY_SIDE_FILE = "query_side.json"  # in a query-side model directory: its base model and fingerprint


def write_base_record(model_dir: str, base_dir: str, base_fingerprint: str, **info: Any) -> None:
    """Marks `model_dir` as a query-side model: its passages are encoded by `base_dir`'s model
    (fingerprint `base_fingerprint`), and its indexes are the base's. The base is recorded relative
    to `model_dir`, so the two move together (the fingerprint, not the path, says it is the same).
    Both are taken where they really are (symbolic links resolved), as `base_dir_of` reads it."""
    record = {"base_checkpoint": os.path.relpath(os.path.realpath(base_dir), os.path.realpath(model_dir)),
              "base_fingerprint": base_fingerprint, **info}
    write_json_atomic(os.path.join(model_dir, QUERY_SIDE_FILE), record)


def read_base_record(model_dir: str) -> dict[str, Any]:
    """A query-side model's `query_side.json`: a regular file of the directory, bounded, an object
    whose `base_checkpoint` is a path and `base_fingerprint` a string."""
    path = os.path.join(model_dir, QUERY_SIDE_FILE)
    record = artefact_io.load_json_object(path, model_dir, 1 << 20, CheckpointError)
    for field in ("base_checkpoint", "base_fingerprint"):
        if not isinstance(record.get(field), str) or not record[field]:
            raise CheckpointError(f"{path}: field {field!r} is {json.dumps(record.get(field))[:60]}, "
                                  "expected a non-empty string")
    return record


def base_dir_of(model_dir: str) -> str:
    """A query-side model's base model directory: recorded relative to it (absolute by older versions).

    Relative to where `model_dir` really is: a model reached through a symbolic link (a stage shared
    by two results rows) finds its base as the file system's `..` does, not by cutting path text."""
    return _base_dir(model_dir, read_base_record(model_dir))


def _base_dir(model_dir: str, record: dict[str, Any]) -> str:
    return os.path.normpath(os.path.join(os.path.realpath(model_dir), record["base_checkpoint"]))


def query_side_base(model_dir: str) -> tuple[dict[str, Any], str]:
    """A query-side model's record and its base model directory, refused unless that directory is a
    model directory (the base was not copied or moved along)."""
    record = read_base_record(model_dir)
    base_dir = _base_dir(model_dir, record)
    if not os.path.exists(os.path.join(base_dir, CONFIG_FILE)):
        raise CheckpointError(
            f"{model_dir}/{QUERY_SIDE_FILE}: its base model {base_dir} (base_checkpoint {record['base_checkpoint']!r}, "
            "relative to this directory) is not a t5r model directory; copy or move the base model along with it")
    return record, base_dir


def is_query_side_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, QUERY_SIDE_FILE))


def trained_config_gin(model_dir: str) -> str:
    """The path of the config.gin the model in `model_dir` was trained with (it names the Task
    modules that registered its Tasks): its own, or, for a query-side model that has none
    (`t5r query-side`), its base model's."""
    if is_query_side_dir(model_dir) and not os.path.exists(os.path.join(model_dir, OPERATIVE_CONFIG)):
        model_dir = base_dir_of(model_dir)
    return os.path.join(model_dir, OPERATIVE_CONFIG)


def _copy_vocabulary(source: str, directory: str) -> None:
    """Copies the vocabulary files at `source` into `directory`'s VOCABULARY_DIR (each file whole or
    not at all), unless `source` is that copy already."""
    target = os.path.join(directory, VOCABULARY_DIR)
    os.makedirs(target, exist_ok=True)
    for i, path in enumerate(vocabulary_files(source)):
        name = os.path.basename(stored_vocabulary_name(source)) if i == 0 else os.path.basename(path)
        destination = os.path.join(target, name)
        if os.path.abspath(path) == os.path.abspath(destination):
            continue
        tmp = f"{destination}.tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, destination)


def differing_fields(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields where two configs differ (`features.passage_embeddings.digest`),
    down to the first level where one is not a dict."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if a == b else [prefix]
    return [name for key in sorted(set(a) | set(b), key=str)
            for name in differing_fields(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))]


def write_config(directory: str, config: dict[str, Any],
                 upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Records the model config, its vocabulary copied in (`upgrade_config`); a different model in
    an existing directory is an error naming the fields that differ.

    `upgrade` maps a stored config to what this version would write for the same model (fields
    added since, at their defaults); a stored config that upgrades to `config` is rewritten as it.
    """
    os.makedirs(directory, exist_ok=True)
    source = (config.get("features") or {}).get("vocabulary")
    config = upgrade_config(config)
    path = os.path.join(directory, CONFIG_FILE)
    stored = read_config(directory, verified=False) if os.path.exists(path) else None
    if stored is not None:
        existing = upgrade_config(stored)
        if upgrade is not None and existing != config:
            existing = upgrade(existing)
        if existing != config:
            raise CheckpointError(f"{path}: the model config differs from this run's in "
                                  f"{', '.join(differing_fields(existing, config))}; use a new model_dir or the "
                                  "same config")
    if jax.process_index() == 0:
        if source and os.path.isabs(source):
            _copy_vocabulary(source, directory)
        if stored != config:
            write_json_atomic(path, config, sort_keys=True)


def read_config(directory: str, verified: bool = True) -> dict[str, Any]:
    """The model config as stored (its layout version may be older: `upgrade_config`,
    `located_config`), parsed only after it matched the newest checkpoint's record (`verified`;
    the training run that writes the directory reads its own unverified), and always as a regular
    file of the directory, bounded, of bounded depth. Its values: `families.check_stored_config`."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}; is this a t5r model directory?")
    size = _verified_config_size(directory) if verified else None
    return artefact_io.load_json_object(path, directory, checksums.RECORD_BYTES if size is None else size,
                                        CheckpointError, "restore the model directory from where it was trained")


def _verified_config_size(directory: str) -> int | None:
    """Checks model_config.json against the record of the newest step that has one and returns its
    recorded size; None when no step has a record (restoring then refuses every step)."""
    path = os.path.join(directory, CONFIG_FILE)
    for step in reversed(saved_steps(directory)):
        step_dir = os.path.join(directory, str(step))
        record = os.path.join(step_dir, checksums.CHECKSUMS_FILE)
        if not os.path.lexists(record):
            continue
        accept = f"if you trust it, record its checksums as it is now: t5r checksum --accept {step_dir}"
        try:
            _, listed = _step_record(epath.Path(step_dir), accept)
            if CONFIG_FILE not in listed:
                raise checksums.ChecksumError(f"{path}: not covered by {record} (recorded by an older "
                                              f"t5-retrieval); {accept}")
            checksums.check_file(path, listed[CONFIG_FILE], record,
                                 f"it differs from the one this checkpoint was trained with; {accept}", directory)
        except checksums.ChecksumError as e:
            raise CheckpointError(str(e)) from None
        return int(listed[CONFIG_FILE]["size"])
    return None


def restore_params(directory: str, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
    """Restores only the parameters of the latest (or given) checkpoint, for inference.

    Returns (params, step). The optimiser state is not read, so inference needs no more memory
    than the model itself.
    """
    mngr = reader(directory)
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding) if getattr(x, "sharding", None)
                                else ocp.RestoreArgs(), abstract_params)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True))

    def restore_step(s: int) -> Any:
        return _restore_step(mngr, s, args, "these model parameters")["state"]["params"]

    if step is not None:
        return restore_step(step), step
    # Read-only (a trainer may be writing here): fall back past unreadable ones, move nothing.
    found = _latest_readable(mngr, restore_step, set_aside=False)
    if found is None:
        raise CheckpointError(f"{directory}: no checkpoint found")
    return found
