"""The sentence-transformers files of an exported directory, loaded by
`SentenceTransformer(d, trust_remote_code=True)` (sentence-transformers 5.x; tested with 5.7.0).

- The input module is `modeling_t5r.T5rTransformer` (`modeling_t5r.py`, copied into the directory
  beside `t5r_query_ids.py`, which every export holds for the card's transformers code): a
  `Transformer` that gives each task's queries t5r's token ids (the task's length, the mention
  window of entity linking), which one `max_seq_length` cannot express.
- One network for queries and passages: `T5rTransformer` (the directory itself, role "both",
  `max_seq_length` the passage length) -> `Pooling` -> [`Normalize`].
- Two networks (DPR towers, or a query-side model: its fine-tuned query encoder and its base's
  passage encoder): a `Router` whose "query" route is `query_encoder/` (role "query") and whose
  "document" route is `passage_encoder/` (role "passage"), then the shared `Pooling` -> [`Normalize`].
  The default route is "query": `encode(q, prompt_name=task)` embeds a query as `encode_query` does,
  and `encode` without a task prompt is an error naming the tasks, never a silent choice of tower.
  One network behaves the same: `encode` without `prompt_name` is refused rather than read as passages.
- `prompts`: one task name tag per task (`task_prompt`), which the module replaces by the task's
  own prefix; a tag is unambiguous where the prefix is not (no-prefix models have "" for all). A
  dataset only one task reads is a prompt name too, with that task's tag (`fever` for
  `kilt_fever`), so `prompt_name` takes the names t5r's commands take.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from t5_retrieval.export.hf_tokenizers import write_json

POOLING_MODES = ("cls", "mean")  # what sentence-transformers' Pooling computes as t5r does
ROUTER = "sentence_transformers.models.Router"
MODULE_FILE, QUERY_IDS_FILE = "modeling_t5r.py", "t5r_query_ids.py"  # sources shipped in the export
INPUT_MODULE = "modeling_t5r.T5rTransformer"
QUERY_ROUTE, DOCUMENT_ROUTE = "query", "document"
ROLE_QUERY, ROLE_PASSAGE, ROLE_BOTH = "query", "passage", "both"  # modeling_t5r's roles


def task_prompt(task: str) -> str:
    """The prompt naming `task` (a tag, not text: `T5rTransformer` puts the task's prefix instead)."""
    return f"<t5r-task:{task}>"


def module_tasks(tasks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What `T5rTransformer` needs of each task: its prompt tag and `t5r_query_ids.query_ids`'s spec."""
    return {name: {"prompt": task_prompt(name), "query_prefix": spec["query_prefix"], "query_len": spec["query_len"],
                   "truncation": spec["truncation"]} for name, spec in tasks.items()}


def copy_source(directory: str, name: str) -> None:
    """One of the standalone sources in t5_retrieval/export/ (MODULE_FILE, QUERY_IDS_FILE) into `directory`."""
    shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), os.path.join(directory, name))


def write_transformer_config(directory: str, max_length: int, role: str, tasks: dict[str, dict[str, Any]]) -> None:
    """sentence_bert_config.json of one `T5rTransformer`: the passage length it truncates passages to,
    what it embeds (`role`) and each task's query spec (none for a passage-only network)."""
    write_json(os.path.join(directory, "sentence_bert_config.json"), {
        "max_seq_length": max_length, "do_lower_case": False, "role": role,
        "tasks": module_tasks(tasks) if role != ROLE_PASSAGE else {}})


def write_router(directory: str, query_dir: str, passage_dir: str) -> None:
    """router_config.json: queries through `query_dir`, passages (documents) through `passage_dir`."""
    write_json(os.path.join(directory, "router_config.json"), {
        "types": {query_dir: INPUT_MODULE, passage_dir: INPUT_MODULE},
        "structure": {QUERY_ROUTE: [query_dir], DOCUMENT_ROUTE: [passage_dir]},
        "parameters": {"default_route": QUERY_ROUTE, "allow_empty_key": False}})


def write_sentence_transformers(directory: str, router: bool, hidden_size: int, pooling: str, l2_normalize: bool,
                                tasks: dict[str, dict[str, Any]], aliases: dict[str, str]) -> None:
    """modules.json (the input module or a `router` over two -> Pooling -> [Normalize]), the module's
    source (it imports QUERY_IDS_FILE, which the caller writes), the pooling config and
    config_sentence_transformers.json (task prompts, similarity).
    `pooling` is one of POOLING_MODES; `aliases` (a dataset's name -> its task) are prompt names too."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": ROUTER if router else INPUT_MODULE},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if l2_normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(directory, "2_Normalize"))
    write_json(os.path.join(directory, "modules.json"), modules)
    copy_source(directory, MODULE_FILE)
    write_json(os.path.join(directory, "1_Pooling", "config.json"), {
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    prompts = {name: task_prompt(aliases.get(name, name)) for name in [*tasks, *aliases]}
    write_json(os.path.join(directory, "config_sentence_transformers.json"), {
        "model_type": "SentenceTransformer", "prompts": prompts, "default_prompt_name": None,
        "similarity_fn_name": "cosine" if l2_normalize else "dot"})
