"""Model-uncertainty confidence of one expert retriever: an MLP ensemble on frozen query embeddings.

DPR-MUF (Li et al. 2021, "Multi-task Dense Retrieval via Model Uncertainty Fusion for Open-Domain
Question Answering", Findings of EMNLP) fuses one expert retriever per task, weighting each expert,
per query, by how certain it is. The paper's text is not available here; this is our reading of
it, written down so that every number can be traced:

**Members.** Expert x has a frozen query encoder q(.) (dim d) and index. Member e of its ensemble
(e = 1..E, default E = 5) is a residual two-layer MLP on the frozen query embedding,

    g_e(q) = q + W2_e gelu(W1_e q + b1_e) + b2_e          (W1: d -> H, W2: H -> d, H = 256)

and scores the expert's top-L passages p_1..p_L (their frozen passage embeddings, L = 20) by
s_{e,j} = g_e(q) . p_j. The residual keeps every member close to the expert's own scores q . p_j;
members differ only by their random initialisation and the order in which they see the data (deep
ensembles), so they agree where the training data pins the mapping down and disagree elsewhere.

**Training.** Each member is trained, independently, on expert x's *own task's* train queries: for
query i the candidates are x's top-L retrieved passages; the labels are the candidates that are
gold (the example's positive passages, or passages on a gold page when it has none). If no
candidate is gold, the example's first positive passage replaces the L-th candidate (DPR-style: a
positive among hard negatives); examples with no positive at all are skipped. The loss is the
negative log marginal likelihood of the gold candidates under softmax_j(s_{e,j} / tau_train)
(tau_train = 1, DPR's NLL on raw dot products), minimised with Adam(W); the encoder and the passage
embeddings stay frozen.

**Confidence.** At a temperature T, member e's distribution over the top-L is
P_e = softmax(s_{e,.} / T). With P = mean_e P_e, the mutual information between the prediction and
the member index (the ensemble's epistemic uncertainty) is MI = H(P) - mean_e H(P_e), which lies
in [0, log E]; the per-query confidence is c = 1 - MI / log E (1 when all members agree, 0 when
they disagree maximally: E one-hot members on E different passages).

**Calibration.** T starts at 1e-3 (with small T each member is nearly its arg max, so c
measures the members' agreement on the top passage) and is chosen on dev from the grid
T0 * 10^(k / per_decade), |k| <= decades * per_decade, to minimise the expected calibration error
of c as a predictor of "the expert's own top-1 passage is on a gold page", over the dev queries of
*all* fused tasks (the confidence must be low where the expert is weak, i.e. mostly on the other
tasks' queries). ECE uses equal-width bins [b/M, (b+1)/M) (1.0 in the last bin), M = 10.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import flax.serialization
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5_retrieval import artefact_io
from t5_retrieval.errors import ConfigError

ENSEMBLE_JSON = "ensemble.json"
PARAMS_FILE = "params.msgpack"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EnsembleConfig:
    """Ensemble size and training; the temperature start and its calibration grid.

    top_l: candidates per query (the expert's top-L) for training, confidence and calibration.
    train_temperature: softmax temperature of the training loss (1 = DPR's NLL on dot products).
    weight_decay: AdamW decay of the member weights (0 = Adam), against overfitting large embeddings.
    temperature: start of the calibration grid and the value used when `calibrate` is False.
    """

    num_members: int = 5
    hidden_dim: int = 256
    top_l: int = 20
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    num_epochs: int = 10
    batch_size: int = 32
    train_temperature: float = 1.0
    temperature: float = 1e-3
    calibrate: bool = True
    calibration_decades: int = 3
    calibration_per_decade: int = 4
    num_bins: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.num_members < 2:
            raise ConfigError(f"EnsembleConfig.num_members must be >= 2 (MI needs members), got {self.num_members}")
        for name in ("hidden_dim", "top_l", "num_epochs", "batch_size", "num_bins"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EnsembleConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0 or self.train_temperature <= 0:
            raise ConfigError(f"EnsembleConfig.temperature ({self.temperature}) and train_temperature "
                              f"({self.train_temperature}) must be > 0")

    def temperature_grid(self) -> np.ndarray:
        k = np.arange(-self.calibration_decades * self.calibration_per_decade,
                      self.calibration_decades * self.calibration_per_decade + 1)
        return self.temperature * 10.0 ** (k / self.calibration_per_decade)


class MemberMLP(nn.Module):
    """g(q) = q + Dense(gelu(Dense(q))): one ensemble member (module docstring)."""

    dim: int
    hidden_dim: int

    @nn.compact
    def __call__(self, q: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.hidden_dim, name="hidden")(q))
        return q + nn.Dense(self.dim, name="out")(h)


# ------------------------------------------------------------------------------------------------
# Uncertainty: member distributions, mutual information, confidence, calibration error


def member_probs(scores: jax.Array, valid: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """softmax(scores / T) over the valid candidates: scores [..., E, L], valid [..., L] -> [..., E, L]."""
    logits = jnp.where(valid[..., None, :], scores / temperature, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def mutual_information(probs: jax.Array) -> jax.Array:
    """H(mean_e P_e) - mean_e H(P_e) in nats: probs [..., E, L] -> [...], clipped at 0 (rounding)."""
    entropy = lambda p: jnp.sum(jax.scipy.special.entr(p), axis=-1)  # noqa: E731 (0 log 0 = 0)
    mi = entropy(jnp.mean(probs, axis=-2)) - jnp.mean(entropy(probs), axis=-1)
    return jnp.maximum(mi, 0.0)


def confidence(probs: jax.Array) -> jax.Array:
    """1 - MI / log E: probs [..., E, L] -> [...] in [0, 1]."""
    return jnp.clip(1.0 - mutual_information(probs) / math.log(probs.shape[-2]), 0.0, 1.0)


@jax.jit
def _confidence_of_scores(scores: jax.Array, valid: jax.Array, temperature: jax.Array) -> jax.Array:
    # A query the expert retrieved nothing for has no distribution: it gets no say (confidence 0).
    return jnp.where(jnp.any(valid, axis=-1), confidence(member_probs(scores, valid, temperature)), 0.0)


def confidence_of_scores(scores: np.ndarray, valid: np.ndarray, temperature: float) -> np.ndarray:
    """Per-query confidence from member scores [N, E, L] and a validity mask [N, L]."""
    if len(scores) == 0:
        return np.zeros((0,), np.float32)
    return np.asarray(_confidence_of_scores(jnp.asarray(scores, jnp.float32), jnp.asarray(valid, bool),
                                            jnp.float32(temperature)))


def expected_calibration_error(conf: np.ndarray, correct: np.ndarray, num_bins: int = 10) -> float:
    """sum_b |B_b| / N * |accuracy(B_b) - mean confidence(B_b)|, equal-width bins [b/M, (b+1)/M)."""
    conf = np.asarray(conf, np.float64)
    correct = np.asarray(correct, np.float64)
    if conf.shape != correct.shape or conf.ndim != 1 or not len(conf):
        raise ValueError(f"need equal non-empty 1-d confidences and outcomes, got {conf.shape}, {correct.shape}")
    bins = np.clip(np.floor(conf * num_bins).astype(np.int64), 0, num_bins - 1)
    ece = 0.0
    for b in np.unique(bins):
        in_bin = bins == b
        ece += in_bin.mean() * abs(correct[in_bin].mean() - conf[in_bin].mean())
    return float(ece)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The chosen temperature, its ECE, the ECE at the start value, and the whole grid."""

    temperature: float
    ece: float
    start_temperature: float
    start_ece: float
    grid: tuple[tuple[float, float], ...]  # (temperature, ece)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def calibrate_temperature(scores: np.ndarray, valid: np.ndarray, correct: np.ndarray,
                          temperatures: Sequence[float] | np.ndarray, start: float, num_bins: int = 10) -> Calibration:
    """The grid temperature with the lowest ECE of `confidence` against `correct` (ties: closest to start)."""
    start_ece = expected_calibration_error(confidence_of_scores(scores, valid, start), correct, num_bins)
    grid = [(float(t), expected_calibration_error(confidence_of_scores(scores, valid, t), correct, num_bins))
            for t in temperatures]
    best_t, best_ece = min(grid, key=lambda te: (round(te[1], 12), abs(math.log(te[0] / start))))
    if start_ece <= best_ece:
        best_t, best_ece = start, start_ece
    return Calibration(best_t, best_ece, start, start_ece, tuple(grid))


# ------------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass(frozen=True)
class TrainingSet:
    """Frozen embeddings of training queries and their top-L candidates.

    queries [N, d]; candidates [N, L, d]; valid [N, L] (False = padding when fewer than L were
    retrieved); gold [N, L] (True = a gold candidate; every row has at least one).
    """

    queries: np.ndarray
    candidates: np.ndarray
    valid: np.ndarray
    gold: np.ndarray

    def __post_init__(self):
        n, width, d = self.candidates.shape
        if self.queries.shape != (n, d) or self.valid.shape != (n, width) or self.gold.shape != (n, width):
            raise ValueError(f"TrainingSet shapes disagree: queries {self.queries.shape}, candidates "
                             f"{self.candidates.shape}, valid {self.valid.shape}, gold {self.gold.shape}")
        if n and not np.all(np.any(self.gold & self.valid, axis=1)):
            raise ValueError("TrainingSet: every query needs a valid gold candidate")


def _member_nll(model: MemberMLP, params: Any, queries: jax.Array, candidates: jax.Array, valid: jax.Array,
                gold: jax.Array, train_temperature: float) -> jax.Array:
    """-log sum_{j gold} softmax_j(g(q) . p_j / tau), averaged over the batch."""
    h = model.apply({"params": params}, queries)
    logits = jnp.einsum("bd,bld->bl", h, candidates) / train_temperature
    logits = jnp.where(valid, logits, -jnp.inf)
    gold_logits = jnp.where(gold & valid, logits, -jnp.inf)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jax.nn.logsumexp(gold_logits, axis=-1))


