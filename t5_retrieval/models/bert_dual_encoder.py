"""BERT dual encoder: MT-DPR (Maillard et al. 2021) and sentence-transformers models such as MiniLM.

Same call API as `DualEncoder` (the T5 family), so the train step, trainer, inference and the
retrieval stages use either without knowing which: `__call__(tokens, deterministic, tower)`,
`embedding_dim`, `config.query_towers`. Pooling is the [CLS] state (MT-DPR) or the mean over
non-padding tokens (sentence-transformers), optionally L2-normalised. Towers: one BERT shared by
queries and passages, or a separate query BERT (one for all tasks, DPR), or one query BERT per task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import gin
import jax

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.bert import Bert, BertConfig
from t5_retrieval.models.dual_encoder import QueryTowers, l2_normalize, mean_pool
from t5_retrieval.models.families import HFImport, ModelFamily, register_family
from t5_retrieval.models.t5 import with_constraint

BERT_POOLINGS = ("cls", "mean")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class BertDualEncoderConfig(QueryTowers):
    pooling: str = "cls"  # "cls" ([CLS] state, MT-DPR/DPR) or "mean" (sentence-transformers)
    l2_normalize: bool = False
    logit_scale: float = 1.0  # similarity multiplier in the loss (1/temperature)
    query_towers: int = 0  # > 0: one query BERT per task; passages keep the shared one
    separate_query_encoder: bool = False  # one query BERT for all tasks (DPR's two towers)

    def __post_init__(self) -> None:
        if self.pooling not in BERT_POOLINGS:
            raise ConfigError(f"BertDualEncoderConfig.pooling: expected one of {BERT_POOLINGS}, "
                              f"got {self.pooling!r}")
        self.check_towers()

    @property
    def query_generation(self) -> bool:
        """GDMTL's generative objective needs a decoder; BERT has none."""
        return False


class BertDualEncoder(nn.Module):
    """Text encoder: [b, l] token ids ([CLS] ... [SEP], 0 = [PAD]) -> [b, hidden] float32 embeddings."""

    bert_config: BertConfig
    config: BertDualEncoderConfig = BertDualEncoderConfig()

    def setup(self) -> None:
        self.bert = Bert(self.bert_config)
        self.query_bert = [Bert(self.bert_config, name=f"query_bert_{k}")
                           for k in range(self.config.num_query_towers)]

    @property
    def embedding_dim(self) -> int:
        return self.bert_config.hidden_size

    def __call__(self, tokens: jax.Array, deterministic: bool = True, tower: int | None = None) -> jax.Array:
        """Embeds texts with the shared BERT, or with query tower `tower` (a static index)."""
        if self.is_initializing() and tower is None:
            for k in range(self.config.num_query_towers):  # create every tower's parameters at init
                self(tokens, deterministic, tower=k)
        (embedded,) = self.embed_groups((tokens,), deterministic, tower)
        return embedded

    def embed_groups(self, tokens: Sequence[jax.Array], deterministic: bool = True, tower: int | None = None
                     ) -> tuple[jax.Array, ...]:
        """Embeds groups of texts ([b_g, l_g] each) in one pass of the stack (`DualEncoder.embed_groups`)."""
        if tower is not None and not 0 <= tower < self.config.num_query_towers:
            raise ValueError(f"query tower {tower} requested, but the model has {self.config.num_query_towers}")
        bert = self.bert if tower is None else self.query_bert[tower]
        return tuple(self._pool(encoded, group) for encoded, group in
                     zip(bert(tokens, deterministic), tokens, strict=True))

    def _pool(self, encoded: jax.Array, tokens: jax.Array) -> jax.Array:
        if self.config.pooling == "cls":
            pooled = encoded[:, 0].astype(jax.numpy.float32)
        else:
            pooled = mean_pool(encoded, tokens != 0)
        if self.config.l2_normalize:
            pooled = l2_normalize(pooled)
        return with_constraint(pooled, ("batch", "embed"))


def bert_forward_flops(config: dict[str, Any], rows: int, length: int) -> float:
    """Matmul FLOPs (2*m*n*k each) of one encoder forward over [rows, length] tokens, padding included:
    projections, attention scores and mixing, MLP."""
    tokens = rows * length
    c = config["bert"]
    h = c["hidden_size"]
    per_layer = 2 * tokens * h * h * 4 + 2 * 2 * tokens * length * h + 2 * 2 * tokens * h * c["intermediate_size"]
    return float(per_layer * c["num_layers"])


def load_hf_bert(directory: str, target: Any, cfg: BertConfig) -> Any:
    from t5_retrieval.models import hf_bert_import  # safetensors: only when importing

    return hf_bert_import.load_bert(directory, target, cfg)


BERT_FAMILY = register_family(ModelFamily(
    name="bert", network=BertConfig, head=BertDualEncoderConfig, module=BertDualEncoder,
    depth_keys=("num_layers",), forward_flops=bert_forward_flops, dropout_keys=("dropout_rate",),
    runtime_keys=("attention",),
    hf_import=HFImport(model_type="bert", load=load_hf_bert)))
