"""`t5r ance` end to end at toy scale: BM25 warm-up, one TACO episode with mined negatives, eval;
and a rerun that finds every stage done."""

import json
import os

import gin
import pytest

from t5_retrieval import cli, gin_utils
from t5_retrieval.ance import ance
from t5_retrieval.data import layout
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
from t5_retrieval.data.kilt.synthetic import write_demo
from t5_retrieval.data.records import read_negatives
from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
from t5_retrieval.retrieval.index import build_bm25_index_for_kb

TASKS = ["fever", "trex"]


def ance_data(root: str) -> tuple[str, str]:
    """Prepared synthetic data of TASKS (KB, examples, BM25 negatives) and a 400-piece vocabulary."""
    raw, data_dir = os.path.join(root, "raw"), os.path.join(root, "data")
    write_demo(raw, num_pages=60, train_per_task=24, dev_per_task=8)
    prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data_dir)
    prepare_tasks(raw, data_dir, TASKS)
    prepare_negatives(data_dir, TASKS, index=build_bm25_index_for_kb(layout.kb_dir(data_dir)))
    return data_dir, train_vocabulary(layout.kb_dir(data_dir), os.path.join(data_dir, "spm"), vocab_size=400)


@pytest.fixture(scope="module")
def ance_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ance")
    data_dir, vocabulary = ance_data(str(root))
    bindings = [
        f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'", "MIXTURE_OR_TASK_NAME = ['demo_fever', 'demo_trex']",
        "WARMUP_MIXTURE = ['demo_fever_noprefix', 'demo_trex_noprefix']", "VOCAB_SIZE = 512",
        "D_MODEL = 32", "D_FF = 64", "PER_DEVICE_BATCH = 4", "QUERY_LEN = 24", "PASSAGE_LEN = 48",
        "warmup/train.num_epochs = None", "warmup/train.num_steps = 8",
        "episode/train.num_epochs = None", "episode/train.num_steps = 10",
        "multitask.taco.burn_in_fraction = 0.3", "train.log_every = 1", "ance.mine_depth = 12",
    ]
    gin.clear_config()
    gin_utils.parse_gin(["runs/demo.gin"], bindings)
    work_dir = str(root / "work")
    tables = ance(work_dir)
    yield work_dir, data_dir, tables
    gin.clear_config()


def test_every_stage_is_marked_done(ance_run):
    work_dir, _, _ = ance_run
    for stage in ("warmup/model", "warmup/index", "warmup/eval", "episode_1/negatives", "episode_1/model",
                  "episode_1/index", "episode_1/eval"):
        assert os.path.exists(os.path.join(work_dir, stage, "DONE")), f"stage {stage} did not finish"


def test_episode_trains_on_model_mined_negatives_without_gold_pages(ance_run):
    work_dir, data_dir, _ = ance_run
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.stores.kb import PassageStore
    store = PassageStore.open(layout.kb_dir(data_dir))
    mined = read_negatives(layout.negatives_path(os.path.join(work_dir, "episode_1", "negatives"), "fever"))
    bm25 = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir), "fever"))
    assert mined.keys() == bm25.keys(), "every training query gets mined negatives"
    assert any(mined[k][:2] != bm25[k][:2] for k in mined), "mined negatives should differ from BM25's"
    for example in read_examples(layout.examples_path(data_dir, "fever", "train")):
        gold = {p for s in example.gold_pages for p in s}
        assert not gold & {store.page_of(p) for p in mined[example.id]}, f"{example.id}: gold page mined as negative"


