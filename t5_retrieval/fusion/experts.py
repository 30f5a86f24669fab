"""Expert retrievers for fusion: (task, checkpoint, index) triples, their searches and their data.

An expert is any retrieval `Encoder` with its own `Index`, checked against each other and the KB
exactly as `t5r eval` checks them, and searched as `t5r eval` searches (`search.dense_searcher`).
Nothing here trains an expert: the ensemble (`muf`) only reads its frozen query embeddings and the
frozen embeddings of the passages it retrieved.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.data.records import DataError, Example
from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.data.tasks.task_names import UnknownTaskError
from t5_retrieval.errors import ConfigError
from t5_retrieval.fusion import muf
from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.encoder import Encoder, HashedBagOfWordsEncoder
from t5_retrieval.retrieval.index import Index, load_index
from t5_retrieval.retrieval.search import PassageSearcher, Ranked, dense_searcher

LEXICAL = "lexical:"  # checkpoint spec for the hashed bag-of-words baseline: "lexical:<dim>"

log = logging.getLogger(__name__)

Hits = list[Ranked]  # per query: passage ids and scores, best first


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """Where an expert lives: its task, a checkpoint dir (or "lexical:<dim>") and its index dir."""

    task: str
    checkpoint: str
    index_dir: str

    @classmethod
    def parse(cls, text: str | Sequence[str]) -> ExpertSpec:
        """From "task,checkpoint,index_dir" (CLI) or a 3-tuple (gin)."""
        parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text)]
        if len(parts) != 3 or not all(parts):
            raise ConfigError(f"expert {text!r}: expected TASK,CHECKPOINT_DIR,INDEX_DIR "
                              f"(CHECKPOINT_DIR may be {LEXICAL}<dim>)")
        return cls(*parts)


@dataclasses.dataclass
class Expert:
    spec: ExpertSpec
    encoder: Encoder
    index: Index
    query_task: str = ""  # the task name the encoder formats queries with (default: spec.task)

    @property
    def task(self) -> str:
        return self.spec.task

    def searcher(self, batch_size: int = 128) -> PassageSearcher:
        """The expert's encoder (with its own task prefix) over its index."""
        return dense_searcher(self.encoder, self.index, self.query_task or self.task, batch_size)

    def search(self, queries: Sequence[str], k: int, *, batch_size: int = 128) -> tuple[np.ndarray, Hits]:
        """Query embeddings [n, d] (the ensemble reads them) and top-k hits per query."""
        vectors, hits = [], []
        for batch, ranked in self.searcher(batch_size).search_batches(queries, k):
            vectors.append(batch)
            hits += ranked
        dim = self.encoder.dim
        return (np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32)), hits


def load_expert(spec: ExpertSpec, passage_ids: Sequence[str] | None = None) -> Expert:
    """Loads the encoder and index of `spec` and refuses an index built by another model or KB."""
    if spec.checkpoint.startswith(LEXICAL):
        try:
            dim = int(spec.checkpoint[len(LEXICAL):])
        except ValueError:
            raise ConfigError(f"expert {spec.task}: checkpoint {spec.checkpoint!r}: "
                              f"expected {LEXICAL}<int dim>") from None
        encoder: Encoder = HashedBagOfWordsEncoder(dim)
    else:
        encoder = load_encoder(spec.checkpoint)
    index = load_index(spec.index_dir)
    index.check(encoder, passage_ids)  # IndexMismatchError names the index dir and both fingerprints.
    try:
        query_task = encoder.tasks.resolve(spec.task)
    except UnknownTaskError as e:
        raise ConfigError(f"expert {spec.task}: {spec.checkpoint}: {e}") from None
    return Expert(spec, encoder, index, query_task)


class PassageVectors:
    """Frozen passage embeddings of one expert, encoded on first use and cached by id."""

    def __init__(self, encoder: Encoder, passages: PassageLookup, batch_size: int = 256):
        self.encoder = encoder
        self.dim = encoder.dim
        self.passages = passages
        self.batch_size = batch_size
        self._cache: dict[str, np.ndarray] = {}

    def get(self, ids: Sequence[str]) -> np.ndarray:
        missing = list(dict.fromkeys(i for i in ids if i not in self._cache))
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start:start + self.batch_size]
            vectors = np.asarray(self.encoder.encode_passages([self.passages.get(i) for i in chunk]), np.float32)
            self._cache.update(zip(chunk, vectors))
        if not ids:
            return np.zeros((0, self.encoder.dim), np.float32)
        return np.stack([self._cache[i] for i in ids])


class StoredPassageVectors:
    """An expert's passage embeddings read from the embeddings its index was built from."""

    def __init__(self, matrix: np.ndarray, passage_ids: Sequence[str]):
        self.matrix = matrix
        self.dim = matrix.shape[1]
        self._row = {pid: r for r, pid in enumerate(passage_ids)}

    def get(self, ids: Sequence[str]) -> np.ndarray:
        return self.matrix[[self._row[i] for i in ids]] if ids else np.zeros((0, self.dim), np.float32)


Vectors = PassageVectors | StoredPassageVectors


