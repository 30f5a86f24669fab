"""`t5r export-hf`: a t5r model directory -> a Hugging Face directory that `transformers` loads offline.

T5 dual encoders become a `T5Model` directory (config.json, model.safetensors, spiece.model); the
embedding is computed as `t5r` does (ST5-EncDec: one decoder step from id 0, its final-norm hidden
state; ST5-Enc: the encoder states' mean over non-padding tokens). BERT dual encoders become a
`BertModel` directory (vocab.txt) plus the sentence-transformers files (modules.json, 1_Pooling,
2_Normalize when the model L2-normalises, sentence_bert_config.json), so `SentenceTransformer(dir)`
computes what `t5r` computes.

The tensors are written through the importers' own name maps (`hf_import.name_map`,
`hf_bert_import.name_map`) run backwards: each converter there is a reshape/transpose, so applying it
to the HF positions (`np.arange`) says where each of our values goes, and import -> export -> import
is the identity by construction rather than by a second hand-written table that could drift.

A separate query encoder (`dual_encoder.separate_query_encoder`) is exported as a second, complete
directory `query_encoder/` inside the output. Refused, each naming its config field: per-task query
towers (`dual_encoder.query_towers`), a projection after pooling (`dual_encoder.projection_dim`;
`T5Model` has no place for it), and query-side model directories (queries and passages go through
different models, one of them another directory's).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from t5_retrieval import checkpoint
from t5_retrieval.data.tokenizers.query_inputs import MENTION_WINDOW, recorded_query_input
from t5_retrieval.data.text import EXTRA_ID_1, PASSAGE_TEMPLATE, query_prefix
from t5_retrieval.data.tokenizers.tokenize import is_wordpiece_path
from t5_retrieval.inference import DualEncoderInference, is_query_side_dir, load_dual_encoder
from t5_retrieval.models import hf_bert_import, hf_import
from t5_retrieval.models.bert import BertConfig
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.errors import UserError

FORMAT = "t5r-hf-export/1"
RETRIEVAL_JSON = "t5r_retrieval.json"  # tasks, prefixes, lengths, pooling: what the model card explains
QUERY_ENCODER_DIR = "query_encoder"
BERT_SENTINEL = "[unused1]"  # what `<extra_id_1>` in a task prefix becomes in a WordPiece vocabulary


class ExportError(UserError, ValueError):
    """A model directory that cannot be expressed as a Hugging Face directory; names the config field."""


def to_hf_tensors(params: Any, name_map: Iterable[tuple[str, tuple[str, ...], hf_import.Converter]]
                  ) -> dict[str, np.ndarray]:
    """Our parameter tree -> HF tensors by name, inverting each importer converter exactly.

    `convert` applied to the HF element positions gives, in our layout, the HF position of every
    value; scattering our values there restores the HF tensor bit for bit. Names whose path the
    tree lacks (an LM head a dual encoder never built) are not written.
    """
    flat = traverse_util.flatten_dict(params)
    out, used = {}, set()
    for hf_name, path, converter in name_map:
        if path not in flat:
            continue
        ours = np.asarray(flat[path], dtype=np.float32)
        hf_shape = converter.hf_shape(ours.shape)
        size = math.prod(hf_shape)
        positions = converter.convert(np.arange(size, dtype=np.int32 if size < 2**31 else np.int64).reshape(hf_shape))
        hf = np.empty(ours.size, np.float32)
        hf[np.asarray(positions).ravel()] = ours.ravel()
        out[hf_name] = hf.reshape(hf_shape)
        used.add(path)
    missing = sorted("/".join(p) for p in flat if p not in used)
    if missing:
        raise ExportError(f"parameters with no Hugging Face tensor name: {missing[:5]}")
    return out


def t5_hf_config(cfg: T5Config) -> dict[str, Any]:
    """A `T5Config` config.json with the v1.0/v1.1 fields our config implies.

    `tie_word_embeddings` carries our v1.0 flag (LM head on d_model^-0.5-scaled states): transformers
    >= 5 reads it as `scale_decoder_outputs`, older versions as tying, and our importer as either.
    """
    return {"architectures": ["T5Model"], "model_type": "t5", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
            "d_kv": cfg.d_kv, "d_ff": cfg.d_ff, "num_layers": cfg.num_encoder_layers,
            "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_heads,
            "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
            "relative_attention_max_distance": cfg.relative_attention_max_distance,
            "dropout_rate": cfg.dropout_rate, "layer_norm_epsilon": cfg.layer_norm_epsilon,
            "feed_forward_proj": cfg.mlp_activation, "tie_word_embeddings": cfg.tie_word_embeddings,
            "initializer_factor": 1.0, "is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1,
            "decoder_start_token_id": 0, "dtype": "float32"}


def bert_hf_config(cfg: BertConfig) -> dict[str, Any]:
    """A `BertConfig` config.json (post-LN, exact GELU, absolute positions: what our Bert computes)."""
    return {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": cfg.type_vocab_size,
            "hidden_dropout_prob": cfg.dropout_rate, "attention_probs_dropout_prob": cfg.dropout_rate,
            "layer_norm_eps": cfg.layer_norm_epsilon, "initializer_range": cfg.initializer_range,
            "hidden_act": "gelu", "position_embedding_type": "absolute", "pad_token_id": 0, "dtype": "float32"}


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_t5_dir(directory: str, params: Any, cfg: T5Config) -> None:
    """config.json + model.safetensors of a `T5Model` from one T5's parameters."""
    write_json(os.path.join(directory, "config.json"), t5_hf_config(cfg))
    tensors = to_hf_tensors(params, list(hf_import.name_map(cfg)))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def write_bert_dir(directory: str, params: Any, cfg: BertConfig) -> None:
    """config.json + model.safetensors of a `BertModel` (no pooler: our encoder has none, and neither
    sentence-transformers nor the embedding uses it; `BertModel` initialises one and says so)."""
    write_json(os.path.join(directory, "config.json"), bert_hf_config(cfg))
    tensors = to_hf_tensors(params, list(hf_bert_import.name_map(cfg)))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def write_t5_tokenizer(directory: str, vocabulary: str, max_length: int) -> None:
    """The sentencepiece model as `spiece.model`, with seqio's 100 `<extra_id_*>` pieces declared
    (T5Tokenizer's `extra_ids`, numbered from the end of the vocabulary as seqio numbers them)."""
    shutil.copyfile(vocabulary, os.path.join(directory, "spiece.model"))
    write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "T5Tokenizer", "extra_ids": 100, "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": max_length})


