"""DPR-MUF uncertainty: MI/confidence against NumPy, ECE by hand, temperature calibration, training."""

import math

import numpy as np
import pytest

from t5_retrieval.fusion import muf


def numpy_mutual_information(probs: np.ndarray) -> np.ndarray:
    """Independent transcription: H(mean_e p_e) - mean_e H(p_e), with 0 log 0 = 0."""
    def entropy(p):
        with np.errstate(divide="ignore", invalid="ignore"):
            return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)
    return entropy(probs.mean(axis=-2)) - entropy(probs).mean(axis=-1)


def test_members_that_agree_give_confidence_one():
    same = np.array([0.7, 0.2, 0.1, 0.0])
    probs = np.stack([same] * 4)[None]  # [1, E=4, L=4]
    assert float(muf.mutual_information(probs)[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(muf.confidence(probs)[0]) == pytest.approx(1.0, abs=1e-6), "identical members -> confidence 1"


def test_members_disagreeing_maximally_give_confidence_zero():
    probs = np.eye(6)[:4][None]  # 4 one-hot members on 4 different passages out of 6
    assert float(muf.mutual_information(probs)[0]) == pytest.approx(math.log(4), abs=1e-5)
    assert float(muf.confidence(probs)[0]) == pytest.approx(0.0, abs=1e-5), "MI = log E -> confidence 0"


def test_mutual_information_matches_numpy_on_random_distributions():
    probs = np.random.default_rng(0).dirichlet(np.full(7, 0.5), size=(50, 5)).astype(np.float32)
    expected = numpy_mutual_information(probs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(muf.mutual_information(probs)), expected, atol=1e-5,
                               err_msg="JAX MI must equal the NumPy transcription")
    np.testing.assert_allclose(np.asarray(muf.confidence(probs)), 1 - expected / math.log(5), atol=1e-5)


def test_member_probs_at_small_temperature_are_arg_max_votes_ignoring_padding():
    scores = np.array([[[0.30, 0.20, 0.90], [0.10, 0.25, 0.90], [0.30, 0.20, 0.90]]], np.float32)
    valid = np.array([[True, True, False]])  # the 0.9 candidate is padding
    probs = np.asarray(muf.member_probs(scores, valid, 1e-3))
    np.testing.assert_allclose(probs[0], [[1, 0, 0], [0, 1, 0], [1, 0, 0]], atol=1e-6)
    # votes (2/3, 1/3): MI = H(2/3, 1/3), confidence = 1 - H / log 3
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert muf.confidence_of_scores(scores, valid, 1e-3)[0] == pytest.approx(1 - h / math.log(3), abs=1e-5)


def test_expected_calibration_error_of_a_hand_case():
    conf = np.array([0.95, 0.85, 0.82, 0.25, 0.15])
    correct = np.array([1, 0, 1, 0, 1])
    # bins 9: |1-.95|/5 ; 8: 2*|.5-.835|/5 ; 2: |0-.25|/5 ; 1: |1-.15|/5
    expected = (0.05 + 2 * 0.335 + 0.25 + 0.85) / 5
    assert muf.expected_calibration_error(conf, correct, 10) == pytest.approx(expected), f"expected {expected}"
    assert muf.expected_calibration_error(np.ones(4), np.ones(4)) == 0.0, "always right at confidence 1"
    with pytest.raises(ValueError, match="equal non-empty"):
        muf.expected_calibration_error(conf, correct[:3])


def test_temperature_calibration_lowers_calibration_error():
    rng = np.random.default_rng(1)
    scores = rng.normal(0, 1e-2, size=(300, 5, 4)).astype(np.float32)  # members disagree at T=1e-3
    valid = np.ones((300, 4), bool)
    correct = rng.random(300) < 0.8  # the expert is right 80% of the time, whatever the scores
    config = muf.EnsembleConfig()
    cal = muf.calibrate_temperature(scores, valid, correct, config.temperature_grid(), config.temperature)
    assert cal.start_temperature == 1e-3 and len(cal.grid) == 25
    assert cal.ece < cal.start_ece - 0.1, (
        f"calibration should lower ECE well below {cal.start_ece:.3f}, got {cal.ece:.3f} at T={cal.temperature:g}")
    assert cal.ece == pytest.approx(min(e for _, e in cal.grid)), "the chosen temperature has the grid's least ECE"
    conf = muf.confidence_of_scores(scores, valid, cal.temperature)
    assert abs(conf.mean() - correct.mean()) < 0.1, "calibrated confidence should match the accuracy on average"


def synthetic_training_set(n: int = 96, dim: int = 8, width: int = 5, seed: int = 0) -> muf.TrainingSet:
    """The gold candidate is a fixed rotation of the query: the raw dot product does not find it."""
    rng = np.random.default_rng(seed)
    rotation = np.linalg.qr(rng.normal(size=(dim, dim)))[0]
    queries = rng.normal(size=(n, dim))
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    candidates = rng.normal(size=(n, width, dim))
    candidates /= np.linalg.norm(candidates, axis=2, keepdims=True)
    position = rng.integers(0, width, n)
    candidates[np.arange(n), position] = queries @ rotation.T
    gold = np.zeros((n, width), bool)
    gold[np.arange(n), position] = True
    return muf.TrainingSet(queries.astype(np.float32), candidates.astype(np.float32), np.ones((n, width), bool), gold)


def test_mlp_ensemble_training_lowers_the_loss_and_roundtrips(tmp_path):
    data = synthetic_training_set()
    config = muf.EnsembleConfig(num_members=3, hidden_dim=32, learning_rate=1e-2, num_epochs=40, batch_size=16,
                                train_temperature=0.2)
    import jax
    before = muf.mean_member_loss(muf.init_members(config, 8, jax.random.PRNGKey(config.seed)), data, config)
    ensemble = muf.train_ensemble(data, config, fingerprint="synthetic")
    after = muf.mean_member_loss(ensemble.params, data, config)
    history = ensemble.info["loss_per_epoch"]
    assert after < 0.5 * before, f"training should at least halve the loss: {before:.3f} -> {after:.3f}"
    assert history[-1] < history[0], f"per-epoch loss should go down: {history}"
    scores = ensemble.member_scores(data.queries[:4], data.candidates[:4])
    assert scores.shape == (4, 3, 5)
    assert not np.allclose(scores[:, 0], scores[:, 1]), "members start from different seeds and must differ"
    ensemble.save(str(tmp_path / "ens"))
    loaded = muf.Ensemble.load(str(tmp_path / "ens"))
    np.testing.assert_allclose(loaded.member_scores(data.queries[:4], data.candidates[:4]), scores, rtol=1e-6)
    assert loaded.fingerprint == "synthetic" and loaded.config == config


def test_training_set_refuses_queries_without_a_gold_candidate():
    data = synthetic_training_set(n=4)
    with pytest.raises(ValueError, match="every query needs a valid gold candidate"):
        muf.TrainingSet(data.queries, data.candidates, data.valid, np.zeros_like(data.gold))


def test_a_query_without_candidates_gets_confidence_zero_not_nan():
    scores = np.zeros((2, 3, 4), np.float32)
    valid = np.array([[True, True, False, False], [False] * 4])
    conf = muf.confidence_of_scores(scores, valid, 1e-3)
    assert conf.tolist() == [1.0, 0.0], f"equal members -> 1; nothing retrieved -> 0, got {conf}"
