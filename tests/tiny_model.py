"""A tiny T5 dual-encoder model directory, its KB embeddings and a brute-force ScaNN index, in seconds.

Shared by the export tests and `benchmarks/bench_export.py`. The model directory is what `t5r train`
writes (the config with vocabulary, task prefixes and lengths from the real demo data pipeline, and
an orbax checkpoint), but holds freshly initialised weights: compiling a training step costs minutes
on a loaded CPU, and what is exported and compared does not depend on the weights being trained.
Different seeds give models with different fingerprints.
"""

from __future__ import annotations

import dataclasses
import os

import gin

from t5_retrieval import gin_utils

TASKS = ("fever", "trex")


@dataclasses.dataclass(frozen=True)
class TinyRun:
    data_dir: str
    vocabulary: str
    model_dirs: tuple[str, ...]
    index_dirs: tuple[str, ...]
    encoders: tuple  # load_encoder(model_dir) of each model: the Python search path


def _bindings(data_dir: str, vocabulary: str, bert: bool = False) -> list[str]:
    size = ["VOCAB_SIZE = 30522", "NUM_LAYERS = 1"] if bert else ["VOCAB_SIZE = 512", "D_MODEL = 32", "D_FF = 64",
                                                                  "NUM_LAYERS = 1"]
    return [f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'", f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}' for t in TASKS]}",
            *size, "NUM_NEGATIVES = 1", "QUERY_LEN = 16", "PASSAGE_LEN = 32", "TRAIN_STEPS = 1"]


def write_model_dir(model_dir: str, data_dir: str, vocabulary: str, seed: int, extra_bindings: tuple[str, ...] = (),
                    bert: bool = False) -> None:
    """A t5r model directory (config + step-0 checkpoint of initialised params) for the demo tasks: a
    tiny T5, or with `bert` a one-layer models/bert_tiny.gin (`vocabulary`: a WordPiece one)."""
    import jax

    from t5_retrieval import checkpoint, sharding, train  # noqa: F401 (train: runs/base.gin binds its configurables)
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.models.build import build_model, init_params, model_config

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/bert_tiny.gin" if bert else "models/t5_tiny.gin", "runs/base.gin"],
                            [*_bindings(data_dir, vocabulary, bert), *extra_bindings])
        config = {**model_config(), "features": make_train_iterator(per_device_batch=2).features}
    finally:
        gin.clear_config()
    checkpoint.write_config(model_dir, config)
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(seed), sharding.make_mesh(), sharding.logical_axis_rules())
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": params}, {})


def build_tiny_run(root: str, models: tuple[tuple[int, tuple[str, ...]], ...] = ((0, ()),), num_pages: int = 40,
                   bert: bool = False) -> TinyRun:
    """Demo data -> sentencepiece vocab -> per (seed, extra gin bindings): a model dir, KB embeddings
    and a brute-force index. With `bert`, tiny BERTs with all-MiniLM-L6-v2's WordPiece vocabulary."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import write_demo
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval import scann_index
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    raw, data_dir = os.path.join(root, "raw"), os.path.join(root, "data")
    write_demo(raw, num_pages=num_pages, train_per_task=8, dev_per_task=4)
    prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data_dir)
    prepare_tasks(raw, data_dir, list(TASKS))
    prepare_negatives(data_dir, list(TASKS), index=build_bm25_index_for_kb(layout.kb_dir(data_dir)))
    if bert:
        from t5_retrieval.models.pretrained import minilm_l6_dir

        vocabulary = os.path.join(minilm_l6_dir(), "vocab.txt")
    else:
        vocabulary = train_vocabulary(layout.kb_dir(data_dir), os.path.join(data_dir, "spm"), vocab_size=400)
    store = PassageStore.open(layout.kb_dir(data_dir))
    model_dirs, index_dirs, encoders = [], [], []
    for seed, extra_bindings in models:
        model_dir, emb_dir, index_dir = (os.path.join(root, f"{name}_{seed}") for name in ("model", "emb", "index"))
        write_model_dir(model_dir, data_dir, vocabulary, seed, extra_bindings, bert)
        encoder = load_encoder(model_dir)
        embedding_store.write_embeddings(encoder, store, store.ids(), emb_dir, meta={"model_dir": model_dir},
                                    progress=False)
        scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode="brute_force")).save(index_dir)
        model_dirs.append(model_dir)
        index_dirs.append(index_dir)
        encoders.append(encoder)
    return TinyRun(data_dir, vocabulary, tuple(model_dirs), tuple(index_dirs), tuple(encoders))
