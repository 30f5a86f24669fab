"""`t5r export-hf`: t5r model directories -> Hugging Face directories, checked with transformers + torch.

Models come from `t5r train` (one step on the demo data: a T5 ST5-EncDec with a sentencepiece
vocabulary; a BERT with a separate query encoder and MiniLM's WordPiece vocabulary). The exported
directories are loaded with transformers alone; the embeddings are computed the ST5-EncDec way (T5)
and by the sentence-transformers pipeline read from the files written (BERT), and compared with
`load_encoder(model_dir)`. Import -> export -> import is checked bit for bit on random HF models.
"""

import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from conftest import prepare_small_demo
from t5_retrieval import checkpoint, gin_utils
from t5_retrieval.cli import main as t5r
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.text import format_passage, format_query
from t5_retrieval.data.tokenizers.tokenize import tokenize
from t5_retrieval.export import hf
from t5_retrieval.inference import QUERY_SIDE_FILE, load_encoder
from t5_retrieval.models import hf_bert_import, hf_import
from t5_retrieval.models.bert import Bert
from t5_retrieval.models.t5 import T5, abstract_params
from t5_retrieval.train import train

TASKS = ("fever", "trex")
QUERIES = ["Who wrote the novel Frankenstein?", "Aleister Crowley [SEP] place of birth",
           "a   query\twith  odd whitespace and a fairly long tail " * 3]
ATOL = 1e-5


def prepare_demo(root) -> str:
    return prepare_small_demo(root, TASKS)


def train_tiny(model_dir: str, gin_file: str, bindings: list[str]) -> str:
    gin.clear_config()
    try:
        gin_utils.parse_gin([gin_file, "runs/base.gin"], [
            "TRAIN_STEPS = 1", "QUERY_LEN = 16", "PASSAGE_LEN = 32", "NUM_NEGATIVES = 1", "PER_DEVICE_BATCH = 4",
            "NUM_LAYERS = 1", *bindings])
        train(model_dir)
    finally:
        gin.clear_config()
    return model_dir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_demo(tmp_path_factory.mktemp("hf_demo"))


