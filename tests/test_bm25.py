"""The one BM25 class (`retrieval.bm25_index.BM25Index`): the scores it gives, and `t5r index
--backend=bm25` -> `t5r eval` scoring it and `t5r mine` mining with it, with no model, on a
five-passage KB."""

import json
import os
import re

import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.records import Example, Passage, read_negatives
from t5_retrieval.data.stores import bm25
from t5_retrieval.data.stores.kb import PassageStore, build_kb
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.retrieval import bm25_index, index

PASSAGES = [  # (id, page, title, text)
    ("a_0", "a", "Paris", "Paris is the capital of France"),
    ("a_1", "a", "Paris", "The Seine flows through Paris"),
    ("b_0", "b", "Lyon", "Lyon lies on the Rhone and the Saone"),
    ("c_0", "c", "Seine", "The Seine river reaches the sea at Le Havre"),
    ("d_0", "d", "France", "France borders Spain"),
]


def kb() -> PassageTable:
    return PassageTable(Passage(pid, page, title, text) for pid, page, title, text in PASSAGES)


def test_bm25_scores_are_lucenes_bm25_computed_by_hand():
    """k1 0.9, b 0.4 over "title text" without stop words: lengths 4, 5, 5, 7, 4 (avgdl 5); "paris"
    and "seine" are each on two of the five passages, so idf = ln(1 + 3.5 / 2.5) = ln 2.4."""
    assert [bm25.bm25_tokens(f"{t} {x}") for _, _, t, x in PASSAGES] == [
        ["paris", "paris", "capital", "france"], ["paris", "seine", "flows", "through", "paris"],
        ["lyon", "lyon", "lies", "rhone", "saone"], ["seine", "seine", "river", "reaches", "sea", "le", "havre"],
        ["france", "france", "borders", "spain"]]
    idf = np.log(2.4)

    def norm(length):  # k1 * (1 - b + b * |d| / avgdl)
        return 0.9 * (0.6 + 0.4 * length / 5)

    built = bm25_index.build_bm25_index(kb())
    (rows,), (scores,) = built.search(["Seine [SEP] Paris?"], 5)  # punctuation is no word
    assert [built.passage_ids[r] for r in rows] == ["a_1", "a_0", "c_0", "b_0", "d_0"], rows  # 0s in row order
    np.testing.assert_allclose(scores, [idf * (2 / (2 + norm(5)) + 1 / (1 + norm(5))), idf * 2 / (2 + norm(4)),
                                        idf * 2 / (2 + norm(7)), 0, 0], rtol=1e-6)
    (rows,), (scores,) = built.search(["the France"], 2)  # a stop word adds nothing
    assert [built.passage_ids[r] for r in rows] == ["d_0", "a_0"]
    np.testing.assert_allclose(scores, [idf * 2 / (2 + norm(4)), idf * 1 / (1 + norm(4))], rtol=1e-6)
    np.testing.assert_allclose(bm25.score_subset(built.retriever, "seine paris", [2, 3]), [0, idf * 2 / (2 + norm(7))],
                               rtol=1e-6)


@pytest.fixture
def data_dir(tmp_path) -> str:
    """The five passages as a `t5r data kb` store, and two fever dev questions."""
    source = tmp_path / "passages.jsonl"
    source.write_text("".join(json.dumps({"id": pid, "wikipedia_id": page, "title": title, "text": text}) + "\n"
                              for pid, page, title, text in PASSAGES))
    build_kb(str(source), layout.kb_dir(str(tmp_path / "data")))
    examples = [Example(id="q1", task="fever", query="Paris is in France.", gold_pages=(("a",),)),
                Example(id="q2", task="fever", query="The Seine reaches the sea.", gold_pages=(("c",),))]
    os.makedirs(tmp_path / "data" / "examples")
    with open(layout.examples_path(str(tmp_path / "data"), "fever", "dev"), "w") as f:
        f.writelines(json.dumps(e.to_json()) + "\n" for e in examples)
    return str(tmp_path / "data")


def test_t5r_index_builds_bm25_from_a_kb_and_t5r_eval_scores_it_without_a_model(tmp_path, data_dir, capsys):
    kb_dir = layout.kb_dir(data_dir)
    assert cli.main(["index", "--backend=bm25", f"--kb_dir={kb_dir}", f"--output_dir={tmp_path}/idx"]) == 0
    loaded = index.load_index(f"{tmp_path}/idx")
    assert isinstance(loaded, bm25_index.BM25Index) and loaded.meta == {"kb_dir": os.path.abspath(kb_dir)}
    assert loaded.passage_ids == [p[0] for p in PASSAGES]
    assert cli.main(["eval", f"--index_dir={tmp_path}/idx", f"--data_dir={data_dir}", f"--output_dir={tmp_path}/ev"]) == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert results["fever"]["Rprec"] == 1.0 and results["fever"]["n"] == 2, results  # each finds its page first
    store = PassageStore.open(kb_dir)
    expected = bm25_index.build_bm25_index(store).search(["Paris is in France.", "The Seine reaches the sea."], 5)
    run = (tmp_path / "ev" / "predictions" / "fever.trec").read_text().splitlines()
    assert [line.split()[2] for line in run] == [PASSAGES[r][0] for rows in expected[0] for r in rows], run
    assert [float(line.split()[4]) for line in run] == pytest.approx(np.concatenate(expected[1]).tolist(), rel=1e-6)