def test_taco_weighting_switches_on_after_burn_in(ance_run):
    work_dir, _, _ = ance_run
    with open(os.path.join(work_dir, "episode_1", "model", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    active = [r["taco/active"] for r in rows]
    assert active[:2] == [0.0, 0.0] and active[-1] == 1.0, f"taco/active per step: {active}"
    for row in rows:  # a T5 leaves few sensitivities at exactly 0: the paper's median over all parameters is not 0
        assert row["taco/median/0"] > 0 and row["taco/median/1"] > 0 and row["taco/zero_fraction/0"] < 0.5, row
    with open(os.path.join(work_dir, "warmup", "model", "metrics.jsonl")) as f:
        assert "taco/active" not in json.loads(f.readline()), "warm-up is the naive sum, without TACO"


def test_taco_state_is_exported_and_analyzed(ance_run, tmp_path):
    work_dir, _, _ = ance_run
    state_npz = os.path.join(work_dir, "episode_1", "model", "multitask_state.npz")
    assert not os.path.exists(os.path.join(work_dir, "warmup", "model", "multitask_state.npz"))
    assert cli.main(["analyze", "--state_npz", state_npz, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "analysis.json") as f:
        summary = json.load(f)
    assert summary["num_tasks"] == 2 and 0.0 <= summary["task_specific_fraction"] <= 1.0, summary
    assert {p.name for p in tmp_path.glob("*.png")}, "analysis figures were not written"


def test_eval_table_and_kilt_predictions_are_written(ance_run):
    work_dir, _, tables = ance_run
    assert sorted(tables) == ["demo_fever", "demo_trex"]
    for task, row in tables.items():
        assert row["n"] == 8 and 0.0 <= row["Rprec"] <= 1.0 and "recall@5" in row, row
        with open(os.path.join(work_dir, "episode_1", "eval", "predictions", f"{task}.jsonl")) as f:
            prediction = json.loads(f.readline())
        assert prediction["output"][0]["provenance"][0]["wikipedia_id"], prediction


def test_rerun_resumes_with_every_stage_done(ance_run):
    work_dir, _, tables = ance_run
    before = {p: os.path.getmtime(p) for p in (os.path.join(work_dir, s, "DONE") for s in ("warmup/model", "episode_1/eval"))}
    assert ance(work_dir) == tables
    assert before == {p: os.path.getmtime(p) for p in before}, "a finished stage was run again"


def test_answer_checks_apply_only_to_the_answer_checkable_datasets(ance_run, tmp_path):
    from t5_retrieval.data.kilt.answers import has_answer
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.stages import mine_stage

    work_dir, data_dir, _ = ance_run
    warmup = os.path.join(work_dir, "warmup")
    checked_dir = str(tmp_path / "negatives")
    mine_stage(checked_dir, os.path.join(warmup, "model"), os.path.join(warmup, "index"), data_dir, 12,
               answer_checkable=("trex",))
    episode_dir = os.path.join(work_dir, "episode_1", "negatives")  # same model and depth, no answer check
    assert read_negatives(layout.negatives_path(checked_dir, "fever")) == \
        read_negatives(layout.negatives_path(episode_dir, "fever")), "FEVER's labels are not answers to check"
    store = PassageStore.open(layout.kb_dir(data_dir))
    plain, checked = (read_negatives(layout.negatives_path(d, "trex")) for d in (episode_dir, checked_dir))
    dropped = 0
    for example in read_examples(layout.examples_path(data_dir, "trex", "train")):
        holds_answer = [has_answer(store.get(p).text, example.answers) for p in plain[example.id]]
        assert list(checked[example.id]) == [p for p, a in zip(plain[example.id], holds_answer) if not a], example.id
        dropped += sum(holds_answer)
    assert dropped > 0, "the check never fired: no trex negative held an answer"


def test_a_query_side_recipe_mines_and_evaluates_with_one_index_and_encodes_nothing(ance_run, tmp_path):
    """`ance.passage_index`: the passages come from stored embeddings, so every stage searches the
    index of those embeddings (no stage encodes the KB), and mined negatives still come from each
    stage's own query model."""
    work_dir, data_dir, _ = ance_run
    warmup = os.path.join(work_dir, "warmup")
    side_dir = str(tmp_path / "query_side")
    gin.bind_parameter("make_train_iterator.passage_embeddings", os.path.join(warmup, "embeddings"))
    gin.bind_parameter("ance.passage_index", os.path.join(warmup, "index"))
    gin.bind_parameter("warmup/train.init_from", os.path.join(warmup, "model"))
    try:
        tables = ance(side_dir)
    finally:
        for name in ("make_train_iterator.passage_embeddings", "ance.passage_index", "warmup/train.init_from"):
            gin.bind_parameter(name, None)
    assert sorted(tables) == ["demo_fever", "demo_trex"]
    for stage in ("warmup", "episode_1"):
        assert os.path.exists(os.path.join(side_dir, stage, "eval", "DONE")), stage
        assert not os.path.exists(os.path.join(side_dir, stage, "embeddings")), f"{stage} encoded the KB"
    mined = read_negatives(layout.negatives_path(os.path.join(side_dir, "episode_1", "negatives"), "fever"))
    assert mined, "the episode mined negatives with the warm-up model over the shared index"
