"""Fused rankings: DPR-MUF (confidence-weighted experts), the uniform sum, and the BM25 + dense hybrid.

Both rules score the union of the lists; a passage missing from a list gets that list's minimum
score (DPR-MUF; also the usual dense + sparse hybrid rule, Ma et al. 2021):

* **DPR-MUF**: fused(p) = sum_x c_x(q) * s_x(q, p), with c_x the per-query confidence of expert x
  (`muf`: 1 - MI / log E of its MLP ensemble) and s_x its raw retrieval score.
* **uniform**: the same sum with every c_x = 1 (what the confidence adds is the difference).
* **hybrid**: (1 - w) * dense(p) + w * bm25(p) over the union of the fused dense list and the BM25
  list, w = `FuseConfig.hybrid_weight` (DPR's bm25 + lambda * dense with lambda = 1.1 is w = 1 / 2.1
  up to scale). BM25 is one more searcher (`search.bm25_searcher`), searched as the experts are.
* **own_expert**: for a task that has an expert, that expert alone (the single-task reference).

Each ranking is cut to `depth` passages and scored with the same page mapping and KILT metrics as
`t5r eval` (`evaluate.RankingScorer`).

`fuse_experts` (`t5r fuse --data_dir=... --output_dir=... --expert=TASK,CHECKPOINT_DIR,INDEX_DIR
[--expert=...]`; CHECKPOINT_DIR may be `lexical:<dim>`; experts can also come from gin, `FuseConfig.experts`)
writes `<output_dir>/<method>/{results.json,results.txt,predictions/}`, `<output_dir>/ensembles/<task>/`
and `<output_dir>/confidence.json` (mean confidence of each expert on each task's queries).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import gin
import numpy as np

from t5_retrieval.data.records import Example
from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.errors import ConfigError
from t5_retrieval.fusion import experts as experts_lib
from t5_retrieval.fusion import muf
from t5_retrieval.retrieval.evaluate import EvalResult, RankingScorer
from t5_retrieval.retrieval.search import PassageSearcher, Ranked, bm25_searcher

# One ranked list: passage ids best first and their scores (a `search.Ranked`, or plain sequences).
Scored = tuple[Sequence[str], Sequence[float] | np.ndarray]


def fuse_lists(lists: Sequence[Scored], weights: Sequence[float]) -> Ranked:
    """sum_i w_i * s_i(p) over the union of the lists, s_i(p) = min(list i) when p is not in list i.

    Ties keep the order of first appearance (list by list, best first). An empty list adds nothing.
    """
    if len(lists) != len(weights):
        raise ValueError(f"{len(lists)} lists but {len(weights)} weights")
    position: dict[str, int] = {}
    for ids, _ in lists:
        for pid in ids:
            position.setdefault(pid, len(position))
    total = np.zeros(len(position), np.float64)
    for (ids, given), weight in zip(lists, weights):
        scores = np.asarray(given, np.float64)
        if len(ids) != len(scores):
            raise ValueError(f"a list has {len(ids)} ids but {len(scores)} scores")
        if not len(ids):
            continue
        column = np.full(len(position), scores.min())
        column[[position[pid] for pid in ids]] = scores
        total += weight * column
    order = np.lexsort((np.arange(len(position)), -total))
    ids = list(position)
    return Ranked([ids[i] for i in order], total[order])


def hybrid(dense: Scored, sparse: Scored,
           weight: float) -> Ranked:
    """(1 - weight) * dense + weight * sparse over the union, missing scores = the list's minimum."""
    if not 0.0 <= weight <= 1.0:
        raise ConfigError(f"FuseConfig.hybrid_weight must be in [0, 1], got {weight}")
    return fuse_lists([dense, sparse], [1.0 - weight, weight])