def init_members(config: EnsembleConfig, dim: int, key: jax.Array) -> Any:
    """E independently initialised members, stacked on a leading axis."""
    model = MemberMLP(dim, config.hidden_dim)
    keys = jax.random.split(key, config.num_members)
    return jax.vmap(lambda k: model.init(k, jnp.zeros((1, dim), jnp.float32))["params"])(keys)


def train_members(data: TrainingSet, config: EnsembleConfig) -> tuple[Any, list[float]]:
    """Trains the E members (vmapped, one jit) on `data`; returns stacked params and the per-epoch loss.

    The loss is the sum of the members' losses, so each member's gradient is its own; Adam(W) is
    element-wise, so this is exactly E independent trainings. Each member draws its own batches.
    """
    n, _, dim = data.candidates.shape
    if n == 0:
        raise ValueError("train_members: no training queries with a gold candidate")
    model = MemberMLP(dim, config.hidden_dim)
    key = jax.random.PRNGKey(config.seed)
    params = init_members(config, dim, key)
    optimizer = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    opt_state = optimizer.init(params)
    arrays = tuple(jnp.asarray(a) for a in (data.queries, data.candidates, data.valid, data.gold))

    def total_loss(p, idx):
        batch = tuple(a[idx] for a in arrays)  # each [E, B, ...]
        losses = jax.vmap(lambda pe, q, c, v, g: _member_nll(model, pe, q, c, v, g, config.train_temperature))(
            p, *batch)
        return jnp.sum(losses), losses

    @jax.jit
    def step(p, state, idx):
        (_, losses), grads = jax.value_and_grad(total_loss, has_aux=True)(p, idx)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, losses

    batch = min(config.batch_size, n)
    steps_per_epoch = n // batch
    rng = np.random.default_rng(config.seed)
    history = []
    for _ in range(config.num_epochs):
        perms = np.stack([rng.permutation(n) for _ in range(config.num_members)])
        epoch_losses = []
        for s in range(steps_per_epoch):
            idx = jnp.asarray(perms[:, s * batch:(s + 1) * batch])
            params, opt_state, losses = step(params, opt_state, idx)
            epoch_losses.append(np.asarray(losses))
        history.append(float(np.mean(epoch_losses)))
    return params, history


