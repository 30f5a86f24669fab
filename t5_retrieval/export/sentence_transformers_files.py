"""The sentence-transformers files of an exported directory, in the format sentence-transformers 5.0
onwards loads natively (module names `sentence_transformers.models.*`, which 5.7 and 6.x still map).

- One network for queries and passages: `Transformer` (the directory itself) -> `Pooling` ->
  [`Normalize`], `max_seq_length` the passage length.
- Two networks (DPR towers, or a query-side model: its fine-tuned query encoder and its base's
  passage encoder): a `Router` whose "query" route is `query_encoder/` (at the longest task's query
  length) and whose "document" route is `passage_encoder/` (at the passage length), then the shared
  `Pooling` -> [`Normalize`]; `encode_query` / `encode_document` pick the route. There is no default
  route: `encode` without a task is an error rather than a silent choice of tower.
- `prompts`: each task's prefix as the text put before its queries (`encode_query(q, prompt_name=task)`).

sentence-transformers truncates every query of a route at one `max_seq_length`, while t5r cuts each
task's at its own length (entity linking around its mention): the model card's `encode_queries`
gives t5r's ids for every query, and `encode_query(q, prompt_name=task)` equals it for every query
that fits its task's length.
"""

from __future__ import annotations

import os
from typing import Any

from t5_retrieval.export.hf_tokenizers import write_json

POOLING_MODES = ("cls", "mean")  # what sentence-transformers' Pooling computes as t5r does
TRANSFORMER = "sentence_transformers.models.Transformer"
ROUTER = "sentence_transformers.models.Router"
QUERY_ROUTE, DOCUMENT_ROUTE = "query", "document"


def write_transformer_config(directory: str, max_length: int) -> None:
    """sentence_bert_config.json of one `Transformer` module: the token length it truncates to."""
    write_json(os.path.join(directory, "sentence_bert_config.json"), {"max_seq_length": max_length,
                                                                      "do_lower_case": False})


def write_router(directory: str, query_dir: str, passage_dir: str) -> None:
    """router_config.json: queries through `query_dir`, passages (documents) through `passage_dir`."""
    write_json(os.path.join(directory, "router_config.json"), {
        "types": {query_dir: TRANSFORMER, passage_dir: TRANSFORMER},
        "structure": {QUERY_ROUTE: [query_dir], DOCUMENT_ROUTE: [passage_dir]},
        "parameters": {"default_route": None, "allow_empty_key": False}})


def write_sentence_transformers(directory: str, input_module: str, hidden_size: int, pooling: str,
                                l2_normalize: bool, prompts: dict[str, str]) -> None:
    """modules.json (`input_module` -> Pooling -> [Normalize]), the pooling config and
    config_sentence_transformers.json (prompts, similarity). `pooling` is one of POOLING_MODES."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": input_module},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if l2_normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(directory, "2_Normalize"))
    write_json(os.path.join(directory, "modules.json"), modules)
    write_json(os.path.join(directory, "1_Pooling", "config.json"), {
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    write_json(os.path.join(directory, "config_sentence_transformers.json"), st_model_config(prompts, l2_normalize))


def st_model_config(prompts: dict[str, str], l2_normalize: bool) -> dict[str, Any]:
    return {"model_type": "SentenceTransformer", "prompts": prompts, "default_prompt_name": None,
            "similarity_fn_name": "cosine" if l2_normalize else "dot"}
