"""Query-side fine-tuning: the loss, answer-only QA data, and a round trip on a tiny real model and index."""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mini_kilt
from tiny_model import build_tiny_run

from t5_retrieval import query_side
from t5_retrieval.commands import query_side as query_side_command
from t5_retrieval.commands.inputs import add_encoder_flags, encoder_from_flags
from t5_retrieval.data import layout
from t5_retrieval.data.kilt.answers import AnswerMatcher, AnswerTexts
from t5_retrieval.data.kilt.qa_open import QATask, read_qa_task
from t5_retrieval.data.records import DataError, Example, read_examples
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.inference import QuerySideEncoder, load_encoder, token_lengths
from t5_retrieval.retrieval.index import load_index
from t5_retrieval.stages import index_and_evaluate


def test_loss_is_minus_log_of_the_softmax_mass_on_the_positive_set():
    rng = np.random.default_rng(0)
    queries, candidates = rng.normal(size=(3, 4)), rng.normal(size=(3, 5, 4))
    positive = np.array([[1, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 1]], bool)
    scores = np.einsum("bd,bkd->bk", queries, candidates)
    probs = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)
    expected = np.mean([-np.log(probs[i][positive[i]].sum()) for i in range(3)])
    got = float(query_side.query_side_loss(jnp.asarray(queries, jnp.float32), jnp.asarray(candidates, jnp.float32),
                                           jnp.asarray(positive)))
    assert got == pytest.approx(expected, rel=1e-5), "loss must be -log sum of softmax over the positives"


def test_answer_matcher_follows_dpr_tokens_or_regex():
    assert AnswerMatcher(("the Seine",))("Paris lies on the seine, a river.")
    assert not AnswerMatcher(("Seine",))("Seinem Haus")  # whole tokens only
    assert AnswerMatcher(("Santa Ana|_?Orange _?County_?",), regex=True)("It is in orange county, CA.")
    assert not AnswerMatcher(("^Orange$",), regex=True)("Orange County")


