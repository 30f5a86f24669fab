"""Our serialized ScaNN index (`retrieval.scann_index.ScannIndex.save`, written by ScaNN's pybind API) as a TF resource.

ScaNN's TF op `tensors_to_scann` rebuilds a searcher from the same assets that the pybind
`serialize` writes (config proto, partitioner, tokenization, AH codebook and codes, dataset); an
asset that a searcher kind does not use is passed as an empty scalar. So the exported searcher is
the indexed searcher itself, not a rebuilt one, and returns the same neighbours. The assets are
held in variables (saved in the SavedModel's variables/). The op keeps the searcher it builds in
the session's resource manager under its `shared_name` (unique per export): the first search
builds it from the variables, later searches look it up (measured: 0.46 s first call, 11 ms after,
on 200k x 64). A TrackableResource, built at load time, cannot be used: its creation op would have
to read the variables in the export graph, which TF's SavedModel writer does not support.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import tensorflow as tf

# tensors_to_scann's inputs after the dataset, in order: (file in the pybind dir, dtype).
_ASSETS = (("scann_config.pb", tf.string), ("serialized_partitioner.pb", tf.string),
           ("datapoint_to_token.npy", tf.int32), ("ah_codebook.pb", tf.string),
           ("hashed_dataset.npy", tf.uint8), ("int8_dataset.npy", tf.int8),
           ("int8_multipliers.npy", tf.float32), ("dp_norms.npy", tf.float32))


def _ops():
    from scann.scann_ops.py import scann_ops  # Loads ScaNN's TF custom-op library.
    return scann_ops


def _read(directory: str, name: str, dtype: tf.DType) -> np.ndarray:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return np.array(b"" if dtype == tf.string else 0, dtype=dtype.as_numpy_dtype)
    if name.endswith(".npy"):
        return np.load(path).astype(dtype.as_numpy_dtype, copy=False)
    with open(path, "rb") as f:
        return np.array([f.read()], dtype=object)


class ScannSearcher(tf.Module):
    """The ScaNN searcher serialized in `scann_dir`, searchable from a tf.function."""

    def __init__(self, scann_dir: str):
        super().__init__()
        if not os.path.exists(os.path.join(scann_dir, "scann_config.pb")):
            raise FileNotFoundError(f"{scann_dir}: no scann_config.pb; not a serialized ScaNN searcher")
        self._shared_name = f"t5r_scann_{uuid.uuid4().hex}"
        self._dataset = tf.Variable(_read(scann_dir, "dataset.npy", tf.float32), trainable=False, name="dataset")
        self._assets = [tf.Variable(_read(scann_dir, name, dtype), trainable=False, name=name.split(".")[0])
                        for name, dtype in _ASSETS]

    def search(self, queries: tf.Tensor, k: tf.Tensor, pre_reorder: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(rows int32[n, k], scores float32[n, k]); pre_reorder -1 means the searcher's default."""
        ops = _ops()
        handle = ops.tensors_to_scann(self._dataset, *self._assets, shared_name=self._shared_name)
        rows, scores = ops.scann_search_batched(handle, queries, k, pre_reorder, -1, False)
        return tf.ensure_shape(rows, [None, None]), tf.ensure_shape(scores, [None, None])  # the op has no shape fn
