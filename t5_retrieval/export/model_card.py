"""README.md of an exported directory: what it holds, the packages it needs, and code that gives t5r's
embeddings with sentence-transformers (when it has its files) and with transformers alone.

Each code block runs as pasted (`tests/test_export_hf.py` runs them): sentence-transformers (the
directory's `modeling_t5r.py` reads queries as t5r does), then transformers with the
directory's `t5r_query_ids.py` (t5r's token ids of a query of a task).
"""

from __future__ import annotations

from typing import Any

from t5_retrieval.data.tokenizers.query_inputs import MENTION_WINDOW

SENTENCE_TRANSFORMERS_CODE = '''from sentence_transformers import SentenceTransformer

d = "path/to/this/directory"
model = SentenceTransformer(d, trust_remote_code=True)  # runs this directory's modeling_t5r.py
passage_embeddings = model.encode_document(passages)  # passages: "{template}" strings
query_embeddings = model.encode_query(queries, prompt_name="{task}")  # prompt_name: the queries' task
scores = query_embeddings @ passage_embeddings.T'''

TRANSFORMERS_CODE = '''import os
import sys

import torch
import transformers

d = "path/to/this/directory"
sys.path.insert(0, d)
dont_write_before, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__/ in this directory
from t5r_query_ids import query_ids, read_tasks  # noqa: E402  t5r's token ids of a query of a task

sys.dont_write_bytecode = dont_write_before

TASKS = read_tasks(d)  # each task's prefix, query length and truncation
tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(d, "{query_dir}"))
query_model = transformers.AutoModel.from_pretrained(os.path.join(d, "{query_dir}")).eval()
passage_model = transformers.AutoModel.from_pretrained(os.path.join(d, "{passage_dir}")).eval()


def embed(model, token_ids):
    batch = tokenizer.pad({{"input_ids": token_ids}}, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
{pool}
    return embedding.numpy()


passage_ids = tokenizer(passages, max_length={passage_len}, truncation=True)["input_ids"]  # "{template}"
passage_embeddings = embed(passage_model, passage_ids)
query_embeddings = embed(query_model, [query_ids(tokenizer, q, TASKS["{task}"]) for q in queries])
scores = query_embeddings @ passage_embeddings.T'''

POOL_CODE = {
    "encdec": """start = torch.zeros((len(ids), 1), dtype=torch.long)  # one decoder step from id 0
embedding = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start).last_hidden_state[:, 0]""",
    "mean": """states = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
embedding = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean over non-padding tokens""",
    "cls": """embedding = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]  # [CLS]""",
}
BERT_MEAN_POOL = """states = model(input_ids=ids, attention_mask=mask).last_hidden_state
embedding = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean over non-padding tokens"""


def pool_code(record: dict[str, Any]) -> str:
    code = BERT_MEAN_POOL if (record["family"], record["pooling"]) == ("bert", "mean") else POOL_CODE[record["pooling"]]
    if record["l2_normalize"]:
        code += "\nembedding = torch.nn.functional.normalize(embedding, dim=-1)"
    return "\n".join("        " + line for line in code.splitlines())


def describe_model(record: dict[str, Any]) -> str:
    if record["family"] == "bert":
        what = f"a BERT dual encoder (`BertModel`, {record['pooling']} pooling"
    else:
        what = ("a Sentence-T5 dual encoder (`T5Model`, "
                + ("ST5-EncDec: one decoder step from id 0" if record["pooling"] == "encdec" else "ST5-Enc: mean pooling"))
    what += ", L2-normalised)" if record["l2_normalize"] else ")"
    if record["query_encoder"] == record["passage_encoder"]:
        return what + "; queries and passages go through the same network, this directory."
    query, passage = ("the fine-tuned query encoder of a query-side model", "its base model's passage encoder") \
        if record["query_side"] else ("its query encoder", "its passage encoder")
    return (what + f" with two networks: `{record['query_encoder']}/` is {query}, `{record['passage_encoder']}/` "
            f"{passage} (each a complete transformers directory).")