@pytest.fixture(scope="module")
def t5_run(data_dir, tmp_path_factory):
    """A T5 ST5-EncDec model trained by `t5r train` (prefixed tasks) and its `t5r export-hf` directory."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    root = tmp_path_factory.mktemp("t5_run")
    vocabulary = train_vocabulary(layout.kb_dir(data_dir), str(root / "spm"), vocab_size=400)
    model_dir = train_tiny(str(root / "model"), "models/t5_tiny.gin", [
        f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'", "VOCAB_SIZE = 512", "D_MODEL = 32",
        "D_FF = 64", f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}' for t in TASKS]}"])
    out = str(root / "hf")
    assert t5r(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"]) == 0
    return model_dir, out


@pytest.fixture(scope="module")
def bert_run(data_dir, tmp_path_factory):
    """A BERT (mean pooling, L2, separate query encoder) trained by `t5r train` and its export."""
    root = tmp_path_factory.mktemp("bert_run")
    model_dir = train_tiny(str(root / "model"), "models/bert_tiny.gin", [
        f"DATA_DIR = '{data_dir}'", "VOCABULARY = @minilm_l6_dir()", "VOCAB_SIZE = 30522",
        f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}_noprefix' for t in TASKS]}", "BertDualEncoderConfig.pooling = 'mean'",
        "BertDualEncoderConfig.l2_normalize = True", "BertDualEncoderConfig.separate_query_encoder = True"])
    out = str(root / "hf")
    assert t5r(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"]) == 0
    return model_dir, out


def passages_of(data_dir: str, n: int = 6):
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    return [store.get(pid) for pid in store.ids()[:n]]


def st5_encdec(model: transformers.T5Model, ids: np.ndarray) -> np.ndarray:
    """ST5-EncDec with transformers: one decoder step from id 0, its final-norm hidden state."""
    ids = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        start = torch.zeros((len(ids), 1), dtype=torch.long)
        out = model(input_ids=ids, attention_mask=ids != 0, decoder_input_ids=start)
    return out.last_hidden_state[:, 0].numpy()


def test_t5_export_loads_in_transformers_and_embeds_as_t5r(t5_run, data_dir):
    model_dir, out = t5_run
    encoder = load_encoder(model_dir)
    model = transformers.T5Model.from_pretrained(out).eval()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["feed_forward_proj"] == "gated-gelu"
    for task in encoder.task_names:
        ids = tokenize(encoder.vocabulary, [format_query(q, encoder.prefix_of(task)) for q in QUERIES], 16)
        diff = np.abs(st5_encdec(model, ids) - encoder.encode_queries(QUERIES, task)).max()
        print(f"T5 queries ({task}): max abs difference {diff:.2e}")
        assert diff < ATOL, f"{task} query embeddings: transformers vs t5r differ by {diff}, expected < {ATOL}"
    passages = passages_of(data_dir)
    ids = tokenize(encoder.vocabulary, [format_passage(p.title, p.text) for p in passages], 32)
    diff = np.abs(st5_encdec(model, ids) - encoder.encode_passages(passages)).max()
    print(f"T5 passages: max abs difference {diff:.2e}")
    assert diff < ATOL, f"passage embeddings: transformers vs t5r differ by {diff}, expected < {ATOL}"


def test_t5_export_tokenizer_and_record_give_t5rs_query_ids(t5_run):
    model_dir, out = t5_run
    encoder = load_encoder(model_dir)
    with open(os.path.join(out, hf.RETRIEVAL_JSON)) as f:
        record = json.load(f)
    assert record["tasks"]["demo_fever"]["query_prefix"] == "FEVER <extra_id_1> ", record["tasks"]
    assert (record["query_len"], record["passage_len"], record["pooling"]) == (16, 32, "encdec")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    texts = [record["tasks"]["demo_fever"]["query_prefix"] + " ".join(q.replace("[SEP]", "</s>").split())
             for q in QUERIES]
    ids = tokenizer(texts, max_length=16, truncation=True, padding="max_length", return_tensors="np")["input_ids"]
    expected = tokenize(encoder.vocabulary, [format_query(q, "FEVER") for q in QUERIES], 16)
    np.testing.assert_array_equal(ids, expected, err_msg="AutoTokenizer on the export must give t5r's token ids")
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    assert "FEVER <extra_id_1>" in card, card
    snippet = card.split("```python\n")[1].split("```")[0].replace("path/to/this/directory", out)
    scope = {"texts": texts}
    exec(snippet.replace("max_length = 32", "max_length = 16"), scope)  # the model card's code, on queries
    diff = np.abs(scope["embedding"].numpy() - encoder.encode_queries(QUERIES, "demo_fever")).max()
    assert diff < ATOL, f"the model card's code gives embeddings {diff} away from t5r's"


def read_json(*path: str):
    with open(os.path.join(*path)) as f:
        return json.load(f)


def sentence_transformers_embed(directory: str, texts: list[str], max_length: int | None = None) -> np.ndarray:
    """sentence-transformers' pipeline as its files describe it: Transformer -> Pooling -> [Normalize]
    (`max_length`: a shorter truncation, as `SentenceTransformer.max_seq_length = n` sets for queries)."""
    modules = [m["type"].rsplit(".", 1)[1] for m in read_json(directory, "modules.json")]
    assert modules[:2] == ["Transformer", "Pooling"], modules
    max_length = max_length or read_json(directory, "sentence_bert_config.json")["max_seq_length"]
    pooling = read_json(directory, "1_Pooling", "config.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModel.from_pretrained(directory).eval()
    batch = tokenizer(texts, max_length=max_length, truncation=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    if pooling["pooling_mode_mean_tokens"]:
        pooled = (states * mask).sum(1) / mask.sum(1)
    else:
        assert pooling["pooling_mode_cls_token"], pooling
        pooled = states[:, 0]
    if modules[2:] == ["Normalize"]:
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return pooled.numpy()


def test_bert_export_is_a_sentence_transformers_model_that_embeds_as_t5r(bert_run, data_dir):
    model_dir, out = bert_run
    encoder = load_encoder(model_dir)
    assert os.path.isdir(os.path.join(out, "2_Normalize")) and read_json(out, "1_Pooling", "config.json")[
        "pooling_mode_mean_tokens"]
    passages = passages_of(data_dir)
    diff = np.abs(sentence_transformers_embed(out, [format_passage(p.title, p.text) for p in passages])
                  - encoder.encode_passages(passages)).max()
    print(f"BERT passages: max abs difference {diff:.2e}")
    assert diff < ATOL, f"passage embeddings: sentence-transformers pipeline vs t5r differ by {diff}"
    query_dir = os.path.join(out, read_json(out, hf.RETRIEVAL_JSON)["query_encoder"])
    queries = QUERIES  # KILT's [SEP] is t5r's `</s>` marker and BERT's [SEP] token
    texts = [format_query(q, None).replace("</s>", "[SEP]") for q in queries]
    reference = sentence_transformers_embed(query_dir, texts)
    diff = np.abs(reference - encoder.encode_queries(queries, "demo_fever_noprefix")).max()
    print(f"BERT queries (query_encoder/): max abs difference {diff:.2e}")
    assert diff < ATOL, f"query embeddings: query_encoder/ vs t5r differ by {diff}"
    assert read_json(query_dir, "sentence_bert_config.json")["max_seq_length"] == 16  # query_len
    main = sentence_transformers_embed(out, [format_query(q, None) for q in queries[:1]], max_length=16)
    assert not np.allclose(main, reference[:1], atol=1e-3), "query_encoder/ must hold the query tower's weights"


@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
def test_t5_import_export_import_is_the_identity(tmp_path, version):
    torch.manual_seed(0)
    variant = {"v1_0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
               "v1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}[version]
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   layer_norm_epsilon=1e-5, **variant)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = hf_import.t5_config_from_hf(hf_import.read_hf_config(str(tmp_path / "hf")))
    tokens = jnp.ones((1, 4), jnp.int32)
    target = abstract_params(T5(cfg), tokens, tokens)
    params = hf_import.load_t5(str(tmp_path / "hf"), target, cfg)
    hf.write_t5_dir(str(tmp_path / "out"), params, cfg)
    assert hf_import.t5_config_from_hf(hf_import.read_hf_config(str(tmp_path / "out"))) == cfg
    again = hf_import.load_t5(str(tmp_path / "out"), target, cfg)
    assert_trees_identical(params, again)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if "lm_head.weight" not in original and not cfg.tie_word_embeddings:
        # transformers >= 5 stores a v1.1 head as `shared.weight` only; we write the head we hold.
        original["lm_head.weight"] = original["shared.weight"]
    assert_tensors_equal_original(original, tmp_path / "out", ignorable=hf_import.TIED_COPIES)


def test_bert_import_export_import_is_the_identity(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                     num_hidden_layers=2, max_position_embeddings=40, layer_norm_eps=1e-7)
    transformers.BertModel(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = hf_bert_import.bert_config_from_hf(hf_bert_import.read_hf_config(str(tmp_path / "hf")))
    target = abstract_params(Bert(cfg), jnp.ones((1, 4), jnp.int32))
    params = hf_bert_import.load_bert(str(tmp_path / "hf"), target, cfg)
    hf.write_bert_dir(str(tmp_path / "out"), params, cfg)
    assert hf_bert_import.bert_config_from_hf(hf_bert_import.read_hf_config(str(tmp_path / "out"))) == cfg
    assert_trees_identical(params, hf_bert_import.load_bert(str(tmp_path / "out"), target, cfg))
    assert_tensors_equal_original(load_file(str(tmp_path / "hf" / "model.safetensors")), tmp_path / "out",
                                  ignorable=(*hf_bert_import.UNUSED_NAMES, "pooler.dense.weight", "pooler.dense.bias"))


def assert_trees_identical(a, b) -> None:
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"re-imported {jax.tree_util.keystr(path)}")
    assert jax.tree.structure(a) == jax.tree.structure(b)


def assert_tensors_equal_original(original: dict, exported_dir, ignorable) -> None:
    exported = load_file(os.path.join(exported_dir, "model.safetensors"))
    expected = sorted(n for n in original if n not in ignorable)
    assert sorted(exported) == expected, f"exported names {sorted(exported)}, expected {expected}"
    for name in expected:
        np.testing.assert_array_equal(exported[name], original[name], err_msg=f"exported tensor {name}")


def test_refuses_query_towers_projection_query_side_and_a_non_empty_output(t5_run, tmp_path, capsys):
    import shutil

    model_dir, out = t5_run
    config = checkpoint.read_config(model_dir)
    for field, value in (("query_towers", 2), ("projection_dim", 16)):
        with pytest.raises(hf.ExportError, match=f"dual_encoder.{field}={value}"):
            hf.check_exportable({**config, "dual_encoder": {**config["dual_encoder"], field: value}})
    query_side = tmp_path / "query_side"
    shutil.copytree(model_dir, query_side)
    (query_side / QUERY_SIDE_FILE).write_text("{}")
    with pytest.raises(hf.ExportError, match="query-side model"):
        hf.export_hf(str(query_side), str(tmp_path / "qs_out"))
    assert t5r(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.startswith(".t5r-export-hf-")], "temp dir left behind"


def test_pretrained_minilm_round_trips_to_its_own_tensors_and_sentence_transformers_embeddings(tmp_path, clean_gin):
    """all-MiniLM-L6-v2 imported into a t5r model directory and exported: the original tensors, bit for bit,
    and the original sentence-transformers directory's embeddings."""
    from t5_retrieval import sharding
    from t5_retrieval.models.build import build_model, init_params, initial_params, model_config
    from t5_retrieval.models.pretrained import minilm_l6_dir

    gin_utils.parse_gin(["models/minilm_l6.gin"], [])
    config = {**model_config(), "features": {
        "vocabulary": minilm_l6_dir(), "query_len": 32, "passage_len": 128,
        "tasks": {"fever": {"dataset": "fever", "prefix": None, "index": 0}}}}
    params, _ = init_params(build_model(config), jax.random.PRNGKey(0), sharding.make_mesh(),
                            sharding.logical_axis_rules())
    model_dir = str(tmp_path / "model")
    checkpoint.write_config(model_dir, config)
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": initial_params(minilm_l6_dir(), params, config)}, {})
    out = str(tmp_path / "hf")
    hf.export_hf(model_dir, out)
    original = load_file(os.path.join(minilm_l6_dir(), "model.safetensors"))
    assert_tensors_equal_original(original, out, ignorable=(*hf_bert_import.UNUSED_NAMES, "pooler.dense.weight",
                                                            "pooler.dense.bias"))
    for name in ("modules.json", os.path.join("1_Pooling", "config.json")):
        assert read_json(out, name) == read_json(minilm_l6_dir(), name), name
    texts = ["Who wrote the novel Frankenstein?", "Morse code: a method used in telecommunication to encode text."]
    diff = np.abs(sentence_transformers_embed(out, texts) - sentence_transformers_embed(minilm_l6_dir(), texts)).max()
    print(f"MiniLM export vs the original all-MiniLM-L6-v2: max abs difference {diff:.2e}")
    assert diff == 0.0, f"the exported MiniLM embeds {diff} away from the original"


