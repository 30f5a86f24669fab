"""README.md of an exported directory: what it holds, the packages it needs, and code that gives t5r's
embeddings with sentence-transformers (when it has its files) and with transformers alone.

The code blocks are written to run as pasted (`tests/test_export_hf.py` runs them): `query_ids`
(t5r's token ids of a query of a task, from `t5r_retrieval.json`), then `encode_queries` with
sentence-transformers, then the same with transformers.
"""

from __future__ import annotations

from typing import Any

from t5_retrieval.data.tokenizers.query_inputs import MENTION_WINDOW

QUERY_IDS_CODE = '''import json
import os

import torch

d = "path/to/this/directory"
with open(os.path.join(d, "t5r_retrieval.json")) as f:
    TASKS = json.load(f)["tasks"]


def query_ids(tokenizer, query, task):
    """t5r's token ids for `query` of `task`: whitespace runs as one space, KILT's [SEP] as the
    tokenizer's separator, the task's prefix, then the query cut to the task's length; a task whose
    truncation is "mention" keeps a window around [START_ENT] mention [END_ENT] (the mention and both
    markers whole, the rest of the length split between the context on either side, half each, a
    side too short for its half leaving the rest to the other)."""
    spec = TASKS[task]
    query = " ".join(query.replace("[SEP]", tokenizer.sep_token or tokenizer.eos_token).split())
    a = query.find("[START_ENT]")
    b = query.find("[END_ENT]", a + len("[START_ENT]")) if a >= 0 else -1
    if spec["truncation"] != "mention" or b < 0:
        return tokenizer(spec["query_prefix"] + query, max_length=spec["query_len"], truncation=True)["input_ids"]
    encode = lambda text: tokenizer(text.strip(), add_special_tokens=False)["input_ids"]  # noqa: E731
    left, mention, right = encode(query[:a]), encode(query[a + len("[START_ENT]"):b]), encode(query[b + len("[END_ENT]"):])
    start, end, prefix = encode("[START_ENT]"), encode("[END_ENT]"), encode(spec["query_prefix"])
    if tokenizer.cls_token_id is not None:
        first, last = [tokenizer.cls_token_id], [tokenizer.sep_token_id]  # BERT: [CLS] ... [SEP]
    else:
        first, last = [], [tokenizer.eos_token_id]  # T5: ... </s>
    budget = spec["query_len"] - len(first) - len(last) - len(prefix) - len(start) - len(end)
    mention = mention[:budget]
    rest = budget - len(mention)
    kept = min(len(left), max(rest // 2, rest - len(right)))
    return first + prefix + left[len(left) - kept:] + start + mention + end + right[:rest - kept] + last'''

SENTENCE_TRANSFORMERS_CODE = '''from sentence_transformers import SentenceTransformer

model = SentenceTransformer(d)


def encode_queries(model, queries, task):
    """t5r's embeddings of `queries` of `task` (`query_ids`, through the query route)."""
    batch = model.tokenizer.pad({{"input_ids": [query_ids(model.tokenizer, q, task) for q in queries]}},
                                return_tensors="pt")
    features = {{"input_ids": batch["input_ids"].to(model.device),
                "attention_mask": batch["attention_mask"].to(model.device)}}
    with torch.no_grad():
        return model(features, task="query")["sentence_embedding"].cpu().numpy()


passage_embeddings = model.encode_document(passages)  # passages: "{template}" strings
query_embeddings = encode_queries(model, queries, "{task}")
scores = query_embeddings @ passage_embeddings.T'''

TRANSFORMERS_CODE = '''import transformers

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
query_embeddings = embed(query_model, [query_ids(tokenizer, q, "{task}") for q in queries])
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
        what = (f"a Sentence-T5 dual encoder (`T5Model`, "
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
        lines.append("- `sentence-transformers` >= 5.0 (tested with 5.7.0) for `SentenceTransformer(d)`.")
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
    route = ("the query route's" if record["query_encoder"] != record["passage_encoder"] else "the")
    return f"""
## sentence-transformers

`SentenceTransformer(d)` loads it in one call. `encode_document` embeds passages as t5r does.
`encode_query(queries, prompt_name=task)` puts the task's prefix (its prompt) before each query and
equals t5r for every query that fits its task's length; a longer one sentence-transformers cuts at
{route} `max_seq_length` ({record['st_query_len']} tokens), not at the task's length, and not
around an entity mention. `encode_queries` below gives t5r's embedding for every query:

```python
{SENTENCE_TRANSFORMERS_CODE.format(template=record['passage_template'], task=example_task)}
```
"""


def model_card(record: dict[str, Any]) -> str:
    """README.md for the export described by `record` (t5r_retrieval.json)."""
    tasks = "\n".join(f"| `{name}` | `{spec['query_prefix'] or '(none)'}` | {spec['query_len']} | {spec['truncation']} |"
                      for name, spec in record["tasks"].items())
    example_task = next(iter(record["tasks"]), "")
    mention = [name for name, spec in record["tasks"].items() if spec["truncation"] == MENTION_WINDOW]
    mention_note = (f" Queries of {', '.join(f'`{t}`' for t in mention)} keep a window around their entity "
                    "mention (`query_ids` below)." if mention else "")
    transformers_code = TRANSFORMERS_CODE.format(
        query_dir=record["query_encoder"], passage_dir=record["passage_encoder"], pool=pool_code(record),
        passage_len=record["passage_len"], template=record["passage_template"], task=example_task)
    return f"""# t5r dual encoder (exported by `t5r export-hf`)

This directory is {describe_model(record)}
It was trained with t5-retrieval (model fingerprint `{record['fingerprint']}`). `t5r_retrieval.json`
holds the task prefixes, lengths and pooling; `model_config.json` is the t5r config it was exported from.

## Packages

{packages(record)}

## Inputs

- A query of task T: T's prefix (the sentence-transformers prompt named T), then the query, at
  most T's query length in tokens, special tokens included (table).{mention_note}
- A passage: `{record['passage_template']}`, at most {record['passage_len']} tokens.
- Relevance: the dot product of a query and a passage embedding ({record['dim']} dimensions).

| task | query prefix (prompt) | query length | truncation |
|---|---|---|---|
{tasks}

## t5r's token ids of a query

```python
{QUERY_IDS_CODE}
```
{sentence_transformers_section(record, example_task)}
## transformers

```python
{transformers_code}
```
"""