def packages(record: dict[str, Any]) -> str:
    lines = ["- `transformers` (>= 5; exported and tested with 5.23.0) and `torch`."]
    if record["sentence_transformers"]:
        lines.append("- `sentence-transformers` 5.x (tested with 5.7.0) for "
                     "`SentenceTransformer(d, trust_remote_code=True)`.")
    if record["family"] == "t5":
        lines.append("- The tokenizer is `tokenizer.json` (no `sentencepiece` needed to load it). `spiece.model`, the "
                     "original sentencepiece model, needs `sentencepiece` and `protobuf` to be read.")
    return "\n".join(lines)


def sentence_transformers_section(record: dict[str, Any], example_task: str) -> str:
    if not record["sentence_transformers"]:
        return f"""
## sentence-transformers

This is not a sentence-transformers model (no modules.json): sentence-transformers has no
{record['pooling']!r} pooling. `SentenceTransformer(d)` on it builds sentence-transformers' default
for a plain transformers directory, a mean-pooled T5 encoder, which does not compute this model's
embeddings; use the transformers code below.
"""
    return f"""
## sentence-transformers

`SentenceTransformer(d, trust_remote_code=True)` loads it in one call; `trust_remote_code` lets it
run `modeling_t5r.py` from this directory (a short file worth reading first: a sentence-transformers
`Transformer` that builds t5r's token ids of a query with `t5r_query_ids.py`). A prompt here is a
task name tag: `encode_query(queries, prompt_name=task)` (or `encode(queries, prompt_name=task)`)
reads each query as t5r reads that task's: its prefix, its length, its truncation. `task` is a
task's name or its dataset's (the table). `encode_document(passages)` embeds passages at the
passage length. A query without a task prompt is an error naming the tasks, and so is
`encode(texts)` without `prompt_name`: it cannot tell a query from a passage.

```python
{SENTENCE_TRANSFORMERS_CODE.format(template=record['passage_template'], task=example_task)}
```
"""


def model_card(record: dict[str, Any]) -> str:
    """README.md for the export described by `record` (t5r_retrieval.json)."""
    also = {task: alias for alias, task in record["task_aliases"].items()}
    tasks = "\n".join(f"| `{name}`{f' or `{also[name]}`' if name in also else ''} "
                      f"| `{spec['query_prefix'] or '(none)'}` | {spec['query_len']} | {spec['truncation']} |"
                      for name, spec in record["tasks"].items())
    example_task = next(iter(record["tasks"]), "")
    mention = [name for name, spec in record["tasks"].items() if spec["truncation"] == MENTION_WINDOW]
    mention_note = (f" Queries of {', '.join(f'`{t}`' for t in mention)} keep a window around their entity "
                    "mention (`query_ids` in `t5r_query_ids.py`)." if mention else "")
    transformers_code = TRANSFORMERS_CODE.format(
        query_dir=record["query_encoder"], passage_dir=record["passage_encoder"], pool=pool_code(record),
        passage_len=record["passage_len"], template=record["passage_template"], task=example_task)
    return f"""# t5r dual encoder (exported by `t5r export-hf`)

This directory is {describe_model(record)}
It was trained with t5-retrieval (model fingerprint `{record['fingerprint']}`). `t5r_retrieval.json`
holds the task prefixes, lengths and pooling; `model_config.json` is the t5r config it was exported from;
`t5r_query_ids.py` turns a query of a task into t5r's token ids (the code below uses it).

## Packages

{packages(record)}

## Inputs

- A query of task T: T's prefix, then the query, at most T's query length in tokens, special
  tokens included (table).{mention_note}
- A passage: `{record['passage_template']}`, at most {record['passage_len']} tokens.
- Relevance: the dot product of a query and a passage embedding ({record['dim']} dimensions).

| task (`prompt_name`) | query prefix | query length | truncation |
|---|---|---|---|
{tasks}
{sentence_transformers_section(record, example_task)}
## transformers

```python
{transformers_code}
```
"""
