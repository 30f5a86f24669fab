"""Query-side fine-tuning: adapt the query encoder to new questions over a frozen passage index.

Sciavolino et al. 2021 ("Simple Entity-Centric Questions Challenge Dense Retrievers"; Sciavolino's
thesis "Towards Universal Dense Retrieval for ODQA"): with a robust passage encoder, a new question
distribution is best served by fine-tuning only the question encoder while the passage encoder,
and so the index, stay fixed. Here, per question:

    C   = top-k passages of the frozen index for the current query encoder      (refreshed per round)
    P   = {c in C : c contains an answer}                                         (questions with P empty skip the round)
    L   = logsumexp_{c in C} q(theta) . e_c  -  logsumexp_{c in P} q(theta) . e_c

with e_c the *stored* passage embeddings, so no gradient ever reaches the passage side (the
stop-gradient loss). Only the model's query path is trained (for ST5 the shared T5, for a
two-tower model its query tower); passages keep the base checkpoint's encoder, which is why the
result is written as a model directory that points at its base: `inference.QuerySideEncoder` encodes queries
with the fine-tuned weights and passages with the base, and carries the base's fingerprint, since
its embedding space is the index's.

    t5r query-side --checkpoint_dir=run/model --index_dir=run/index --embeddings_dir=run/emb \
        --kb_dir=data/kb --qa_dir=/path/to/mini_kilt/qa_open --task=nq_open --as_task=mini_kilt_hotpotqa \
        --output_dir=run/query_side_nq

`--task` takes a comma-separated list (`nq_open,triviaqa_open,webq,curatedtrec`) to adapt to the
union of several question sets; each keeps its own answer matching and gets its own dev recall.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from t5_retrieval import checkpoint
from t5_retrieval.checkpoint import write_base_record
from t5_retrieval.data.kilt.answers import AnswerTexts, recall_at_ks
from t5_retrieval.data.kilt.qa_open import QATask, read_qa_task
from t5_retrieval.data.records import DataError, write_json_atomic
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tokenizers.query_inputs import query_tokens
from t5_retrieval.errors import ConfigError
from t5_retrieval.inference import DualEncoderInference, bucketed_width, load_dual_encoder, token_lengths
from t5_retrieval.retrieval.index import Index, IndexMismatchError, load_index

log = logging.getLogger(__name__)
REPORT_FILE = "query_side_report.json"  # dev answer recall before / after, per task, and the rounds


@gin.configurable
@dataclasses.dataclass(frozen=True)
class QuerySideConfig:
    """top_k: candidates per question (the softmax runs over them); rounds: candidate refreshes,
    each followed by `epochs_per_round` passes over the questions that have a positive."""

    top_k: int = 100
    batch_size: int = 16
    learning_rate: float = 1e-5
    rounds: int = 1
    epochs_per_round: int = 1
    seed: int = 0


def query_side_loss(queries: jax.Array, candidates: jax.Array, positive: jax.Array) -> jax.Array:
    """Mean over questions of -log P(positive set | candidates); [b, d], [b, k, d], bool [b, k] -> [].

    Every row must have at least one positive (rows without one are never batched).
    """
    scores = jnp.einsum("bd,bkd->bk", queries.astype(jnp.float32), jax.lax.stop_gradient(candidates))
    positive_scores = jnp.where(positive, scores, -jnp.inf)
    return jnp.mean(jax.nn.logsumexp(scores, axis=1) - jax.nn.logsumexp(positive_scores, axis=1))


@dataclasses.dataclass
class Candidates:
    """One round's training set: token ids, candidate rows of the index and which hold an answer."""

    tokens: np.ndarray  # int32 [n, the query length of as_task]
    rows: np.ndarray  # int64 [n, k]
    positive: np.ndarray  # bool [n, k]
    skipped: int  # questions with no answer-holding passage among their candidates

    @classmethod
    def union(cls, parts: Sequence[Candidates]) -> Candidates:
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.rows for p in parts]),
                   np.concatenate([p.positive for p in parts]), sum(p.skipped for p in parts))