def test_a_registered_task_over_bm25_is_scored_as_its_dataset(tmp_path, data_dir):
    """`--tasks=demo_fever` reads fever's examples and is scored as fever: no answer recall (FEVER's
    claims have no answer string to find), the same table as `--tasks=fever`."""
    with open(layout.examples_path(data_dir, "fever", "dev"), "w") as f:
        f.write(json.dumps(Example(id="q1", task="fever", query="Paris is in France.", gold_pages=(("a",),),
                                   answers=("SUPPORTS",)).to_json()) + "\n")
    assert cli.main(["index", "--backend=bm25", f"--kb_dir={layout.kb_dir(data_dir)}", f"--output_dir={tmp_path}/i"]) == 0
    tables = {}
    for task in ("fever", "demo_fever"):
        assert cli.main(["eval", f"--index_dir={tmp_path}/i", f"--data_dir={data_dir}", f"--tasks={task}",
                         f"--output_dir={tmp_path}/{task}"]) == 0
        tables[task] = json.loads((tmp_path / task / "results.json").read_text())[task]
    assert tables["demo_fever"] == tables["fever"] and "n_answers" not in tables["fever"], tables


def test_t5r_mine_mines_with_a_bm25_index_without_a_model(tmp_path, data_dir, capsys):
    """The BM25 ranking of each query text, minus its gold page's passages, best first."""
    assert cli.main(["index", "--backend=bm25", f"--kb_dir={layout.kb_dir(data_dir)}", f"--output_dir={tmp_path}/i"]) == 0
    assert cli.main(["mine", f"--index_dir={tmp_path}/i", f"--data_dir={data_dir}", "--split=dev", "--source=lex"]) == 0
    mined = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "lex"), "fever", "dev"))
    ranked = bm25_index.build_bm25_index(kb()).search(["Paris is in France.", "The Seine reaches the sea."], 5)[0]
    expected = [tuple(PASSAGES[r][0] for r in rows if PASSAGES[r][1] != gold) for rows, gold in zip(ranked, "ac")]
    assert mined == {"q1": expected[0], "q2": expected[1]} and "a_1" in expected[1], mined


def test_a_bm25_index_refuses_a_model_and_says_the_command_without_it(tmp_path, data_dir, capsys):
    assert cli.main(["index", "--backend=bm25", f"--kb_dir={layout.kb_dir(data_dir)}", f"--output_dir={tmp_path}/i"]) == 0
    capsys.readouterr()
    argv = ["eval", f"--index_dir={tmp_path}/i", f"--data_dir={data_dir}", f"--output_dir={tmp_path}/ev",
            "--lexical_baseline_dim", "16"]
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"t5r eval: error: {tmp_path}/i/index.json: a BM25 index searches the query texts and takes no "
                    f"model (--lexical_baseline_dim given); run `t5r eval --index_dir={tmp_path}/i "
                    f"--data_dir={data_dir} --output_dir={tmp_path}/ev`"), line
    assert not os.path.exists(f"{tmp_path}/ev"), "a refused eval leaves no output directory"
    with pytest.raises(index.IndexMismatchError, match=f"^{tmp_path}/i: a BM25 index searches query text and takes "
                                                       "no model"):
        from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

        index.load_index(f"{tmp_path}/i").check(HashedBagOfWordsEncoder(dim=8))
    with pytest.raises(ValueError, match=f"^{tmp_path}/i: a BM25 index searches query texts"):
        index.load_index(f"{tmp_path}/i").search(np.zeros((1, 8), np.float32), 3)


@pytest.mark.parametrize("flags, message", [
    (["--backend=bm25"], "give exactly one of --embeddings_dir"),
    (["--backend=bm25", "--embeddings_dir=emb"], "--backend=bm25 indexes a KB's texts: give --kb_dir"),
    (["--kb_dir={kb}"], "--kb_dir is indexed by --backend=bm25 only: t5r index --backend=bm25 --kb_dir={kb} "
                        "--output_dir={out}$"),
])
def test_t5r_index_says_which_flags_a_bm25_index_takes(tmp_path, capsys, flags, message):
    paths = {"kb": tmp_path / "kb", "out": tmp_path / "out"}
    assert cli.main(["index", *[f.format(**paths) for f in flags], f"--output_dir={paths['out']}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message.format(**paths), line), line
    assert not os.path.exists(f"{tmp_path}/out")
