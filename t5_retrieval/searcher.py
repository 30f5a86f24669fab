"""Search from Python, the pyserini way: open a model, its index and the KB once, then ask.

    from t5_retrieval.searcher import Searcher
    searcher = Searcher.open("run/model", "run/index", "data/kb")
    hits = searcher.search(["who founded the city"], k=10, task="fever")  # per query: [Hit, ...]

The model is opened by `inference.load_encoder`, so queries are formatted, tokenized and embedded
as in training; the index (of either backend, `index.load_index`) is checked against the model and
the KB (`Index.check`) as by every `t5r` command, so a search never mixes embedding spaces. The
search itself is `retrieval.search.dense_searcher`, the one `t5r eval`, `mine` and `serve` use. A task
is named by its dataset (`fever`), its registered name (`demo_fever`) or a seqio Mixture of one of
them, see `data.task_names`.
"""

from __future__ import annotations

from collections.abc import Sequence

from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.encoder import Encoder, warn_if_trained_on_rewritten_text
from t5_retrieval.retrieval.index import Index, load_index
from t5_retrieval.retrieval.search import Hit, dense_searcher


class Searcher:
    """One model, its index and the KB the index was built from, loaded and checked once."""

    def __init__(self, encoder: Encoder, index: Index, store: PassageStore):
        index.check(encoder, store.ids())
        self.encoder = encoder
        self.index = index
        self.store = store
        self._warned: set[str] = set()  # tasks whose rewritten training text was warned about

    @classmethod
    def open(cls, model_dir: str, index_dir: str, kb_dir: str) -> Searcher:
        """From the directories `t5r train`, `t5r index` and `t5r data kb` write."""
        return cls(load_encoder(model_dir), load_index(index_dir), PassageStore.open(kb_dir))

    def search(self, queries: Sequence[str], k: int = 10, *, task: str) -> list[list[Hit]]:
        """The top-k hits of each query, best first, with `task`'s query prefix. The text is embedded
        as given: for a task whose seqio Task's preprocessors rewrote its training queries, give it
        as they would (a warning names them, once per task).

        Raises UnknownTaskError (listing the model's tasks) for a task the model was not trained on."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, not one string")
        task = self.encoder.tasks.resolve(task)
        if task not in self._warned:
            warn_if_trained_on_rewritten_text(self.encoder, task, "Searcher.search embeds the text it is given: "
                                              "pass queries as those preprocessors would leave them")
            self._warned.add(task)
        return dense_searcher(self.encoder, self.index, task).hits(list(queries), k, self.store)
