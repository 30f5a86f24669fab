"""What makes an export a directory that moves: it is copied to another machine or user, served from
a read-only volume, or uploaded, so nothing in it may depend on where or by whom it was written.

- Its directories and files have the user's umask's permissions, as `mkdir` and `open` give them
  (`tempfile.mkdtemp` would leave the directory 0700, safetensors leaves its file 0600: another
  user, a serving account or a container could not read them).
- Its checksum record (`t5r_checksums.json`) travels; the verification stamp (`t5r_verified.json`:
  inodes and modification times of this filesystem) does not, as it means nothing after a copy.
- `model_config.json` names no path of the exporting machine: the vocabulary by the file the export
  ships, any other path by its last component; the SavedModel's manifests (`index.json`) likewise.
"""

from __future__ import annotations

import os
from typing import Any

from t5_retrieval import checksums


def finish(directory: str) -> None:
    """Gives every file of the finished export in `directory` (made with `os.makedirs`) the umask's
    permissions, since some writers restrict theirs (safetensors writes 0600), then records its
    `t5r_checksums.json`, without the machine-local verification stamp."""
    dir_mode = os.stat(directory).st_mode & 0o777  # what mkdir gave it under the umask
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), dir_mode & 0o666)
    checksums.record(directory)
    os.remove(os.path.join(directory, checksums.STAMP_FILE))


def without_paths(value: Any) -> Any:
    """`value` (JSON) with every absolute path cut to its last component (a directory's name)."""
    if isinstance(value, dict):
        return {k: without_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.basename(value.rstrip(os.sep))
    return value


def portable_config(config: dict[str, Any], vocabulary: str) -> dict[str, Any]:
    """`config` (a model_config.json) with `features.vocabulary` set to `vocabulary` (the shipped
    copy, relative to the export) and every other absolute path cut to its last component."""
    out = without_paths(config)
    out["features"] = {**out["features"], "vocabulary": vocabulary}
    return out
