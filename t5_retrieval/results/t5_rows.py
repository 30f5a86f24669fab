"""The T5 rows: a tiny T5 trained from scratch, without and with GDMTL's query generation."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from t5_retrieval.results.common import train_model

# No pretrained T5 can be had offline, so the T5 rows start from scratch: t5_tiny shapes (2 layers,
# d_model 64) over a 4k sentencepiece vocabulary trained on the KB. Both sides train (ST5-EncDec
# shares one T5), so each row encodes the KB with its own model. They measure GDMTL against the same
# T5 trained without its generative objective, not against the pretrained MiniLM rows.
# Query lengths: mini-KILT's rule (docs/data.md, "Query lengths") measured with this vocabulary,
# which splits text into 1.2-1.5x as many tokens as WordPiece (the Tasks' own lengths).
T5_QUERY_LENS = {"fever": 43, "wow": 342, "hotpotqa": 48, "trex": 29, "entityquestions": 35, "entity_linking": 158}
T5_SCRATCH_BINDINGS = (
    "VOCAB_SIZE = 4096",
    "DROPOUT = 0.0",
    "LEARNING_RATE = 2e-3",
    "PER_DEVICE_BATCH = 48",
    f"QUERY_LEN = {T5_QUERY_LENS}",
    "PASSAGE_LEN = 128",
    "NUM_NEGATIVES = 1",
    "TRAIN_STEPS = 1000",
    "train.checkpoint_every = 250",
    "train.log_every = 50",
    "make_train_iterator.passage_template = '{title}: {text}'",
)
T5_VOCAB_SIZE = 4096 - 100  # T5Config.vocab_size counts the 100 sentinel ids on top of the pieces


def t5_scratch_row(run_file: str) -> Callable[..., None]:
    """A T5 row trained with `runs/<run_file>` from scratch on mini-KILT without prefixes."""

    def row(row_dir: str, data_dir: str) -> None:
        from t5_retrieval.stages import index_and_evaluate, stage

        vocab_dir = os.path.join(os.path.dirname(row_dir), "t5_vocabulary")
        stage(vocab_dir, "T5 vocabulary", lambda: train_t5_vocabulary(data_dir, vocab_dir))
        model_dir = os.path.join(row_dir, "model")
        gin_bindings = [f"DATA_DIR = '{data_dir}'", "MIXTURE_OR_TASK_NAME = 'mini_kilt_noprefix'", *T5_SCRATCH_BINDINGS,
                        f"VOCABULARY = '{os.path.join(vocab_dir, 'spm.model')}'"]
        stage(model_dir, f"train {run_file} (T5 from scratch)",
              lambda: train_model(model_dir, ["models/t5_tiny.gin", f"runs/{run_file}"], gin_bindings))
        index_and_evaluate(row_dir, model_dir, data_dir)

    return row


def train_t5_vocabulary(data_dir: str, vocab_dir: str) -> dict[str, Any]:
    from t5_retrieval.data import layout
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    return {"model": train_vocabulary(layout.kb_dir(data_dir), os.path.join(vocab_dir, "spm"), T5_VOCAB_SIZE)}
