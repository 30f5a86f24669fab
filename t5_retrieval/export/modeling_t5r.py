"""The sentence-transformers input module of a `t5r export-hf` directory, loaded from the directory by
`SentenceTransformer(d, trust_remote_code=True)` (modules.json / router_config.json name
`modeling_t5r.T5rTransformer`). Shipped as is, so it imports nothing from t5r.

Why a module of its own: sentence-transformers cuts every text of a route at one `max_seq_length`
after putting the prompt before it, while t5r reads each task's queries at the task's own length
and keeps an entity-linking query's window around its mention (`t5r_query_ids.query_ids`). Here a
prompt is a task name tag (`config_sentence_transformers.json`: `{"kilt_fever": "<t5r-task:kilt_fever>",
"fever": "<t5r-task:kilt_fever>"}`, a task by its name or its dataset's):
`encode_query(queries, prompt_name=task)` gives t5r's ids for the task, its real prefix included;
`encode_document(passages)` tokenises passages as sentence-transformers does, at the passage length;
`encode(texts)` without a task prompt is refused.
"""

from __future__ import annotations

from typing import Any

try:  # sentence-transformers 5.7's name
    from sentence_transformers.sentence_transformer.modules import Transformer
except ImportError:  # 5.0 to 5.6
    from sentence_transformers.models import Transformer  # type: ignore[no-redef]

from .t5r_query_ids import query_ids

QUERY, PASSAGE, BOTH = "query", "passage", "both"  # what a network embeds: `role`
DOCUMENT = "document"  # sentence-transformers' task of `encode_document`


class T5rTransformer(Transformer):
    """A `Transformer` whose queries are t5r's token ids for the task their prompt names.

    `role`: "query" (a Router's query route: queries only), "passage" (its document route: passages
    only) or "both" (one network: queries from `encode_query` or with a task prompt, else passages).
    `tasks`: task name -> its prompt tag and `query_ids` spec (query_prefix, query_len, truncation).
    """

    config_keys = [*Transformer.config_keys, "role", "tasks"]

    def __init__(self, model_name_or_path: str, *, role: str = BOTH, tasks: dict[str, dict[str, Any]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model_name_or_path, **kwargs)
        self.role = role
        self.tasks = tasks or {}
        self.task_of_prompt = {spec["prompt"]: name for name, spec in self.tasks.items()}

    def preprocess(self, inputs: list[Any], prompt: str | None = None, *args: Any, task: str | None = None,
                   **kwargs: Any) -> dict[str, Any]:
        """Queries as t5r's ids of their task; passages as `Transformer` tokenises them (with the
        base's further arguments, such as 5.7's `processing_kwargs`)."""
        if self.is_query(prompt, task):
            return self.preprocess_queries(inputs, self.task_named_by(prompt))
        if prompt:
            raise ValueError("passages take no prompt: call encode_document(passages) without prompt_name "
                             "(a prompt here names a query's task)")
        return super().preprocess(inputs, None, *args, **kwargs)

    def is_query(self, prompt: str | None, task: str | None) -> bool:
        """`task` is sentence-transformers' "query"/"document" (one network only; a Router keeps it).
        Without one (`encode`), one network takes the text as a query as a Router's default route
        does, so `encode(texts)` without `prompt_name` is refused by both, never read as passages."""
        if self.role != BOTH:
            return self.role == QUERY
        return task != DOCUMENT

    def task_named_by(self, prompt: str | None) -> str:
        names = ", ".join(sorted(self.tasks))
        if not prompt:
            raise ValueError(f"a query needs its task: encode_query(queries, prompt_name=TASK), TASK one of {names} "
                             "or its dataset; passages: encode_document(passages) (encode() without prompt_name "
                             "cannot tell a query from a passage)")
        if prompt not in self.task_of_prompt:
            raise ValueError(f"prompt {prompt!r} names no task of this model: pass prompt_name=one of {names} "
                             "(a prompt here is a task tag, replaced by the task's own prefix)")
        return self.task_of_prompt[prompt]

    def preprocess_queries(self, queries: list[Any], task: str) -> dict[str, Any]:
        if not all(isinstance(q, str) for q in queries):
            raise TypeError(f"pass each query of {task} as one string (not a pair, dict or image)")
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__}: the model directory has no tokenizer")
        ids = [query_ids(tokenizer, q, self.tasks[task]) for q in queries]
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "modality": "text"}