def test_reading_qa_open_keeps_answers_and_the_match_kind(tmp_path):
    path = tmp_path / "toy-train-kilt.jsonl"
    rows = [{"id": "a", "input": "who?", "output": [{"answer": "X"}, {"answer": "X"}], "meta": {"match": "regex"}},
            {"id": "b", "input": "what?", "output": [{"answer": "Y"}], "meta": {"match": "regex"}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = read_qa_task(str(tmp_path), "toy", "train")
    assert task.regex and [e.answers for e in task.examples] == [("X",), ("Y",)]
    path.write_text(json.dumps({"id": "c", "input": "why?", "output": [{"answer": " "}]}) + "\n")
    with pytest.raises(DataError, match=r"toy-train-kilt.jsonl:1: example 'c' has no output\[\].answer"):
        read_qa_task(str(tmp_path), "toy", "train")


def test_real_qa_open_answer_passages_are_the_ones_the_matcher_finds():
    """The dataset's own answer_passage_ids (made with DPR's has_answer) agree with our matcher."""
    qa_dir = mini_kilt("qa_open")
    passages = {}
    with open(mini_kilt("kb", "passages.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            passages[row["id"]] = f"{row['title']} {row['text']}"
    for name in ("nq_open", "curatedtrec"):
        task = read_qa_task(qa_dir, name, "dev")
        assert task.regex == (name == "curatedtrec")
        with open(os.path.join(qa_dir, f"{name}-dev-kilt.jsonl")) as f:
            stored = [json.loads(line)["meta"]["answer_passage_ids"] for line in f]
        agree = sum(all(task.matcher(e)(passages[p]) for p in ids) for e, ids in zip(task.examples[:100], stored))
        assert agree >= 95, f"{name}: our matcher confirms the stored answer passages of only {agree}/100 questions"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qs")
    return str(root), build_tiny_run(str(root))


def _qa_task(run) -> QATask:
    """Demo T-REx questions as an answer-only task (answers: years and names)."""
    examples = read_examples(layout.examples_path(run.data_dir, "trex", "train"))
    return QATask("trex_qa", [Example(e.id, "trex_qa", e.query, (), (), e.answers) for e in examples], regex=False)


def test_finetuning_lowers_the_loss_keeps_passages_frozen_and_reloads_with_the_base_fingerprint(tiny):
    root, run = tiny
    encoder = run.encoders[0]
    base_params = encoder.params
    emb_dir, index_dir = os.path.join(root, "emb_0"), run.index_dirs[0]
    index, store = load_index(index_dir), PassageStore.open(layout.kb_dir(run.data_dir))
    matrix = embedding_store.load_matrix(emb_dir)
    task = _qa_task(run)
    config = query_side.QuerySideConfig(top_k=20, batch_size=2, learning_rate=3e-3, rounds=2, epochs_per_round=3)

    def loss_on(params, data) -> float:
        queries = encoder.model.apply({"params": params}, data.tokens)
        return float(query_side.query_side_loss(queries, matrix[data.rows], data.positive))

    texts = AnswerTexts(store)
    fixed = query_side.retrieve_candidates(encoder, index, texts, task, "demo_trex", config.top_k)
    assert len(fixed.rows) >= 4, f"need questions with an answer among 20 of {len(index)} passages, got {len(fixed.rows)}"
    before = loss_on(base_params, fixed)
    short = dataclasses.replace(fixed, tokens=fixed.tokens[:, :int(token_lengths(fixed.tokens).max())])
    np.testing.assert_allclose(loss_on(base_params, short), before, rtol=1e-5,
                               err_msg="training cuts batches' padding: the loss must not depend on it")
    params, history = query_side.finetune(encoder, index, matrix, texts, [task], "demo_trex", config, progress=False)
    after = loss_on(params, fixed)
    assert after < 0.9 * before, f"loss on the first round's candidates: {before:.4f} -> {after:.4f}"
    assert [h["round"] for h in history] == [1, 2] and all(h["questions"] >= 4 for h in history), history
    first_round = history[0]["epoch_mean_loss"]
    assert len(first_round) == 3 and first_round[-1] < first_round[0], f"mean loss per pass: {first_round}"

    out = os.path.join(root, "query_side")
    query_side.save(out, encoder, params, run.model_dirs[0], "demo_trex", [task.name], history)
    parser = __import__("argparse").ArgumentParser()
    add_encoder_flags(parser)
    loaded = encoder_from_flags(parser.parse_args(["--checkpoint_dir", out]))
    assert isinstance(loaded, QuerySideEncoder)
    index.check(loaded, store.ids())  # the base's index accepts it
    passages = [store.get(pid) for pid in store.ids()[:5]]
    np.testing.assert_array_equal(loaded.encode_passages(passages), matrix[:5],
                                  err_msg="passages must keep the base encoder (the index's embeddings)")
    questions = [e.query for e in task.examples[:4]]
    np.testing.assert_allclose(loaded.encode_queries(questions, task.name), encoder.encode_queries(questions, "demo_trex"),
                               rtol=1e-5, atol=1e-6, err_msg="the new task must query with as_task's prefix and "
                                                             "the fine-tuned weights")
    base_queries = load_encoder(out).passage_encoder.encode_queries(questions, "demo_trex")
    assert not np.allclose(base_queries, loaded.encode_queries(questions, task.name)), "queries must have changed"

    recall = query_side.answer_recall(loaded, index, texts, task, task.name, ks=(1, 5, 20))
    assert recall["n"] == len(task.examples) and 0 <= recall["answer_recall@1"] <= recall["answer_recall@20"] <= 1


def _write_qa_file(path: str, examples: list[Example], regex: bool) -> None:
    with open(path, "w") as f:
        for e in examples:
            answers = [a.replace(" ", r"\s+") for a in e.answers] if regex else list(e.answers)
            f.write(json.dumps({"id": e.id, "input": e.query, "output": [{"answer": a} for a in answers],
                                "meta": {"match": "regex" if regex else "string"}}) + "\n")


def test_cli_adapts_to_several_qa_tasks_with_their_own_matching_and_reports_each(tiny, tmp_path, clean_gin):
    root, run = tiny
    examples = [e for e in read_examples(layout.examples_path(run.data_dir, "trex", "train")) if e.answers]
    qa_dir = tmp_path / "qa"
    qa_dir.mkdir()
    half = len(examples) // 2
    for name, part, regex in (("plain", examples[:half], False), ("regexy", examples[half:], True)):
        for split in ("train", "dev"):
            _write_qa_file(str(qa_dir / f"{name}-{split}-kilt.jsonl"), part, regex)
    out = str(tmp_path / "qs")
    argv = ["--checkpoint_dir", run.model_dirs[0], "--index_dir", run.index_dirs[0],
            "--embeddings_dir", os.path.join(root, "emb_0"), "--kb_dir", layout.kb_dir(run.data_dir),
            "--qa_dir", str(qa_dir), "--task", "plain,regexy", "--as_task", "demo_trex", "--output_dir", out,
            "--gin.QuerySideConfig.top_k=20", "--gin.QuerySideConfig.batch_size=2"]
    assert query_side_command.main(argv) == 0
    with open(os.path.join(out, query_side.REPORT_FILE)) as f:
        report = json.load(f)
    assert report["tasks"] == ["plain", "regexy"]
    for when in ("dev_before", "dev_after"):
        assert {t: r["n"] for t, r in report[when].items()} == {"plain": half, "regexy": len(examples) - half}
    texts = AnswerTexts(PassageStore.open(layout.kb_dir(run.data_dir)))
    index = load_index(run.index_dirs[0])
    base = load_encoder(run.model_dirs[0])  # not run.encoders[0]: the test above fine-tuned it in place
    separately = sum(len(query_side.retrieve_candidates(base, index, texts, read_qa_task(str(qa_dir), t, "train"),
                                                        "demo_trex", 20).rows) for t in ("plain", "regexy"))
    assert report["history"][0]["questions"] == separately, "the round must train on the union of both tasks"
    loaded = load_encoder(out)
    assert {"plain", "regexy"} <= set(loaded.features["tasks"]), "each new task must be queryable"
    assert loaded.tasks.resolve("trex") == "demo_trex", "a new task must not claim its as_task's dataset"

    # Scored like any row on the datasets it is asked for (the new tasks have no KILT dev files).
    index_and_evaluate(str(tmp_path / "eval_row"), out, run.data_dir, index_dir=run.index_dirs[0], datasets=["trex"])
    with open(tmp_path / "eval_row" / "eval" / "results.json") as f:
        assert list(json.load(f)) == ["demo_trex"]
    with pytest.raises(KeyError, match="plainish"):
        index_and_evaluate(str(tmp_path / "eval_bad"), out, run.data_dir, index_dir=run.index_dirs[0],
                           datasets=["plainish"])
