"""t5r's token ids of a query of a task, with a Hugging Face tokenizer.

Shipped in every `t5r export-hf` directory beside `modeling_t5r.py` (the sentence-transformers module
that calls it) and used as is by the model card's transformers code, so it imports nothing from t5r
(and not even torch): it runs wherever transformers does. `tests/test_export_hf.py` checks its ids
against t5r's own (`t5_retrieval.data.tokenizers.query_inputs.query_ids`) on every demo query.

A task's spec is its entry of `t5r_retrieval.json`'s "tasks": `query_prefix` (the text put before the
query), `query_len` (ids, special tokens included) and `truncation` ("beginning" or "mention").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

RETRIEVAL_JSON = "t5r_retrieval.json"
START_ENT, END_ENT = "[START_ENT]", "[END_ENT]"
KILT_SEP = "[SEP]"


def read_tasks(directory: str) -> dict[str, dict[str, Any]]:
    """Each task's spec by its name and by its dataset's (`fever` for `kilt_fever`, where only that
    task reads the dataset), from an export directory's t5r_retrieval.json."""
    with open(os.path.join(directory, RETRIEVAL_JSON), encoding="utf-8") as f:
        record = json.load(f)
    tasks = record["tasks"]
    return {**tasks, **{alias: tasks[task] for alias, task in record.get("task_aliases", {}).items()}}


def query_ids(tokenizer: Any, query: str, spec: Mapping[str, Any]) -> list[int]:
    """t5r's token ids for `query` of the task `spec` describes: whitespace runs as one space, KILT's
    [SEP] as the tokenizer's separator, the task's prefix, then the query cut to the task's length.
    A "mention" task keeps a window around [START_ENT] mention [END_ENT] (the mention and both markers
    whole, the rest of the length split between the context on either side, half each, a side too
    short for its half leaving the rest to the other), as BLINK's bi-encoder reads a mention."""
    query = " ".join(query.replace(KILT_SEP, tokenizer.sep_token or tokenizer.eos_token).split())
    a = query.find(START_ENT)
    b = query.find(END_ENT, a + len(START_ENT)) if a >= 0 else -1
    if spec["truncation"] != "mention" or b < 0:
        return tokenizer(spec["query_prefix"] + query, max_length=spec["query_len"], truncation=True)["input_ids"]

    def encode(text: str) -> list[int]:
        return tokenizer(text.strip(), add_special_tokens=False)["input_ids"]

    left, mention, right = encode(query[:a]), encode(query[a + len(START_ENT):b]), encode(query[b + len(END_ENT):])
    start, end, prefix = encode(START_ENT), encode(END_ENT), encode(spec["query_prefix"])
    if tokenizer.cls_token_id is not None:
        first, last = [tokenizer.cls_token_id], [tokenizer.sep_token_id]  # BERT: [CLS] ... [SEP]
    else:
        first, last = [], [tokenizer.eos_token_id]  # T5: ... </s>
    budget = spec["query_len"] - len(first) - len(last) - len(prefix) - len(start) - len(end)
    mention = mention[:budget]
    rest = budget - len(mention)
    kept = min(len(left), max(rest // 2, rest - len(right)))
    return first + prefix + left[len(left) - kept:] + start + mention + end + right[:rest - kept] + last