def retrieve_candidates(encoder: Any, index: Index, answer_texts: AnswerTexts, task: QATask, as_task: str,
                        top_k: int) -> Candidates:
    """The current query encoder's top-k per question, labelled by answer match; positiveless rows dropped."""
    texts = [e.query for e in task.examples]
    vectors = encoder.encode_queries(texts, as_task)
    rows, _ = index.search(vectors, top_k)
    keep, all_rows, labels = [], [], []
    for i, (example, row) in enumerate(zip(task.examples, rows)):
        if len(row) < top_k:
            raise ConfigError(f"QuerySideConfig.top_k={top_k}: the index has only {len(index)} passages")
        matcher = task.matcher(example)
        hit = np.array([answer_texts.holds_answer(matcher, index.passage_ids[r]) for r in row])
        if hit.any():
            keep.append(i)
            all_rows.append(row)
            labels.append(hit)
    tokens = query_tokens(encoder.vocabulary, [texts[i] for i in keep], encoder.query_input(as_task))
    return Candidates(tokens, np.asarray(all_rows, np.int64).reshape(-1, top_k),
                      np.asarray(labels, bool).reshape(-1, top_k), len(texts) - len(keep))


def make_step(model: Any, optimizer: optax.GradientTransformation):
    """(params, opt_state, tokens, candidate embeddings, positive) -> (params, opt_state, loss), jitted."""

    def loss_fn(params: Any, tokens: jax.Array, candidates: jax.Array, positive: jax.Array) -> jax.Array:
        return query_side_loss(model.apply({"params": params}, tokens), candidates, positive)

    @jax.jit
    def step(params, opt_state, tokens, candidates, positive):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, candidates, positive)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def finetune(encoder: Any, index: Index, passage_matrix: np.ndarray, answer_texts: AnswerTexts,
             tasks: Sequence[QATask], as_task: str, config: QuerySideConfig,
             progress: bool = True) -> tuple[Any, list[dict[str, Any]]]:
    """Fine-tunes `encoder`'s query path (a `DualEncoderInference`, updated in place between rounds)
    on the union of `tasks`' questions, all queried with `as_task`'s prefix.

    Returns (final params, per-round statistics: questions used and skipped, first and last batch
    loss, and the mean loss of each pass over the questions, which says whether training helps).
    """
    if encoder.model.config.query_towers:
        raise ConfigError("query-side fine-tuning of a model with per-task query towers is not supported: "
                          "the new task would need a tower of its own")
    if passage_matrix.shape != (len(index), index.dim):
        raise IndexMismatchError(f"passage embeddings have shape {passage_matrix.shape}, the index "
                                 f"[{len(index)}, {index.dim}]")
    optimizer = optax.adamw(config.learning_rate, weight_decay=0.0)
    params = encoder.params
    opt_state = optimizer.init(params)
    step = make_step(encoder.model, optimizer)
    rng = np.random.default_rng(config.seed)
    history: list[dict[str, Any]] = []
    for round_index in range(config.rounds):
        encoder.params = params
        data = Candidates.union([retrieve_candidates(encoder, index, answer_texts, task, as_task, config.top_k)
                                 for task in tasks])
        batches, lengths = len(data.rows) // config.batch_size, token_lengths(data.tokens)
        if batches == 0:
            raise DataError(f"{','.join(t.name for t in tasks)}: only {len(data.rows)} questions have an answer "
                            f"in their top-{config.top_k} (batch_size {config.batch_size}); nothing to train on")
        losses: list[list[float]] = []
        bar = tqdm(total=batches * config.epochs_per_round, desc=f"query-side round {round_index + 1}",
                   disable=not progress, mininterval=5.0)
        for _ in range(config.epochs_per_round):
            losses.append([])
            order = rng.permutation(len(data.rows))
            for b in range(batches):
                chosen = order[b * config.batch_size:(b + 1) * config.batch_size]
                # Questions are far shorter than query_len: cut each batch's padding (a few shapes compile).
                width = bucketed_width(lengths[chosen], data.tokens.shape[1])
                params, opt_state, loss = step(params, opt_state, data.tokens[chosen, :width],
                                               passage_matrix[data.rows[chosen]], data.positive[chosen])
                losses[-1].append(float(loss))
                bar.update(1)
        bar.close()
        history.append({"round": round_index + 1, "questions": len(data.rows), "skipped": data.skipped,
                        "first_loss": losses[0][0], "last_loss": losses[-1][-1],
                        "epoch_mean_loss": [float(np.mean(epoch)) for epoch in losses]})
        log.info("query-side round %d: %s", round_index + 1, history[-1])
    encoder.params = params
    return params, history