@gin.configurable
@dataclasses.dataclass(frozen=True)
class FuseConfig:
    """What to fuse and how to score it.

    experts: (task, checkpoint dir or "lexical:<dim>", index dir) triples (the CLI's --expert wins).
    depth: passages per expert list, per BM25 list and per fused ranking (as `evaluate.depth`).
    hybrid_weight: BM25 weight w of the hybrid; None skips the hybrid (and building BM25).
    """

    experts: tuple[tuple[str, str, str], ...] = ()
    depth: int = 100
    ks: tuple[int, ...] = (1, 5, 20, 100)
    hybrid_weight: float | None = None
    batch_size: int = 128
    skip_answer_recall: tuple[str, ...] = ("fever", "wow")


@dataclasses.dataclass
class FusionResult:
    results: dict[str, EvalResult]  # method -> per-task tables and KILT predictions
    ensembles: dict[str, muf.Ensemble]  # expert task -> its trained, calibrated ensemble
    confidence: dict[str, dict[str, float]]  # expert task -> eval task -> mean confidence


def fuse_and_evaluate(experts: Sequence[experts_lib.Expert], train_examples: Mapping[str, Sequence[Example]],
                      eval_examples: Mapping[str, Sequence[Example]], passages: PassageLookup,
                      ensemble_config: muf.EnsembleConfig, config: FuseConfig,
                      calibration_examples: Mapping[str, Sequence[Example]] | None = None,
                      hybrid_with: PassageSearcher | None = None) -> FusionResult:
    """Trains and calibrates every expert's ensemble, then fuses and scores every eval task.

    `hybrid_with`, the searcher the fused ranking is interpolated with (BM25, `search.bm25_searcher`,
    in the paper), is needed only when `config.hybrid_weight` is set.
    """
    if config.hybrid_weight is not None and hybrid_with is None:
        raise ValueError("FuseConfig.hybrid_weight is set but no searcher to interpolate with was given")
    if config.depth < 1:
        raise ConfigError(f"FuseConfig.depth must be >= 1, got {config.depth}")

    vectors = {x.task: experts_lib.passage_vectors(x, passages) for x in experts}
    ensembles = {}
    for x in experts:
        if x.task not in train_examples:
            raise ConfigError(f"expert {x.task}: no train examples for task {x.task!r}")
        ensembles[x.task] = experts_lib.train_and_calibrate(
            x, train_examples[x.task], calibration_examples if calibration_examples is not None else eval_examples,
            passages, ensemble_config, config.batch_size, vectors[x.task])
    methods = ["muf", "uniform", "own_expert"] + (["hybrid"] if config.hybrid_weight is not None else [])
    scorers = {m: RankingScorer(passages, config.ks, config.skip_answer_recall) for m in methods}
    confidence: dict[str, dict[str, float]] = {x.task: {} for x in experts}
    for task, examples in eval_examples.items():
        queries = [e.query for e in examples]
        lists, weights = [], []
        for x in experts:
            hits, conf = _search_with_confidence(x, ensembles[x.task], vectors[x.task], queries, config.depth,
                                                 ensemble_config.top_l, config.batch_size)
            confidence[x.task][task] = float(conf.mean()) if len(conf) else float("nan")
            lists.append(hits)
            weights.append(conf)
        second = hybrid_with.search(queries, config.depth) if hybrid_with is not None else []
        rankings: dict[str, list[list[str]]] = {m: [] for m in methods}
        for i in range(len(examples)):
            per_query = [expert_lists[i] for expert_lists in lists]
            fused = fuse_lists(per_query, [float(w[i]) for w in weights])
            rankings["muf"].append(fused[0][:config.depth])
            rankings["uniform"].append(fuse_lists(per_query, [1.0] * len(per_query))[0][:config.depth])
            if config.hybrid_weight is not None:
                dense = (fused[0][:config.depth], fused[1][:config.depth])
                rankings["hybrid"].append(hybrid(dense, second[i], config.hybrid_weight)[0][:config.depth])
        own = [j for j, x in enumerate(experts) if x.task == task]
        if own:  # a task without an expert has no own-expert row
            rankings["own_expert"] = [ids for ids, _ in lists[own[0]]]
        for method in methods:
            if method != "own_expert" or own:
                scorers[method].add_task(task, examples, rankings[method])
    return FusionResult({m: s.result() for m, s in scorers.items()}, ensembles, confidence)