def test_st5_enc_mean_pooled_l2_normalised_t5_exports_with_a_model_card_that_embeds_as_t5r(t5_run, data_dir, tmp_path):
    from tiny_model import write_model_dir

    vocabulary = checkpoint.read_config(t5_run[0])["features"]["vocabulary"]
    model_dir = str(tmp_path / "model")
    write_model_dir(model_dir, data_dir, vocabulary, seed=3, extra_bindings=(
        "DualEncoderConfig.pooling = 'mean'", "DualEncoderConfig.l2_normalize = True"))
    out = str(tmp_path / "hf")
    hf.export_hf(model_dir, out)
    encoder = load_encoder(model_dir)
    with open(os.path.join(out, "README.md")) as f:
        snippet = f.read().split("```python\n")[1].split("```")[0].replace("path/to/this/directory", out)
    assert "model.encoder(" in snippet and "normalize" in snippet, snippet
    passages = passages_of(data_dir)
    scope = {"texts": [format_passage(p.title, p.text) for p in passages]}
    exec(snippet, scope)
    diff = np.abs(scope["embedding"].numpy() - encoder.encode_passages(passages)).max()
    print(f"T5 ST5-Enc + L2 passages (model card code): max abs difference {diff:.2e}")
    assert diff < ATOL, f"ST5-Enc passage embeddings: model card code vs t5r differ by {diff}"


