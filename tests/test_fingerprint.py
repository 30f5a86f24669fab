"""A model's fingerprint names its config, vocabulary, step and weights exactly, the same on every
machine: the index, embeddings and query-side models it stamps still match it after a move."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from process_harness import FAST_COMPILE_XLA_FLAGS, REPO

from t5_retrieval import checkpoint
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.inference import legacy_fingerprint_of, load_dual_encoder, weights_digest
from t5_retrieval.retrieval.exact_index import ExactIndex, build_exact_index
from t5_retrieval.retrieval.index import IndexMismatchError

PRINT_FINGERPRINT = ("import sys; from t5_retrieval.inference import load_dual_encoder; "
                     "print(load_dual_encoder(sys.argv[1]).fingerprint)")


def reference_digest(x: np.ndarray) -> int:
    """`weights_digest` in Python's integers: sum of bits x (2 position + 1), modulo 2**32."""
    bits = x.reshape(-1).view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(object)
    return int(sum(int(b) * (2 * i + 1) for i, b in enumerate(bits)) % 2**32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_weights_digest_is_exact_integer_arithmetic(dtype):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (37, 11), dtype))
    assert int(weights_digest(jnp.asarray(x))) == reference_digest(x)
    moved = np.roll(x, 1, axis=1)  # the same numbers in other places: another digest
    assert int(weights_digest(jnp.asarray(moved))) != int(weights_digest(jnp.asarray(x)))


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    """all-MiniLM-L6-v2 as `t5r results` writes it: the model whose float sums of squares moved
    between two CPU flag sets (02aedad613445823 against b34360fed028f7b9 before the exact digest)."""
    from t5_retrieval.results.minilm_rows import write_minilm_model_dir

    model_dir = str(tmp_path_factory.mktemp("minilm") / "model")
    write_minilm_model_dir(model_dir)
    return model_dir


def test_a_models_fingerprint_is_the_same_under_another_compilers_flags(minilm_dir):
    fingerprints = set()
    for flags in ("", FAST_COMPILE_XLA_FLAGS):  # the defaults, and the suite's fast-compile settings
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        done = subprocess.run([sys.executable, "-c", PRINT_FINGERPRINT, minilm_dir], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        fingerprints.add(done.stdout.split()[-1])
    assert len(fingerprints) == 1, fingerprints


def test_an_index_stamped_with_the_older_fingerprint_still_matches_its_model(minilm_dir):
    """Indexes and query-side models recorded before the exact digest keep working where they did."""
    encoder = load_dual_encoder(minilm_dir)
    ids = ["p0", "p1"]
    ExactIndex(np.zeros((2, encoder.dim), np.float32), ids, encoder.fingerprint).check(encoder, ids)
    assert "legacy_fingerprint" not in vars(encoder), "the second pass over the weights runs only when needed"
    legacy = legacy_fingerprint_of(checkpoint.read_config(minilm_dir), encoder.params, encoder.step,
                                   encoder.config.get("features", {}).get("vocabulary"))
    assert encoder.legacy_fingerprint == legacy != encoder.fingerprint
    for fingerprint in (encoder.fingerprint, legacy):
        ExactIndex(np.zeros((2, encoder.dim), np.float32), ids, fingerprint).check(encoder, ids)
    with pytest.raises(IndexMismatchError, match="re-encode the KB"):
        ExactIndex(np.zeros((2, encoder.dim), np.float32), ids, "0123456789abcdef").check(encoder, ids)


class OlderVersion:
    """The model as an older t5-retrieval saw it: the same embeddings, its fingerprint the legacy one."""

    def __init__(self, encoder):
        self.encoder, self.fingerprint, self.dim = encoder, encoder.legacy_fingerprint, encoder.dim

    def encode_passages(self, passages):
        return self.encoder.encode_passages(passages)


def test_an_encode_an_older_version_started_resumes_with_this_one(minilm_dir, tmp_path):
    """Its shards and this version's are one store, named by the fingerprint the older run recorded,
    and the index built from it takes the model."""
    encoder = load_dual_encoder(minilm_dir)
    passages = [Passage(f"p{i}", str(i), f"Page {i}", f"passage number {i} about topic {i % 3}") for i in range(6)]
    ids, out = [p.id for p in passages], str(tmp_path / "emb")
    settings = {"shard_size": 2, "batch_size": 2, "progress": False}
    embedding_store.write_embeddings(OlderVersion(encoder), passages, ids, out, process_count=2, **settings)
    assert not os.path.exists(os.path.join(out, "shard-00002-of-00003.npy")), "the older run stopped part way"
    embedding_store.write_embeddings(encoder, passages, ids, out, **settings)
    index = build_exact_index(out)
    assert index.fingerprint == encoder.legacy_fingerprint and len(index) == 6
    index.check(encoder, ids)
    np.testing.assert_allclose(index.search(encoder.encode_passages(passages[:1]), 1)[0][0], [0])
