"""`t5r export-hf`: every model users make -> a directory sentence-transformers and transformers load
offline, embedding as t5r does.

Models: all-MiniLM-L6-v2 zero-shot (the `t5r results` row's model directory, the six mini-KILT tasks),
a prefixed tiny BERT trained by `t5r train` and a query-side model trained from it by `t5r train`
over its stored passage embeddings, a T5 ST5-EncDec trained by `t5r train`, and a T5 ST5-Enc with a
separate query encoder. Each export is loaded with sentence-transformers (`trust_remote_code=True`:
its `modeling_t5r.py`) and transformers (no network), and its `encode_query(q, prompt_name=task)`,
`encode_document` and model card code are compared, embeddings and top-10, with
`load_encoder(model_dir)` on the longest dev queries of the demo slice's tasks (entity-linking
queries cut around their mention, WoW and others past their task's length) and some short ones.
Import -> export -> import is checked bit for bit on random HF models.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import prepare_small_demo
from safetensors.numpy import load_file
from sentence_transformers import SentenceTransformer

from t5_retrieval import checkpoint, gin_utils
from t5_retrieval.cli import main as t5r
from t5_retrieval.data import layout
from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.text import format_passage
from t5_retrieval.export import hf
from t5_retrieval.inference import QuerySideEncoder, load_encoder
from t5_retrieval.models import hf_bert_import, hf_import
from t5_retrieval.models.bert import Bert
from t5_retrieval.models.t5 import T5, abstract_params
from t5_retrieval.train import train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SYNTHETIC_TASKS = ("fever", "trex", "aidayago2", "wow")
# The demo slice's dataset whose queries stand for each synthetic task (entity linking, dialogue, ...).
SLICE_DATASET = {"fever": "fever", "trex": "trex", "aidayago2": "entity_linking", "wow": "wow"}
# Short per-task lengths, so that most of the slice's queries are cut (entity linking around its mention).
QUERY_LEN = "{'fever': 12, 'trex': 10, 'aidayago2': 24, 'wow': 40}"
T5_QUERY_LEN = "{'fever': 12, 'trex': 10, 'aidayago2': 48, 'wow': 40}"  # the 400-piece vocabulary spells the markers out
ATOL = 1e-5


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


# Each export's files as `t5r export-hf` wrote them: a later test that verifies an export here leaves
# the local verification stamp in it, as verifying any artefact does.
AS_WRITTEN: dict[str, set[str]] = {}


def export(model_dir: str, out: str) -> str:
    assert t5r(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"]) == 0
    AS_WRITTEN[out] = {os.path.relpath(os.path.join(root, name), out) for root, _, files in os.walk(out) for name in files}
    return out


def read_json(*path: str):
    with open(os.path.join(*path)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_small_demo(tmp_path_factory.mktemp("hf_demo"), SYNTHETIC_TASKS)


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    return extract(SHIPPED, str(tmp_path_factory.mktemp("slice")))


def dev_queries(slice_dir: str, dataset: str) -> list[str]:
    with open(os.path.join(slice_dir, f"{dataset}-dev-kilt.jsonl")) as f:
        return [json.loads(line)["input"] for line in f]


def long_queries(slice_dir: str, dataset: str, n: int = 6) -> list[str]:
    """The `n` longest dev queries of a demo-slice dataset (cut by every task length here)."""
    return sorted(dev_queries(slice_dir, dataset), key=len)[-n:]


def passages_of(data_dir: str, n: int = 24):
    store = PassageStore.open(layout.kb_dir(data_dir))
    return [store.get(pid) for pid in store.ids()[:n]]


def card_blocks(out: str) -> list[str]:
    """The model card's code blocks, pointed at `out`."""
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    return [block.split("```")[0].replace("path/to/this/directory", out) for block in card.split("```python\n")[1:]]