def test_the_model_cards_entity_linking_code_gives_t5rs_mention_window(tmp_path):
    """The card's `mention_window_ids`, run with transformers' tokenizer of MiniLM on the demo slice's
    entity-linking queries, gives the ids t5r reads."""
    from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract
    from t5_retrieval.data.tokenizers.query_inputs import QueryInput, query_ids
    from t5_retrieval.data.text import normalize_query
    from t5_retrieval.data.tokenizers.tokenize import encode_batch, load_vocabulary
    from t5_retrieval.models.pretrained import minilm_l6_dir

    record = {"family": "bert", "fingerprint": "f", "dim": 384, "pooling": "mean", "l2_normalize": True,
              "query_len": 109, "passage_len": 256, "passage_template": "{title}: {text}", "query_encoder": None,
              "tasks": {"entity_linking": {"prefix": "AIDA", "query_prefix": "AIDA [unused1] ", "query_len": 109,
                                           "truncation": "mention"}}}
    card = hf.model_card(record)
    assert "| `entity_linking` | `AIDA [unused1] ` | 109 | mention |" in card, card
    scope = {}
    exec(card.split("```python\n")[2].split("```")[0], scope)  # the card's second code block
    with open(os.path.join(extract(SHIPPED, str(tmp_path)), "entity_linking-dev-kilt.jsonl")) as f:
        queries = [normalize_query(json.loads(line)["input"]) for line in f]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_l6_dir())
    vocab = load_vocabulary(minilm_l6_dir())
    prefix_ids = encode_batch(vocab, ["AIDA <extra_id_1>"])[0]
    for length in (64, 109):
        want = [ids + [vocab.sep_id] for ids in query_ids(vocab, queries, QueryInput("AIDA", length, "mention"))]
        got = [scope["mention_window_ids"](tokenizer, prefix_ids, q, length) for q in queries]
        assert got == want, f"length {length}: the card's window differs from t5r's"