def _search_with_confidence(expert: experts_lib.Expert, ensemble: muf.Ensemble,
                            vectors: experts_lib.Vectors, queries: Sequence[str], depth: int, top_l: int,
                            batch_size: int) -> tuple[list[Ranked], np.ndarray]:
    """The expert's top-`depth` (ids, scores) per query and its confidence per query (from its top-L)."""
    query_vectors, hits = expert.search(queries, max(depth, top_l), batch_size=batch_size)
    candidates, valid = experts_lib.candidate_arrays([ids for ids, _ in hits], vectors, top_l)
    conf = ensemble.confidence(query_vectors, candidates, valid)
    return [Ranked(ids[:depth], scores[:depth]) for ids, scores in hits], conf


def write_fusion(result: FusionResult, output_dir: str) -> None:
    """Per method: results.json/.txt and KILT predictions (as `t5r eval`); ensembles; confidences."""
    from t5_retrieval.retrieval.evaluate import write_results

    for method, evaluation in result.results.items():
        write_results(evaluation, os.path.join(output_dir, method))
    for task, ensemble in result.ensembles.items():
        ensemble.save(os.path.join(output_dir, "ensembles", task))
    with open(os.path.join(output_dir, "confidence.json"), "w", encoding="utf-8") as f:
        json.dump(result.confidence, f, indent=1)


def _expert_specs(given: Sequence[str], config: FuseConfig) -> list[experts_lib.ExpertSpec]:
    specs = [experts_lib.ExpertSpec.parse(e) for e in (given or config.experts)]
    if not specs:
        raise ConfigError("no experts: pass --expert=TASK,CHECKPOINT_DIR,INDEX_DIR (or gin FuseConfig.experts)")
    tasks = [s.task for s in specs]
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"experts: one expert per task, got tasks {tasks}")
    return specs


def fuse_experts(expert_specs: Sequence[str], data_dir: str, output_dir: str, kb_dir: str | None = None,
                 tasks: Sequence[str] = (), split: str = "dev", train_split: str = "train",
                 calibration_split: str = "dev") -> FusionResult:
    """DPR-MUF fusion of single-task experts ("TASK,CHECKPOINT_DIR,INDEX_DIR" each, else gin
    `FuseConfig.experts`) on `tasks` (default: the experts' tasks), scored with the KILT metrics and
    written to `output_dir` (`write_fusion`).

    The KB, the experts and every example file are opened and checked before any ensemble trains.
    """
    from t5_retrieval.data import layout
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.tasks.examples import dataset_examples

    config = FuseConfig()
    specs = _expert_specs(expert_specs, config)
    store = PassageStore.open(kb_dir or layout.kb_dir(data_dir))
    ids = store.ids()
    experts = [experts_lib.load_expert(spec, ids) for spec in specs]
    # An expert's task may be its model's registered name or its dataset; example files are by dataset.
    datasets = {x.task: x.encoder.tasks.dataset_of(x.task) for x in experts}

    def examples(split: str, names: Sequence[str]) -> dict[str, list[Example]]:
        by_dataset = dataset_examples(data_dir, split, [datasets.get(n, n) for n in names])
        return {n: by_dataset[datasets.get(n, n)] for n in names}

    eval_tasks = list(tasks) or [s.task for s in specs]
    eval_examples = examples(split, eval_tasks)
    train_examples = examples(train_split, [s.task for s in specs])
    calibration = eval_examples if calibration_split == split else examples(calibration_split, eval_tasks)
    bm25 = None
    if config.hybrid_weight is not None:
        from t5_retrieval.retrieval.index import build_bm25_index
        bm25 = bm25_searcher(build_bm25_index(store, store.directory))
    result = fuse_and_evaluate(experts, train_examples, eval_examples, store, muf.EnsembleConfig(), config,
                               calibration, hybrid_with=bm25)
    write_fusion(result, output_dir)
    return result