def run_card(out: str, passages: list[str], queries: list[str], task: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Runs each of the card's code blocks as pasted (sentence-transformers' and/or transformers') on
    these passages and queries of `task`: each block's (query embeddings, passage embeddings)."""
    example_task = next(iter(read_json(out, hf.RETRIEVAL_JSON)["tasks"]))
    results = []
    for block in card_blocks(out):
        scope = {"passages": passages, "queries": queries}
        exec(block.replace(f'"{example_task}"', repr(task)), scope)
        results.append((scope["query_embeddings"], scope["passage_embeddings"]))
    return results


def load_query_ids(out: str):
    """The export's own t5r_query_ids.py (what the card's transformers code and modeling_t5r.py run)."""
    spec = importlib.util.spec_from_file_location("exported_t5r_query_ids", os.path.join(out, "t5r_query_ids.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = float(np.abs(np.asarray(got) - want).max())
    print(f"{what}: max abs difference {diff:.2e}")
    assert diff < ATOL, f"{what}: {diff} away from t5r's embeddings, expected < {ATOL}"


def assert_same_top10(queries: np.ndarray, passages: np.ndarray, want_q: np.ndarray, want_p: np.ndarray,
                      what: str) -> None:
    got = np.argsort(-(np.asarray(queries) @ np.asarray(passages).T), axis=1, kind="stable")[:, :10]
    want = np.argsort(-(want_q @ want_p.T), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(got, want, err_msg=f"{what}: top-10 differs from t5r's")


def load_sentence_transformer(out: str) -> SentenceTransformer:
    return SentenceTransformer(out, trust_remote_code=True, device="cpu")


def check_sentence_transformers(out: str, encoder, tasks: dict[str, list[str]], passages) -> None:
    """`SentenceTransformer(out, trust_remote_code=True)`: encode_document, and encode_query with each
    task's prompt on its long (cut at the task's length, around an entity mention) and short queries,
    against t5r, embeddings and top-10; then the card's code blocks as pasted, and a query without a
    task prompt refused."""
    model = load_sentence_transformer(out)
    texts = [format_passage(p.title, p.text, read_json(out, hf.RETRIEVAL_JSON)["passage_template"]) for p in passages]
    want_p = encoder.encode_passages(passages)
    got_p = model.encode_document(texts)
    assert_close(got_p, want_p, "sentence-transformers encode_document")
    for task, queries in tasks.items():
        want_q = encoder.encode_queries(queries, task)
        got_q = model.encode_query(queries, prompt_name=task)
        assert_close(got_q, want_q, f"{task}: encode_query(prompt_name=task)")
        assert_same_top10(got_q, got_p, want_q, want_p, f"{task}: encode_query(prompt_name=task)")
        results = run_card(out, texts, queries, task)
        assert len(results) == 2, "the card must give sentence-transformers' and transformers' code"
        for library, (card_q, card_p) in zip(("sentence-transformers", "transformers"), results):
            assert_close(card_q, want_q, f"{task}: the card's query embeddings with {library}")
            assert_close(card_p, want_p, f"the card's passage embeddings with {library}")
            assert_same_top10(card_q, card_p, want_q, want_p, f"{task}: the card's code with {library}")
    task, queries = next(iter(tasks.items()))
    assert_close(model.encode(queries, prompt_name=task), encoder.encode_queries(queries, task),
                 f"{task}: encode(prompt_name=task)")
    check_refuses_queries_without_their_task(model, sorted(tasks), texts)


def check_refuses_queries_without_their_task(model: SentenceTransformer, task_names: list[str], texts) -> None:
    """A query needs its task's prompt; a passage takes none: each an error saying what to pass."""
    needs_task = r"a query needs its task: encode_query\(queries, prompt_name=TASK\)"
    with pytest.raises(ValueError, match=needs_task) as error:
        model.encode_query(["who wrote Frankenstein?"])
    assert all(name in str(error.value) for name in task_names), error.value
    with pytest.raises(ValueError, match=needs_task):
        model.encode(["who wrote Frankenstein?"])  # one network or two: never silently embedded as a passage
    with pytest.raises(ValueError, match="names no task of this model"):
        model.encode_query(["who wrote Frankenstein?"], prompt="query: ")
    with pytest.raises(ValueError, match="passages take no prompt"):
        model.encode_document(texts[:1], prompt_name=task_names[0])


def slice_queries(slice_dir: str, dataset: str) -> list[str]:
    """Its 6 longest dev queries (cut at every task length here) and 3 shortest (within it)."""
    queries = sorted(dev_queries(slice_dir, dataset), key=len)
    return queries[-6:] + queries[:3]


@pytest.fixture(scope="module")
def minilm_zero_shot(tmp_path_factory):
    """The `t5r results` zero-shot row's model directory (all-MiniLM-L6-v2, the six mini-KILT tasks at
    their lengths) and its export."""
    from t5_retrieval.results.minilm_rows import write_minilm_model_dir

    root = tmp_path_factory.mktemp("minilm")
    model_dir = str(root / "model")
    write_minilm_model_dir(model_dir)
    return model_dir, export(model_dir, str(root / "hf"))


def test_zero_shot_minilm_embeds_every_demo_task_as_t5r_in_sentence_transformers(minilm_zero_shot, slice_dir,
                                                                                  data_dir):
    model_dir, out = minilm_zero_shot
    encoder = load_encoder(model_dir)
    assert sorted(encoder.task_names) == ["entity_linking", "entityquestions", "fever", "hotpotqa", "trex", "wow"]
    check_sentence_transformers(out, encoder, {task: slice_queries(slice_dir, task) for task in encoder.task_names},
                                passages_of(data_dir))


def test_zero_shot_minilm_export_is_the_original_model_with_a_tokenizer_json(minilm_zero_shot):
    from t5_retrieval.models.pretrained import minilm_l6_dir

    _, out = minilm_zero_shot
    original = load_file(os.path.join(minilm_l6_dir(), "model.safetensors"))
    assert_tensors_equal_original(original, out, ignorable=(*hf_bert_import.UNUSED_NAMES, "pooler.dense.weight",
                                                            "pooler.dense.bias"))
    assert read_json(out, "1_Pooling", "config.json") == read_json(minilm_l6_dir(), "1_Pooling", "config.json")
    original_modules = read_json(minilm_l6_dir(), "modules.json")
    original_modules[0]["type"] = "modeling_t5r.T5rTransformer"  # the original's Transformer, reading t5r's queries
    assert read_json(out, "modules.json") == original_modules
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    texts = ["Who wrote the novel Frankenstein?", "Morse code: a method used in telecommunication to encode text."]
    ours, theirs = load_sentence_transformer(out), SentenceTransformer(minilm_l6_dir(), device="cpu")
    assert ours.tokenizer(texts)["input_ids"] == theirs.tokenizer(texts)["input_ids"]
    diff = np.abs(ours.encode_document(texts) - theirs.encode(texts)).max()
    assert diff == 0.0, f"the exported MiniLM embeds {diff} away from the original"


def test_the_exported_query_ids_are_t5rs_for_every_demo_query(minilm_zero_shot, slice_dir):
    """The export's `t5r_query_ids.query_ids` with its tokenizer, on every dev query of the demo slice's
    six tasks, against the ids t5r reads (at the task's length, and at a second, shorter one)."""
    from t5_retrieval.data.tokenizers.query_inputs import QueryInput, query_ids

    model_dir, out = minilm_zero_shot
    encoder = load_encoder(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    exported = load_query_ids(out)
    tasks = exported.read_tasks(out)
    for task in encoder.task_names:
        query = encoder.query_input(task)
        for variant in (query, QueryInput(None, query.length // 2 + 8, query.truncation)):
            spec = {**tasks[task], "query_len": variant.length}
            queries = dev_queries(slice_dir, task)
            want = [ids + [encoder.vocabulary.sep_id] for ids in query_ids(encoder.vocabulary, queries, variant)]
            got = [exported.query_ids(tokenizer, q, spec) for q in queries]
            assert got == want, f"{task} at {variant}: the card's query ids differ from t5r's"


def test_the_exported_code_imports_nothing_from_t5r(minilm_zero_shot):
    """modeling_t5r.py and t5r_query_ids.py run where t5r is not installed: standard library,
    sentence-transformers and each other only."""
    _, out = minilm_zero_shot
    allowed = {"__future__", "collections", "json", "os", "typing", "sentence_transformers"}
    for name in ("modeling_t5r.py", "t5r_query_ids.py"):
        tree = ast.parse(open(os.path.join(out, name), encoding="utf-8").read())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


@pytest.fixture(scope="module")
def bert_runs(data_dir, tmp_path_factory):
    """A prefixed tiny BERT (MiniLM's WordPiece, mean pooling, L2) trained by `t5r train`, and a
    query-side model trained from it by `t5r train` over its stored passage embeddings; both exported."""
    root = tmp_path_factory.mktemp("bert")
    bindings = [f"DATA_DIR = '{data_dir}'", "VOCABULARY = @minilm_l6_dir()", "VOCAB_SIZE = 30522",
                f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}' for t in SYNTHETIC_TASKS]}", f"QUERY_LEN = {QUERY_LEN}",
                "BertDualEncoderConfig.pooling = 'mean'", "BertDualEncoderConfig.l2_normalize = True"]
    base = train_tiny(str(root / "base"), "models/bert_tiny.gin", bindings)
    store = PassageStore.open(layout.kb_dir(data_dir))
    embedding_store.write_embeddings(load_encoder(base), store, store.ids(), str(root / "emb"),
                                     meta={"model_dir": base}, progress=False)
    query_side = train_tiny(str(root / "query_side"), "models/bert_tiny.gin", [
        *bindings, f"train.init_from = '{base}'", f"make_train_iterator.passage_embeddings = '{root / 'emb'}'",
        "LEARNING_RATE = 1e-2", "TRAIN_STEPS = 3"])  # the first step's warm-up learning rate is 0
    return (base, export(base, str(root / "base_hf"))), (query_side, export(query_side, str(root / "query_side_hf")))


def synthetic_task_queries(slice_dir: str) -> dict[str, list[str]]:
    return {f"demo_{task}": slice_queries(slice_dir, SLICE_DATASET[task]) for task in SYNTHETIC_TASKS}


def test_prefixed_bert_embeds_as_t5r_with_its_prompts_and_one_token_markers(bert_runs, slice_dir, data_dir):
    model_dir, out = bert_runs[0]
    record = read_json(out, hf.RETRIEVAL_JSON)
    assert (record["query_encoder"], record["passage_encoder"]) == (".", "."), record
    assert read_json(out, "config_sentence_transformers.json")["prompts"]["demo_fever"] == "<t5r-task:demo_fever>"
    module_tasks = read_json(out, "sentence_bert_config.json")["tasks"]
    assert module_tasks["demo_fever"]["query_prefix"] == "FEVER [unused1] ", module_tasks
    assert module_tasks["demo_aidayago2"]["query_prefix"] == "AIDA [unused1] ", module_tasks
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.tokenize("FEVER [unused1] x") == ["fever", "[unused1]", "x"], "[unused1] must be one token"
    check_sentence_transformers(out, load_encoder(model_dir), synthetic_task_queries(slice_dir), passages_of(data_dir))


def test_each_exported_task_is_its_task_spec_record_with_its_prefix_text():
    """One source for a task's fields: the export's entry is `TaskSpec.to_record()`, plus the prefix
    as the text put before a query in the vocabulary's own tokens."""
    from t5_retrieval.data.tasks.task_names import TaskSet
    from t5_retrieval.data.tasks.task_spec import TaskSpec

    tasks = TaskSet([TaskSpec("demo_fever", "fever", "FEVER", 24), TaskSpec("demo_aidayago2", "aidayago2", "AIDA", 40,
                                                                             "mention"),
                     TaskSpec("my_fever_lc", "fever", None, 16, text_preprocessors=("my_tasks.without_subject",))])
    for family, sentinel in (("bert", "[unused1]"), ("t5", "<extra_id_1>")):
        prefix_text = {"demo_fever": f"FEVER {sentinel} ", "demo_aidayago2": f"AIDA {sentinel} ", "my_fever_lc": ""}
        assert hf.task_specs(tasks, family) == {name: {**tasks.spec(name).to_record(), "query_prefix": text}
                                                for name, text in prefix_text.items()}, family


def test_query_side_model_exports_its_query_encoder_and_its_bases_passage_encoder_as_a_router(
        bert_runs, slice_dir, data_dir):
    (base_dir, _), (model_dir, out) = bert_runs
    encoder = load_encoder(model_dir)
    assert isinstance(encoder, QuerySideEncoder)
    record = read_json(out, hf.RETRIEVAL_JSON)
    assert record["query_side"] and record["fingerprint"] == load_encoder(base_dir).fingerprint, record
    assert read_json(out, "modules.json")[0]["type"] == "sentence_transformers.models.Router"
    for network, length in (("query_encoder", record["query_len"]), ("passage_encoder", record["passage_len"])):
        assert read_json(out, network, "sentence_bert_config.json")["max_seq_length"] == length, network
    query, passage = (load_file(os.path.join(out, network, "model.safetensors"))
                      for network in ("query_encoder", "passage_encoder"))
    assert any(not np.array_equal(query[name], passage[name]) for name in query), \
        "the query route must hold the fine-tuned weights, the document route the base's"
    check_sentence_transformers(out, encoder, synthetic_task_queries(slice_dir), passages_of(data_dir))
    with pytest.raises(ValueError, match="a query needs its task"):
        load_sentence_transformer(out).encode(["which tower?"])  # no silent choice of tower


@pytest.fixture(scope="module")
def t5_run(data_dir, tmp_path_factory):
    """A T5 ST5-EncDec model trained by `t5r train` (prefixed tasks) and its `t5r export-hf` directory."""
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    root = tmp_path_factory.mktemp("t5_run")
    vocabulary = train_vocabulary(layout.kb_dir(data_dir), str(root / "spm"), vocab_size=400)
    model_dir = train_tiny(str(root / "model"), "models/t5_tiny.gin", [
        f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'", "VOCAB_SIZE = 512", "D_MODEL = 32",
        "D_FF = 64", f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}' for t in SYNTHETIC_TASKS]}", f"QUERY_LEN = {T5_QUERY_LEN}"])
    return model_dir, export(model_dir, str(root / "hf"))


def test_st5_encdec_export_has_no_sentence_transformers_files_and_its_card_embeds_as_t5r(t5_run, slice_dir,
                                                                                          data_dir):
    model_dir, out = t5_run
    encoder = load_encoder(model_dir)
    assert not [n for n in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")
                if os.path.exists(os.path.join(out, n))], "sentence-transformers cannot pool ST5-EncDec"
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    assert "`sentencepiece` and `protobuf`" in card and "not a sentence-transformers model" in card
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    passages = passages_of(data_dir)
    texts = [format_passage(p.title, p.text) for p in passages]
    want_p = encoder.encode_passages(passages)
    for task, queries in synthetic_task_queries(slice_dir).items():
        [(got_q, got_p)] = run_card(out, texts, queries, task)
        want_q = encoder.encode_queries(queries, task)
        assert_close(got_q, want_q, f"T5 {task}: the card's transformers code")
        assert_close(got_p, want_p, "T5 passages: the card's transformers code")
        assert_same_top10(got_q, got_p, want_q, want_p, f"T5 {task}")


def test_t5_tokenizer_loads_without_sentencepiece_or_protobuf(t5_run):
    """tokenizer.json is the tokenizer: transformers loads it with sentencepiece and protobuf unimportable."""
    _, out = t5_run
    code = ("import sys; sys.modules['sentencepiece'] = None; sys.modules['google.protobuf'] = None\n"
            "import transformers\n"
            f"t = transformers.AutoTokenizer.from_pretrained({out!r})\n"
            "print(t('FEVER <extra_id_1> a b</s>c')['input_ids'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    ids = json.loads(run.stdout.strip().splitlines()[-1])
    assert ids[-1] == 1 and 1 in ids[:-1], f"</s> inside and at the end of the ids: {ids}"


def test_st5_enc_with_a_query_encoder_is_a_sentence_transformers_router_that_embeds_as_t5r(
        t5_run, slice_dir, data_dir, tmp_path):
    from tiny_model import write_model_dir

    vocabulary = checkpoint.vocabulary_file(t5_run[0], checkpoint.read_config(t5_run[0])["features"])
    model_dir = str(tmp_path / "model")
    write_model_dir(model_dir, data_dir, vocabulary, seed=3, extra_bindings=(
        "DualEncoderConfig.pooling = 'mean'", "DualEncoderConfig.l2_normalize = True",
        "DualEncoderConfig.separate_query_encoder = True", "QUERY_LEN = {'aidayago2': 48, 'wow': 40}",
        "MIXTURE_OR_TASK_NAME = ['demo_aidayago2', 'demo_wow']"))  # two tasks: its batch has two rows
    out = export(model_dir, str(tmp_path / "hf"))
    assert sorted(read_json(out, "router_config.json")["structure"]) == ["document", "query"]
    tasks = {task: queries for task, queries in synthetic_task_queries(slice_dir).items()
             if task in ("demo_aidayago2", "demo_wow")}
    check_sentence_transformers(out, load_encoder(model_dir), tasks, passages_of(data_dir))


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
    target = abstract_params(Bert(cfg), (jnp.ones((1, 4), jnp.int32),))
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




def test_refuses_query_towers_projection_and_a_non_empty_output(t5_run, capsys):
    model_dir, out = t5_run
    config = checkpoint.read_config(model_dir)
    for field, value in (("query_towers", 2), ("projection_dim", 16)):
        with pytest.raises(hf.ExportError, match=f"dual_encoder.{field}={value}"):
            hf.check_exportable({**config, "dual_encoder": {**config["dual_encoder"], field: value}})
    assert t5r(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"]) == 2
    assert "is a Hugging Face export" in capsys.readouterr().err, "an existing export is never written over"
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n], "temp dir left behind"


def test_the_export_directory_carries_checksums_of_every_file(minilm_zero_shot):
    from t5_retrieval import checksums

    out = minilm_zero_shot[1]
    files = json.load(open(os.path.join(out, checksums.CHECKSUMS_FILE)))["files"]
    assert "model.safetensors" in files and "tokenizer.json" in files, sorted(files)
    assert checksums.verify_all(out)[0] == len(files)


def test_a_task_is_named_by_its_dataset_as_by_its_registered_name(bert_runs, slice_dir, data_dir):
    """`prompt_name="fever"` (t5r's commands name tasks so) embeds as `prompt_name="demo_fever"`, with one
    network and with a Router, and so does the card's transformers code with `TASKS["fever"]`."""
    texts = [format_passage(p.title, p.text) for p in passages_of(data_dir, 4)]
    queries = slice_queries(slice_dir, "fever")
    for model_dir, out in bert_runs:
        assert read_json(out, hf.RETRIEVAL_JSON)["task_aliases"]["fever"] == "demo_fever"
        model = load_sentence_transformer(out)
        want = load_encoder(model_dir).encode_queries(queries, "demo_fever")
        assert_close(model.encode_query(queries, prompt_name="fever"), want, f"{out}: prompt_name='fever'")
        assert_close(model.encode(queries, prompt_name="fever"), want, f"{out}: encode(prompt_name='fever')")
        for card_q, _ in run_card(out, texts, queries, "fever"):
            assert_close(card_q, want, f"{out}: the card's code with 'fever'")


def test_exports_are_readable_by_others_and_name_no_path_of_this_machine(minilm_zero_shot, bert_runs):
    """Directories with the umask's permissions (not mkdtemp's 0700), no verification stamp (inodes and
    mtimes of this disk), and a model_config.json whose vocabulary is the shipped copy."""
    from t5_retrieval import checksums

    umask = os.umask(0)
    os.umask(umask)
    exports = {minilm_zero_shot[1]: "vocab.txt", bert_runs[1][1]: "query_encoder/vocab.txt"}
    for out, vocabulary in exports.items():
        for root, _, files in os.walk(out):
            assert oct(os.stat(root).st_mode & 0o777) == oct(0o777 & ~umask), f"{root}: mode under umask {umask:o}"
            for name in files:
                assert os.stat(os.path.join(root, name)).st_mode & 0o444 == 0o444 & ~umask, os.path.join(root, name)
        shipped_stamps = [f for f in AS_WRITTEN[out] if os.path.basename(f) == checksums.STAMP_FILE]
        assert not shipped_stamps, f"{out}: ships a stamp of this filesystem: {shipped_stamps}"
        config = read_json(out, "model_config.json")
        assert config["features"]["vocabulary"] == vocabulary, config["features"]
        assert os.path.exists(os.path.join(out, vocabulary))
        paths = [v for v in json.dumps(config).split('"') if os.path.isabs(v)]
        assert not paths, f"{out}/model_config.json names paths of this machine: {paths}"


def test_running_the_cards_code_as_a_user_writes_nothing_into_the_export(minilm_zero_shot, tmp_path):
    """Each code block of the card, run as a script in a fresh interpreter (as a user pastes it),
    leaves the export's files as they were: no __pycache__/ of the code it imports from there."""
    _, out = minilm_zero_shot
    before = sorted(os.path.relpath(os.path.join(r, n), out) for r, ds, fs in os.walk(out) for n in ds + fs)
    inputs = 'passages = ["Frankenstein / a novel by Mary Shelley"]\nqueries = ["who wrote Frankenstein?"]\n'
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for block in card_blocks(out):
        run = subprocess.run([sys.executable, "-c", inputs + block + "\nprint(scores.shape)"], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=300)
        assert run.returncode == 0 and run.stdout.strip().endswith("(1, 1)"), run.stderr[-2000:]
    after = sorted(os.path.relpath(os.path.join(r, n), out) for r, ds, fs in os.walk(out) for n in ds + fs)
    assert after == before, f"the card's code wrote {sorted(set(after) - set(before))} into the export"