def write_bert_tokenizer(directory: str, vocabulary: str, max_length: int) -> None:
    """vocab.txt and the BertTokenizer settings our WordPiece tokenisation uses (lower-casing as recorded)."""
    from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary

    vocab = WordPieceVocabulary.from_path(vocabulary)
    shutil.copyfile(vocab.vocab_file, os.path.join(directory, "vocab.txt"))
    write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "BertTokenizer", "do_lower_case": vocab.lower_case, "do_basic_tokenize": True,
        "tokenize_chinese_chars": True, "strip_accents": None, "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]", "model_max_length": max_length})


def write_sentence_transformers(directory: str, hidden_size: int, pooling: str, l2_normalize: bool,
                                max_length: int) -> None:
    """modules.json, 1_Pooling/config.json, 2_Normalize/ and sentence_bert_config.json: Transformer ->
    Pooling (the model's) -> Normalize (only when the model L2-normalises)."""
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens"}
    if pooling not in modes:
        raise ExportError(f"dual_encoder.pooling={pooling!r}: sentence-transformers pools by {sorted(modes)} here")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if l2_normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(directory, "2_Normalize"))
    write_json(os.path.join(directory, "modules.json"), modules)
    write_json(os.path.join(directory, "1_Pooling", "config.json"), {
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    write_json(os.path.join(directory, "sentence_bert_config.json"),
               {"max_seq_length": max_length, "do_lower_case": False})
    write_json(os.path.join(directory, "config_sentence_transformers.json"),
               {"similarity_fn_name": "cosine" if l2_normalize else "dot"})


def check_exportable(config: dict[str, Any]) -> None:
    """Refuses what a Hugging Face directory cannot hold, naming the model_config.json field."""
    dual = config["dual_encoder"]
    if dual.get("query_towers"):
        raise ExportError(f"dual_encoder.query_towers={dual['query_towers']}: per-task query encoders are not "
                          "exported (one Hugging Face model per task and a task -> model table would be needed)")
    if dual.get("projection_dim"):
        raise ExportError(f"dual_encoder.projection_dim={dual['projection_dim']}: a projection after pooling has no "
                          "place in a T5Model directory; not exported")
    if not config.get("features", {}).get("vocabulary"):
        raise ExportError("features.vocabulary: the model records no vocabulary (trained on synthetic token "
                          "batches?); a Hugging Face directory needs its tokenizer")


def retrieval_record(encoder: DualEncoderInference, family: str) -> dict[str, Any]:
    """What turns text into model inputs and the model's output into an embedding (t5r_retrieval.json)."""
    features, dual = encoder.features, encoder.config["dual_encoder"]
    sentinel = BERT_SENTINEL if family == "bert" else EXTRA_ID_1
    queries = {name: recorded_query_input(features, name) for name in sorted(features.get("tasks", {}))}
    tasks = {name: {"prefix": q.prefix,
                    "query_prefix": query_prefix(q.prefix).replace(EXTRA_ID_1, sentinel) + " " if q.prefix else "",
                    "query_len": q.length, "truncation": q.truncation}
             for name, q in queries.items()}
    return {"format": FORMAT, "family": family, "fingerprint": encoder.fingerprint, "dim": encoder.dim,
            "pooling": dual["pooling"], "l2_normalize": dual["l2_normalize"],
            # The longest task's query length (the query encoder's max_length); each task's is in "tasks".
            "query_len": max((q.length for q in queries.values()), default=features["query_len"]),
            "passage_len": features["passage_len"],
            "passage_template": features.get("passage_template", PASSAGE_TEMPLATE), "tasks": tasks,
            "query_encoder": QUERY_ENCODER_DIR if dual.get("separate_query_encoder") else None}


def write_encoder(directory: str, family: str, params: Any, config: dict[str, Any], max_length: int) -> None:
    """One complete Hugging Face directory (weights, tokenizer, and for BERT the sentence-transformers
    files); `max_length` is the token length of the texts it embeds (passage_len, or query_len for a
    query encoder), which tokenizer and sentence-transformers truncate to."""
    features, dual = config["features"], config["dual_encoder"]
    os.makedirs(directory, exist_ok=True)
    if family == "bert":
        cfg = BertConfig(**config["bert"])
        write_bert_dir(directory, params, cfg)
        write_bert_tokenizer(directory, features["vocabulary"], max_length)
        write_sentence_transformers(directory, cfg.hidden_size, dual["pooling"], dual["l2_normalize"], max_length)
    else:
        write_t5_dir(directory, params, T5Config(**config["t5"]))
        write_t5_tokenizer(directory, features["vocabulary"], max_length)


def export_hf(checkpoint_dir: str, output_dir: str, step: int | None = None) -> dict[str, Any]:
    """Writes `output_dir` (new, or an empty directory) atomically: a temporary sibling, then a rename.

    Returns the retrieval record written as t5r_retrieval.json.
    """
    if is_query_side_dir(checkpoint_dir):
        raise ExportError(f"{checkpoint_dir}: a query-side model (queries through its weights, passages through "
                          "its base model's); export the base model instead, a query-side model is not exported")
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise FileExistsError(f"--output_dir={output_dir} exists and is not empty; choose a new directory")
    check_exportable(checkpoint.read_config(checkpoint_dir))  # before the weights are read
    encoder = load_dual_encoder(checkpoint_dir, step, batch_size=1)
    config = encoder.config
    family = config.get("family", "t5")
    if family == "bert" and config["features"].get("vocabulary") and not is_wordpiece_path(
            config["features"]["vocabulary"]):
        raise ExportError(f"features.vocabulary={config['features']['vocabulary']!r}: a BERT model needs a WordPiece "
                          "vocab.txt")
    params = jax_to_numpy(encoder.params)
    record = retrieval_record(encoder, family)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".t5r-export-hf-", dir=parent)
    try:
        write_encoder(partial, family, params[family], config, record["passage_len"])
        if record["query_encoder"]:
            write_encoder(os.path.join(partial, QUERY_ENCODER_DIR), family, params[f"query_{family}_0"], config,
                          record["query_len"])
        write_json(os.path.join(partial, RETRIEVAL_JSON), record)
        write_json(os.path.join(partial, "model_config.json"), config)
        with open(os.path.join(partial, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(record))
        os.replace(partial, output_dir)  # rename(2) also replaces an empty directory
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return record


def jax_to_numpy(params: Any) -> Any:
    return jax.tree.map(np.asarray, jax.device_get(params))


T5_EMBED = {
    "encdec": """start = torch.zeros((len(ids), 1), dtype=torch.long)  # one decoder step from id 0
outputs = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start)
embedding = outputs.last_hidden_state[:, 0]  # the decoder's final-norm state after one step from id 0""",
    "mean": """states = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
embedding = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean over non-padding tokens""",
}


def model_card(record: dict[str, Any]) -> str:
    """README.md: how to get `t5r`'s embeddings from this directory with transformers alone."""
    tasks = "\n".join(f"| `{name}` | `{spec['query_prefix'] or '(none)'}` | {spec['query_len']} | {spec['truncation']} |"
                      for name, spec in record["tasks"].items())
    normalise = "\nembedding = torch.nn.functional.normalize(embedding, dim=-1)" if record["l2_normalize"] else ""
    if record["family"] == "bert":
        load = "model = transformers.AutoModel.from_pretrained(d).eval()"
        embed = ("states = model(input_ids=ids, attention_mask=mask).last_hidden_state\n"
                 + ("embedding = states[:, 0]  # [CLS]" if record["pooling"] == "cls" else
                    "embedding = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)"))
        family = ("a BERT dual encoder (`BertModel`), with the sentence-transformers files "
                  f"(pooling: {record['pooling']}, L2 normalisation: {record['l2_normalize']}); "
                  "`SentenceTransformer(d)` computes the same embeddings for text it is given")
        sentinel = "" if not any(spec["prefix"] for spec in record["tasks"].values()) else (
            f"\nIn a query prefix, `{BERT_SENTINEL}` is one token (id of `{BERT_SENTINEL}` in vocab.txt); "
            "BertTokenizer would split it, so insert its id yourself.\n")
    else:
        load = "model = transformers.T5Model.from_pretrained(d).eval()"
        embed = T5_EMBED[record["pooling"]]
        family = (f"a Sentence-T5 dual encoder (`T5Model`, pooling {record['pooling']!r}: "
                  + ("ST5-EncDec" if record["pooling"] == "encdec" else "ST5-Enc") + ")")
        sentinel = ""
    special = "`[CLS] text [SEP]`" if record["family"] == "bert" else "text then `</s>`"
    query_dir = (f"\nQueries go through the separate query encoder in `{record['query_encoder']}/` (same format); "
                 "passages through this directory.\n" if record["query_encoder"] else "")
    return f"""# t5r dual encoder (exported by `t5r export-hf`)

This directory is {family}.
It was trained with t5-retrieval (model fingerprint `{record['fingerprint']}`).
`{RETRIEVAL_JSON}` holds the task prefixes, lengths and pooling; `model_config.json` is the
t5r config it was exported from.
{query_dir}
## Inputs

- Query of task T: `query_prefix(T) + query`, whitespace runs collapsed to one space, KILT's `[SEP]`
  written as `{'[SEP]' if record['family'] == 'bert' else '</s>'}`; at most T's query length in tokens
  (table below, special tokens included). Truncation `beginning` keeps a long query's first tokens;
  `mention` (entity linking) keeps a window around `[START_ENT] ... [END_ENT]` (below).
- Passage: `{record['passage_template']}`; at most {record['passage_len']} tokens.
- Token ids as the tokenizer here writes them ({special}), truncated to the length, padding id 0
  masked.
{sentinel}
| task | query prefix | query length | truncation |
|---|---|---|---|
{tasks}

## Embedding with transformers

```python
import torch, transformers
d = "path/to/this/directory"
tokenizer = transformers.AutoTokenizer.from_pretrained(d)
{load}
max_length = {record['passage_len']}  # passages; for queries, their task's query length (table above)
batch = tokenizer(texts, max_length=max_length, truncation=True, padding=True, return_tensors="pt")
ids, mask = batch["input_ids"], batch["attention_mask"]
with torch.no_grad():
{indent(embed + normalise)}
```

Relevance is the dot product of a query and a passage embedding ({record['dim']} dimensions).
{mention_section(record)}"""


MENTION_WINDOW_CODE = '''def mention_window_ids(tokenizer, prefix_ids, query, length):
    """t5r's ids for a query of a task whose truncation is "mention" (whitespace normalised as above):
    the prefix, the mention with both markers, and as much context on each side as fits, half each
    (a side too short for its half leaves the rest to the other)."""
    encode = lambda text: tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
    a = query.index("[START_ENT]")
    b = query.index("[END_ENT]", a)
    left, mention, right = encode(query[:a]), encode(query[a + len("[START_ENT]"):b]), encode(query[b + len("[END_ENT]"):])
    start, end = encode("[START_ENT]"), encode("[END_ENT]")
    first, last = {special}
    budget = length - len(first) - len(last) - len(prefix_ids) - len(start) - len(end)
    mention = mention[:budget]
    rest = budget - len(mention)
    kept = min(len(left), max(rest // 2, rest - len(right)))
    return first + prefix_ids + left[len(left) - kept:] + start + mention + end + right[:rest - kept] + last'''
# The special ids around a query, as each family's tokenizer adds them.
SPECIAL_IDS = {"bert": "[tokenizer.cls_token_id], [tokenizer.sep_token_id]", "t5": "[], [tokenizer.eos_token_id]"}


def mention_section(record: dict[str, Any]) -> str:
    """The model card's code for the entity-linking window, when a task reads its queries that way."""
    tasks = [name for name, spec in record["tasks"].items() if spec["truncation"] == MENTION_WINDOW]
    if not tasks:
        return ""
    return f"""
## Entity-linking queries

Queries of {", ".join(f"`{t}`" for t in tasks)} are cut to a window around the mention, not at
their end. Their ids (`prefix_ids`: the task prefix's ids, `[]` for none; a query without both
markers is cut at its end instead):

```python
{MENTION_WINDOW_CODE.format(special=SPECIAL_IDS[record["family"]])}
```
"""


def indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())