def mean_member_loss(params: Any, data: TrainingSet, config: EnsembleConfig) -> float:
    """The members' mean training loss on all of `data` (for reporting and tests)."""
    model = MemberMLP(data.candidates.shape[-1], config.hidden_dim)
    queries, candidates, valid, gold = (jnp.asarray(a) for a in (data.queries, data.candidates, data.valid, data.gold))
    losses = jax.vmap(lambda p: _member_nll(model, p, queries, candidates, valid, gold, config.train_temperature))(params)
    return float(jnp.mean(losses))


# ------------------------------------------------------------------------------------------------
# A trained ensemble


@dataclasses.dataclass
class Ensemble:
    """A trained ensemble for one expert, its calibrated temperature and where it came from."""

    params: Any
    config: EnsembleConfig
    dim: int
    fingerprint: str  # the expert encoder's: an ensemble is only valid on its expert's embeddings
    temperature: float
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def member_scores(self, queries: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """s_{e,j} = g_e(q) . p_j: queries [N, d], candidates [N, L, d] -> [N, E, L]."""
        if len(queries) == 0:
            return np.zeros((0, self.config.num_members, candidates.shape[1]), np.float32)
        return np.asarray(_member_scores(MemberMLP(self.dim, self.config.hidden_dim), self.params,
                                         jnp.asarray(queries, jnp.float32), jnp.asarray(candidates, jnp.float32)))

    def confidence(self, queries: np.ndarray, candidates: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Per-query confidence 1 - MI / log E at the ensemble's temperature."""
        return confidence_of_scores(self.member_scores(queries, candidates), valid, self.temperature)

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, PARAMS_FILE), "wb") as f:
            f.write(flax.serialization.to_bytes(jax.device_get(self.params)))
        meta = {"config": dataclasses.asdict(self.config), "dim": self.dim, "fingerprint": self.fingerprint,
                "temperature": self.temperature, "info": self.info}
        with open(os.path.join(directory, ENSEMBLE_JSON), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    @classmethod
    def load(cls, directory: str) -> Ensemble:
        path = os.path.join(directory, ENSEMBLE_JSON)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: not an ensemble directory (no {ENSEMBLE_JSON})")
        meta = artefact_io.load_json_object(path, directory, 1 << 20, ConfigError)
        config = EnsembleConfig(**meta["config"])
        template = init_members(config, int(meta["dim"]), jax.random.PRNGKey(0))
        with open(os.path.join(directory, PARAMS_FILE), "rb") as f:
            params = flax.serialization.from_bytes(template, f.read())
        return cls(params, config, int(meta["dim"]), meta["fingerprint"], float(meta["temperature"]), meta["info"])


@functools.partial(jax.jit, static_argnums=0)
def _member_scores(model: MemberMLP, params: Any, queries: jax.Array, candidates: jax.Array) -> jax.Array:
    h = jax.vmap(lambda p: model.apply({"params": p}, queries))(params)  # [E, N, d]
    return jnp.einsum("end,nld->nel", h, candidates)


def train_ensemble(data: TrainingSet, config: EnsembleConfig, fingerprint: str) -> Ensemble:
    """Trains the members; the temperature is the start value until `calibrate` sets it."""
    params, history = train_members(data, config)
    return Ensemble(params, config, data.candidates.shape[-1], fingerprint, config.temperature,
                    {"train_queries": int(len(data.queries)), "loss_per_epoch": history})