def save(output_dir: str, encoder: DualEncoderInference, params: Any, base_dir: str, as_task: str,
         new_tasks: Sequence[str], history: list[dict[str, Any]]) -> None:
    """A model directory: the base's config, each new task recorded as `as_task`'s spec under its own
    name and dataset (its prefix, query length and truncation) at `as_task`'s step position (its
    query tower); the params, and its base."""
    config = json.loads(json.dumps(encoder.config))
    records = config["features"]["tasks"]
    spec = encoder.tasks.spec(as_task)
    index = encoder.tasks.position(spec.name)
    position = {} if index is None else {"index": index}
    for task in new_tasks:
        records.setdefault(task, {**dataclasses.replace(spec, name=task, dataset=task).to_record(), **position})
    checkpoint.write_config(output_dir, config)
    checkpoint.save(checkpoint.manager(output_dir), 0, {"params": params}, {})
    write_base_record(output_dir, base_dir, encoder.fingerprint, as_task=as_task, tasks=list(new_tasks),
                      history=history)


def answer_recall(encoder: Any, index: Index, answer_texts: AnswerTexts, task: QATask, query_task: str,
                  ks: Sequence[int] = (5, 20, 100)) -> dict[str, float]:
    """Answer-in-passage recall@k (the thesis' R@5 / R@20): a question counts when a top-k passage matches."""
    vectors = encoder.encode_queries([e.query for e in task.examples], query_task)
    rows, _ = index.search(vectors, max(ks))
    return ranking_answer_recall(answer_texts, task, [[index.passage_ids[r] for r in row] for row in rows], ks)


def ranking_answer_recall(answer_texts: AnswerTexts, task: QATask, rankings: Sequence[Sequence[str]],
                          ks: Sequence[int] = (5, 20, 100)) -> dict[str, float]:
    """Answer-in-passage recall@k of given rankings (passage ids, best first; one per question),
    so that any retriever (BM25 too) is scored by the same matching."""
    per_question = [recall_at_ks(answer_texts.first_answer_rank(task.matcher(example), ranking[:max(ks)]), ks)
                    for example, ranking in zip(task.examples, rankings, strict=True)]
    return {"n": len(task.examples), **{key: sum(q[key] for q in per_question) / len(task.examples)
                                        for key in per_question[0]}}


def fine_tune_query_side(checkpoint_dir: str, index_dir: str, embeddings_dir: str, kb_dir: str, qa_dir: str,
                         tasks: Sequence[str], as_task: str, output_dir: str) -> dict[str, Any]:
    """Adapts `checkpoint_dir`'s query encoder to the answer-only QA `tasks` of `qa_dir` (their questions
    take `as_task`'s query prefix) over its frozen index, and writes the result as a model directory
    `output_dir` with `REPORT_FILE` (dev answer recall before and after, per task, and the rounds).

    Everything is opened and checked against everything else before training (DataError,
    IndexMismatchError, CheckpointError, UnknownTaskError). Returns the report.
    """
    if not tasks:
        raise ConfigError("no QA task to adapt to: name one or more, e.g. nq_open or nq_open,webq")
    store = PassageStore.open(kb_dir)
    train_tasks = [read_qa_task(qa_dir, t, "train") for t in tasks]
    dev_tasks = [read_qa_task(qa_dir, t, "dev") for t in tasks]
    index = load_index(index_dir)
    encoder = load_dual_encoder(checkpoint_dir)
    index.check(encoder, store.ids())
    if embedding_store.read_ids(embeddings_dir) != index.passage_ids:
        raise IndexMismatchError(f"{embeddings_dir}: passage ids differ from the index at {index_dir}")
    as_task = encoder.tasks.resolve(as_task)  # by registered name or dataset; recorded by name
    texts = AnswerTexts(store)
    before = {t.name: answer_recall(encoder, index, texts, t, as_task) for t in dev_tasks}
    params, history = finetune(encoder, index, embedding_store.load_matrix(embeddings_dir), texts, train_tasks,
                               as_task, QuerySideConfig())
    after = {t.name: answer_recall(encoder, index, texts, t, as_task) for t in dev_tasks}
    save(output_dir, encoder, params, checkpoint_dir, as_task, list(tasks), history)
    report = {"tasks": list(tasks), "dev_before": before, "dev_after": after, "history": history}
    write_json_atomic(os.path.join(output_dir, REPORT_FILE), report)
    return report
