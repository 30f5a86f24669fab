"""`t5r export-hf`: a t5r model directory -> a directory transformers and sentence-transformers load offline.

Every model `t5r train`, `t5r query-side` and `t5r results` write is exported. T5 networks become
`T5Model` directories, BERT networks `BertModel` directories, each with its tokenizer
(`hf_tokenizers`: `tokenizer.json`, the vocabulary, `tokenizer_config.json`). One network that embeds
queries and passages is the output directory itself; two (a separate query encoder, or a query-side
model: its fine-tuned query encoder, its base's passage encoder) are `query_encoder/` and
`passage_encoder/`. When sentence-transformers can pool as the model does ([CLS] or mean; ST5-EncDec's
decoder step it cannot), its files make the directory one `SentenceTransformer` (`modeling_t5r.py`,
which reads each task's queries as t5r does, for one network or a `Router` over two; one prompt per
task: `sentence_transformers_files`). README.md (`model_card`) gives code that computes t5r's
embeddings with either library.

The tensors are written through the importers' own name maps (`hf_import.name_map`,
`hf_bert_import.name_map`) run backwards: each converter there is a reshape/transpose, so applying it
to the HF positions (`np.arange`) says where each of our values goes, and import -> export -> import
is the identity by construction rather than by a second hand-written table that could drift.

Refused, each naming its config field: per-task query towers (`dual_encoder.query_towers`) and a
projection after pooling (`dual_encoder.projection_dim`; `T5Model` has no place for it).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from t5_retrieval import checkpoint
from t5_retrieval.artefact_io import replaced_on_success
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.text import EXTRA_ID_1, PASSAGE_TEMPLATE, query_prefix
from t5_retrieval.data.tokenizers.tokenize import is_wordpiece_path
from t5_retrieval.errors import UserError
from t5_retrieval.export import portable, t5r_query_ids
from t5_retrieval.export.hf_tokenizers import (
    BERT_VOCAB_FILE,
    T5_VOCAB_FILE,
    write_bert_tokenizer,
    write_json,
    write_t5_tokenizer,
)
from t5_retrieval.export.model_card import model_card
from t5_retrieval.export.sentence_transformers_files import (
    POOLING_MODES,
    QUERY_IDS_FILE,
    ROLE_BOTH,
    ROLE_PASSAGE,
    ROLE_QUERY,
    copy_source,
    write_router,
    write_sentence_transformers,
    write_transformer_config,
)
from t5_retrieval.inference import (
    DualEncoderInference,
    QuerySideEncoder,
    load_dual_encoder,
    load_encoder,
    stored_config,
)
from t5_retrieval.models import hf_bert_import, hf_import
from t5_retrieval.models.bert import BertConfig
from t5_retrieval.models.families import family_of
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.retrieval.encoder import Encoder

FORMAT = "t5r-hf-export/2"
RETRIEVAL_JSON = t5r_query_ids.RETRIEVAL_JSON  # tasks, prefixes, lengths, pooling: what the model card explains
QUERY_ENCODER_DIR, PASSAGE_ENCODER_DIR = "query_encoder", "passage_encoder"  # when there are two networks
VOCABULARY_FILE = {"bert": BERT_VOCAB_FILE, "t5": T5_VOCAB_FILE}  # the vocabulary each network directory ships
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


def check_exportable(config: dict[str, Any]) -> None:
    """Refuses what a Hugging Face directory cannot hold, naming the model_config.json field."""
    family = family_of(config).name
    if family not in VOCABULARY_FILE:
        raise ExportError(f"family={family!r}: Hugging Face export writes {' and '.join(VOCABULARY_FILE)} models only "
                          "(docs/architecture.md, 'A new model family')")
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



@dataclasses.dataclass(frozen=True)
class Networks:
    """What an export holds: queries go through `query`'s query tower, passages through `passage`'s
    passage tower; `encoder` is how t5r embeds with the model directory (its fingerprint is the index's)."""

    encoder: Encoder
    query: DualEncoderInference
    passage: DualEncoderInference
    query_side: bool

    @property
    def query_params_key(self) -> str:
        family = family_of(self.query.config).name
        return f"query_{family}_0" if self.query.config["dual_encoder"].get("separate_query_encoder") else family

    @property
    def two_networks(self) -> bool:
        return self.query_side or self.query_params_key != family_of(self.query.config).name


def load_networks(checkpoint_dir: str, step: int | None) -> Networks:
    """A model directory's networks; a query-side one (`t5r query-side`, or `t5r train` over stored
    passage embeddings) embeds passages with its base model's passage tower."""
    if not checkpoint.is_query_side_dir(checkpoint_dir):
        model = load_dual_encoder(checkpoint_dir, step, batch_size=1)
        return Networks(model, model, model, query_side=False)
    encoder = load_encoder(checkpoint_dir, step, batch_size=1)  # checks the base's fingerprint
    assert isinstance(encoder, QuerySideEncoder)  # checkpoint.is_query_side_dir
    passage = encoder.passage_encoder
    while isinstance(passage, QuerySideEncoder):  # the base of a query-side base
        passage = passage.passage_encoder
    assert isinstance(passage, DualEncoderInference)  # the first base that is not query-side
    return Networks(encoder, encoder.query_encoder, passage, query_side=True)


def check_same_embedding(networks: Networks) -> None:
    """A query-side model must embed into its base's space: same family, pooling and normalisation."""
    fields = [("family", lambda c: family_of(c).name), ("dual_encoder.pooling", lambda c: c["dual_encoder"]["pooling"]),
              ("dual_encoder.l2_normalize", lambda c: c["dual_encoder"]["l2_normalize"])]
    for name, get in fields:
        if get(networks.query.config) != get(networks.passage.config):
            raise ExportError(f"{name}: the query model has {get(networks.query.config)!r}, its base (the passage "
                              f"encoder) {get(networks.passage.config)!r}; they cannot share one export")


def task_specs(tasks: TaskSet, family: str) -> dict[str, dict[str, Any]]:
    """Each task as the export records it: its `TaskSpec` record (`to_record`: dataset, prefix, query
    length, truncation), and its prefix as the text to put before a query (`query_prefix`, with the
    vocabulary's own sentinel token)."""
    sentinel = BERT_SENTINEL if family == "bert" else EXTRA_ID_1
    specs = {name: tasks.spec(name) for name in sorted(tasks)}
    for spec in specs.values():
        spec.query_input()  # a task the export cannot tokenise (no query length) is refused here
    return {name: {**spec.to_record(),
                   "query_prefix": query_prefix(spec.prefix).replace(EXTRA_ID_1, sentinel) + " " if spec.prefix else ""}
            for name, spec in specs.items()}


def retrieval_record(networks: Networks) -> dict[str, Any]:
    """What turns text into model inputs and the model's output into an embedding (t5r_retrieval.json)."""
    config, features = networks.query.config, networks.query.features
    family, dual = family_of(config).name, config["dual_encoder"]
    passage_features = networks.passage.features
    tasks = task_specs(networks.query.tasks, family)
    query_len = max((spec["query_len"] for spec in tasks.values()), default=features["query_len"])
    two = networks.two_networks
    return {"format": FORMAT, "family": family, "fingerprint": networks.encoder.fingerprint,
            "dim": networks.encoder.dim, "pooling": dual["pooling"], "l2_normalize": dual["l2_normalize"],
            # A dataset's name for the one task that reads it (`fever` for `kilt_fever`), as t5r's commands take.
            "task_aliases": {alias: task for alias, task in networks.query.tasks.aliases().items() if alias != task},
            # The longest task's query length (the query encoder's max_length); each task's is in "tasks".
            "query_len": query_len, "passage_len": passage_features["passage_len"],
            "passage_template": passage_features.get("passage_template", PASSAGE_TEMPLATE), "tasks": tasks,
            "query_encoder": QUERY_ENCODER_DIR if two else ".", "passage_encoder": PASSAGE_ENCODER_DIR if two else ".",
            "query_side": networks.query_side, "sentence_transformers": dual["pooling"] in POOLING_MODES}


def write_network(directory: str, params: Any, config: dict[str, Any], max_length: int, markers: list[str],
                  st_role: str | None, tasks: dict[str, dict[str, Any]]) -> None:
    """One complete Hugging Face directory: weights, tokenizer (truncating at `max_length`, the token
    length of the texts it embeds) and, unless `st_role` is None, its sentence-transformers module
    config (what it embeds, each task's queries)."""
    os.makedirs(directory, exist_ok=True)
    vocabulary = config["features"]["vocabulary"]
    if family_of(config).name == "bert":
        write_bert_dir(directory, params, BertConfig(**config["bert"]))
        write_bert_tokenizer(directory, vocabulary, max_length, markers)
    else:
        write_t5_dir(directory, params, T5Config(**config["t5"]))
        write_t5_tokenizer(directory, vocabulary, max_length)
    if st_role:
        write_transformer_config(directory, max_length, st_role, tasks)


def export_hf(checkpoint_dir: str, output_dir: str, step: int | None = None) -> dict[str, Any]:
    """Writes `output_dir` (new, or an empty directory) atomically: a temporary sibling, then a rename.

    Returns the retrieval record written as t5r_retrieval.json.
    """
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise FileExistsError(f"--output_dir={output_dir} exists and is not empty; choose a new directory")
    check_exportable(stored_config(checkpoint_dir))  # before the weights are read
    networks = load_networks(checkpoint_dir, step)
    check_exportable(networks.passage.config)
    check_same_embedding(networks)
    family = family_of(networks.query.config).name
    for model in (networks.query, networks.passage):
        vocabulary = model.features["vocabulary"]
        if family == "bert" and not is_wordpiece_path(vocabulary):
            raise ExportError(f"features.vocabulary={vocabulary!r}: a BERT model needs a WordPiece vocab.txt")
    record = retrieval_record(networks)
    prefixed = any(networks.query.tasks.spec(name).prefix for name in networks.query.tasks)
    markers = [BERT_SENTINEL] if family == "bert" and prefixed else []
    st, tasks = record["sentence_transformers"], record["tasks"]
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    with replaced_on_success(os.path.abspath(output_dir)) as partial:  # replaces an empty output_dir
        os.makedirs(partial)
        query_params = jax_to_numpy(networks.query.params[networks.query_params_key])
        passage_params = jax_to_numpy(networks.passage.params[family])
        if networks.two_networks:
            write_network(os.path.join(partial, QUERY_ENCODER_DIR), query_params, networks.query.config,
                          record["query_len"], markers, ROLE_QUERY if st else None, tasks)
            write_network(os.path.join(partial, PASSAGE_ENCODER_DIR), passage_params, networks.passage.config,
                          record["passage_len"], markers, ROLE_PASSAGE if st else None, tasks)
            if st:
                write_router(partial, QUERY_ENCODER_DIR, PASSAGE_ENCODER_DIR)
        else:
            write_network(partial, passage_params, networks.passage.config, record["passage_len"], markers,
                          ROLE_BOTH if st else None, tasks)
        if st:
            write_sentence_transformers(partial, networks.two_networks, networks.encoder.dim, record["pooling"],
                                        record["l2_normalize"], tasks, record["task_aliases"])
        write_json(os.path.join(partial, RETRIEVAL_JSON), record)
        copy_source(partial, QUERY_IDS_FILE)  # t5r's query ids, for the card's code and modeling_t5r.py
        vocabulary = os.path.join(record["query_encoder"], VOCABULARY_FILE[family])
        write_json(os.path.join(partial, "model_config.json"),
                   portable.portable_config(networks.query.config, os.path.normpath(vocabulary)))
        with open(os.path.join(partial, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(record))
        portable.finish(partial)  # `t5r checksum <dir>` verifies a copy of the export
    return record


def jax_to_numpy(params: Any) -> Any:
    return jax.tree.map(np.asarray, jax.device_get(params))