def passage_vectors(expert: Expert, passages: PassageLookup) -> Vectors:
    """The stored embeddings behind the expert's index when they are still there (and are the
    index's: same fingerprint and ids), else the expert's encoder on demand."""
    from t5_retrieval.data.stores import embedding_store

    directory = expert.index.embeddings_dir
    if directory and os.path.exists(os.path.join(directory, embedding_store.MANIFEST)):
        manifest = embedding_store.read_manifest(directory)
        ids = embedding_store.read_ids(directory)
        if manifest.fingerprint == expert.index.fingerprint and ids == expert.index.passage_ids:
            log.info("expert %s: passage vectors from %s", expert.task, directory)
            return StoredPassageVectors(embedding_store.load_matrix(directory), ids)
    return PassageVectors(expert.encoder, passages)


def candidate_arrays(candidate_ids: Sequence[Sequence[str]], vectors: Vectors, top_l: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded candidate embeddings [n, L, d] and their validity mask [n, L] from ranked id lists."""
    n = len(candidate_ids)
    out = np.zeros((n, top_l, vectors.dim), np.float32)
    valid = np.zeros((n, top_l), bool)
    for i, ids in enumerate(candidate_ids):
        ids = list(ids)[:top_l]
        if ids:
            out[i, :len(ids)] = vectors.get(ids)
            valid[i, :len(ids)] = True
    return out, valid


def _is_gold(example: Example, passages: PassageLookup, pid: str) -> bool:
    if example.positive_passages:
        return pid in example.positive_passages
    return passages.page_of(pid) in {p for s in example.gold_pages for p in s}


def training_set(expert: Expert, examples: Sequence[Example], passages: PassageLookup, vectors: Vectors,
                 top_l: int, batch_size: int = 128) -> muf.TrainingSet:
    """The expert's top-L for its own task's train queries, labelled gold (see `muf` docstring)."""
    query_vectors, hits = expert.search([e.query for e in examples], top_l, batch_size=batch_size)
    keep, lists, golds = [], [], []
    for i, (example, (ids, _)) in enumerate(zip(examples, hits)):
        ids = list(ids[:top_l])
        gold = [_is_gold(example, passages, pid) for pid in ids]
        if not any(gold):
            if not example.positive_passages:
                continue  # nothing to learn from: no positive passage to put among the candidates
            slot = min(len(ids), top_l - 1)  # replace the last candidate, or fill the first free slot
            ids = ids[:slot] + [example.positive_passages[0]]
            gold = [False] * slot + [True]
        keep.append(i)
        lists.append(ids)
        golds.append(gold + [False] * (top_l - len(gold)))
    candidates, valid = candidate_arrays(lists, vectors, top_l)
    return muf.TrainingSet(query_vectors[keep] if keep else np.zeros((0, expert.encoder.dim), np.float32),
                           candidates, valid, np.asarray(golds, bool).reshape(len(keep), top_l))


def top1_on_gold_page(examples: Sequence[Example], hits: Hits, passages: PassageLookup) -> np.ndarray:
    """Whether each query's first hit lies on one of its gold pages: the outcome confidence predicts."""
    out = np.zeros(len(examples), bool)
    for i, (example, (ids, _)) in enumerate(zip(examples, hits)):
        out[i] = bool(ids) and passages.page_of(ids[0]) in {p for s in example.gold_pages for p in s}
    return out


def train_and_calibrate(expert: Expert, train_examples: Sequence[Example],
                        calibration_examples: Mapping[str, Sequence[Example]], passages: PassageLookup,
                        config: muf.EnsembleConfig, batch_size: int = 128,
                        vectors: Vectors | None = None) -> muf.Ensemble:
    """Trains the expert's ensemble on its task's train queries; calibrates T on all tasks' dev queries."""
    vectors = vectors or passage_vectors(expert, passages)
    data = training_set(expert, train_examples, passages, vectors, config.top_l, batch_size)
    if not len(data.queries):
        raise DataError(f"expert {expert.task}: none of its {len(train_examples)} train queries has a gold "
                        f"passage among its top-{config.top_l} or a positive passage to add")
    ensemble = muf.train_ensemble(data, config, expert.encoder.fingerprint)
    log.info("expert %s: ensemble of %d trained on %d of %d train queries; loss per epoch %s", expert.task,
             config.num_members, len(data.queries), len(train_examples),
             " ".join(f"{x:.3f}" for x in ensemble.info["loss_per_epoch"]))
    examples = [e for task_examples in calibration_examples.values() for e in task_examples]
    if config.calibrate and examples:
        query_vectors, hits = expert.search([e.query for e in examples], config.top_l, batch_size=batch_size)
        candidates, valid = candidate_arrays([ids for ids, _ in hits], vectors, config.top_l)
        scores = ensemble.member_scores(query_vectors, candidates)
        correct = top1_on_gold_page(examples, hits, passages)
        calibration = muf.calibrate_temperature(scores, valid, correct, config.temperature_grid(),
                                                config.temperature, config.num_bins)
        ensemble.temperature = calibration.temperature
        ensemble.info["calibration"] = calibration.to_json()
        ensemble.info["calibration_queries"] = len(examples)
        ensemble.info["calibration_accuracy"] = float(correct.mean())
        log.info("expert %s: temperature %.3g (ECE %.4f; %.3g at the start %.3g) on %d queries, top-1 accuracy %.3f",
                 expert.task, calibration.temperature, calibration.ece, calibration.start_ece,
                 calibration.start_temperature, len(examples), correct.mean())
    return ensemble
