"""The installed pretrained all-MiniLM-L6-v2 through our whole path: gin file -> model config ->
HF import -> t5r checkpoint -> `load_encoder` -> WordPiece tokenisation -> Flax BERT -> embeddings.

References: transformers' BertModel + AutoTokenizer on the same directory, mean pooling and L2
normalisation (what sentence-transformers computes for this model).
"""

import dataclasses
import json

import gin
import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import mini_kilt

import t5_retrieval.train  # noqa: F401  (registers the configurables models/minilm_l6.gin binds, as `t5r` does)
from t5_retrieval import checkpoint, gin_utils, sharding
from t5_retrieval.data.records import Passage
from t5_retrieval.data.text import format_passage, format_query
from t5_retrieval.inference import load_encoder
from t5_retrieval.models import hf_bert_import
from t5_retrieval.models.build import build_model, init_params, initial_params, model_config
from t5_retrieval.models.pretrained import minilm_l6_dir

QUERY_LEN, PASSAGE_LEN = 32, 128
TEXTS = ["Who wrote the novel Frankenstein?", "Aleister Crowley was born on June 12, 1875.",
         "Title: Morse code Text: Morse code is a method used in telecommunication to encode text characters."]
GOLD_VS_RANDOM_TASKS = ("fever", "wow", "hotpotqa", "trex", "entityquestions")


@gin.configurable("test_minilm_vocabulary")
def vocabulary_of_gin(vocabulary: str = gin.REQUIRED) -> str:
    return vocabulary  # gin evaluates the file's `@minilm_l6_dir()` on the way in


def minilm_config() -> dict:
    """The architecture the gin file declares, plus the features inference needs."""
    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/minilm_l6.gin"], ["test_minilm_vocabulary.vocabulary = %VOCABULARY"])
        config = model_config()
        vocabulary = vocabulary_of_gin()
    finally:
        gin.clear_config()
    features = {"vocabulary": vocabulary, "query_len": QUERY_LEN, "passage_len": PASSAGE_LEN,
                "tasks": {"fever": {"dataset": "fever", "prefix": None, "index": 0}}}
    return {**config, "features": features}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A t5r model directory holding MiniLM's weights, written as `t5r train --init_from` would start."""
    config = minilm_config()
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(0), sharding.make_mesh(), sharding.logical_axis_rules())
    params = initial_params(minilm_l6_dir(), params, config)
    directory = str(tmp_path_factory.mktemp("minilm") / "model")
    checkpoint.write_config(directory, config)
    checkpoint.save(checkpoint.manager(directory), 0, {"params": params}, {})
    return directory


@pytest.fixture(scope="module")
def encoder(model_dir):
    return load_encoder(model_dir, batch_size=16)


def reference_embeddings(texts: list[str], length: int) -> np.ndarray:
    """transformers BertModel + mean pooling + L2 norm, tokenised by AutoTokenizer on the model dir."""
    model_dir = minilm_l6_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.BertModel.from_pretrained(model_dir).eval()
    batch = tokenizer([t.replace("</s>", "[SEP]") for t in texts], max_length=length, truncation=True,
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1).numpy()


def test_gin_file_declares_the_installed_architecture():
    config = minilm_config()
    hf = hf_bert_import.bert_config_from_hf(hf_bert_import.read_hf_config(minilm_l6_dir()))
    assert config["family"] == "bert"
    architecture = {k: v for k, v in dataclasses.asdict(hf).items() if k != "attention"}  # a kernel, not stored
    assert config["bert"] == architecture, "models/minilm_l6.gin must match MiniLM's config.json"
    assert config["dual_encoder"]["pooling"] == "mean" and config["dual_encoder"]["l2_normalize"]
    assert config["features"]["vocabulary"] == minilm_l6_dir()


def test_load_encoder_rebuilds_a_bert_and_matches_sentence_transformers(encoder):
    assert type(encoder.model).__name__ == "BertDualEncoder" and encoder.dim == 384
    queries = encoder.encode_queries(TEXTS, "fever")
    np.testing.assert_allclose(queries, reference_embeddings([format_query(t, None) for t in TEXTS], QUERY_LEN),
                               atol=1e-4, err_msg="query embeddings differ from transformers + mean + L2")
    passages = [Passage(f"p{i}", "w", "Morse code", t) for i, t in enumerate(TEXTS)]
    np.testing.assert_allclose(encoder.encode_passages(passages),
                               reference_embeddings([format_passage(p.title, p.text) for p in passages], PASSAGE_LEN),
                               atol=1e-4, err_msg="passage embeddings differ from transformers + mean + L2")


def _gold_and_random_passages(per_task: int, seed: int = 0):
    by_page: dict[str, Passage] = {}
    with open(mini_kilt("kb", "passages.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            by_page.setdefault(row["wikipedia_id"], Passage(row["id"], row["wikipedia_id"], row["title"], row["text"]))
    pages = sorted(by_page)
    rng = np.random.default_rng(seed)
    triples = []
    for task in GOLD_VS_RANDOM_TASKS:
        with open(mini_kilt(f"{task}-dev-kilt.jsonl")) as f:
            rows = [json.loads(line) for _, line in zip(range(per_task), f)]
        for row in rows:
            gold = {p["wikipedia_id"] for out in row["output"] for p in out.get("provenance", [])}
            other = pages[int(rng.integers(len(pages)))]
            while other in gold:
                other = pages[int(rng.integers(len(pages)))]
            triples.append((row["input"], by_page[sorted(gold)[0]], by_page[other]))
    return triples


def test_gold_page_passage_outranks_a_random_page_on_mini_kilt_dev(encoder):
    triples = _gold_and_random_passages(per_task=10)
    queries = encoder.encode_queries([q for q, _, _ in triples], "fever")
    gold = encoder.encode_passages([g for _, g, _ in triples])
    other = encoder.encode_passages([o for _, _, o in triples])
    wins = np.mean(np.sum(queries * gold, 1) > np.sum(queries * other, 1))
    # Observed: 1.00 (50 queries, 10 from each task); chance is 0.5.
    assert wins > 0.9, f"gold page ranked above a random page for {wins:.0%} of {len(triples)} queries, expected > 90%"


@pytest.mark.parametrize("run_file", ["mt_dpr.gin", "mt_dpr_task_markers.gin", "leave_one_out.gin"])
def test_mt_dpr_run_files_with_the_minilm_model_file_configure_a_bert(run_file, clean_gin):
    import t5_retrieval.tasks  # noqa: F401  (registers the mixtures)
    from t5_retrieval.data.tasks import retrieval_tasks

    gin_utils.parse_gin(["models/minilm_l6.gin", f"runs/{run_file}"],
                        ["DATA_DIR = '/data'", "TRAIN_STEPS = 10", "BertDualEncoderConfig.separate_query_encoder = True"])
    config = model_config()
    assert config["family"] == "bert" and config["bert"]["hidden_size"] == 384
    assert config["dual_encoder"]["separate_query_encoder"], "a command-line tower switch must reach the model"
    assert gin.query_parameter("train.init_from").scoped_configurable_fn.__name__ == "minilm_l6_dir"
    assert retrieval_tasks.resolve(gin.query_parameter("%MIXTURE_OR_TASK_NAME")), f"{run_file}: its mixture must resolve"
