"""Model structure: logical axis names everywhere, fp32 params with bf16 compute, pooling switches."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_equations import equations

from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5, T5Config, relative_position_bucket

TINY = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=2,
                num_decoder_layers=1, dropout_rate=0.0)
TOKENS = jnp.array([[5, 6, 7, 1, 0, 0], [9, 1, 0, 0, 0, 0]], jnp.int32)


@pytest.mark.parametrize("activation,tied", [("relu", True), ("gated-gelu", False)])
def test_every_parameter_has_logical_axis_names(activation, tied):
    cfg = T5Config(**{**TINY.__dict__, "mlp_activation": activation, "tie_word_embeddings": tied})
    boxed = jax.eval_shape(lambda: T5(cfg).init(jax.random.PRNGKey(0), TOKENS, TOKENS[:, :2]))["params"]
    specs = jax.tree_util.tree_flatten_with_path(nn.get_partition_spec(boxed),
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    shapes = jax.tree.leaves(nn.unbox(boxed))
    assert len(specs) == len(shapes)
    for (path, spec), shape in zip(specs, shapes):
        assert isinstance(spec, jax.sharding.PartitionSpec) and len(spec) == len(shape.shape), (
            f"{jax.tree_util.keystr(path)}: expected logical names for all {len(shape.shape)} axes, got {spec}")
        assert all(isinstance(name, str) for name in spec), f"{jax.tree_util.keystr(path)}: unnamed axis in {spec}"


def test_bf16_compute_keeps_fp32_params_and_finite_embeddings():
    cfg = T5Config(**{**TINY.__dict__, "dtype": "bfloat16"})
    model = DualEncoder(cfg)
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    assert {x.dtype for x in jax.tree.leaves(nn.unbox(params))} == {jnp.dtype("float32")}
    out = model.apply({"params": params}, TOKENS)
    assert out.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(out)))
    full = DualEncoder(TINY).apply({"params": params}, TOKENS)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), atol=0.1, rtol=0.1,
                               err_msg="bf16 embeddings should stay close to fp32 ones")


def _matmul_output_dtypes(model: DualEncoder, params) -> list[jnp.dtype]:
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, TOKENS))(params).jaxpr
    return [eqn.outvars[0].aval.dtype for eqn in equations(jaxpr) if eqn.primitive.name == "dot_general"]


def test_bf16_attention_logits_when_asked_keep_every_matmul_in_bf16_and_embed_close():
    """By default attention logits and softmax are float32 under bf16 compute (the only float32
    matmul outputs); `float32_attention_logits=False` computes them in bf16, as t5x does."""
    bf16 = T5Config(**{**TINY.__dict__, "dtype": "bfloat16"})
    params = DualEncoder(bf16).init(jax.random.PRNGKey(0), TOKENS)["params"]
    default = DualEncoder(bf16)
    in_bf16 = DualEncoder(T5Config(**{**bf16.__dict__, "float32_attention_logits": False}))
    assert jnp.float32 in _matmul_output_dtypes(default, params)
    assert set(_matmul_output_dtypes(in_bf16, params)) == {jnp.dtype("bfloat16")}
    out, reference = in_bf16.apply({"params": params}, TOKENS), default.apply({"params": params}, TOKENS)
    assert np.all(np.isfinite(np.asarray(out))), "padding's masked logits must not overflow in bf16"
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=0.05, rtol=0.05)
    assert not np.array_equal(np.asarray(out), np.asarray(reference)), "the option must change the computation"


def test_st5_enc_switches_project_and_normalise():
    cfg = DualEncoderConfig(pooling="mean", projection_dim=12, l2_normalize=True)
    model = DualEncoder(TINY, cfg)
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    assert "decoder" not in nn.unbox(params)["t5"], "mean pooling must not create decoder weights"
    out = np.asarray(model.apply({"params": params}, TOKENS))
    assert out.shape == (2, 12) and model.embedding_dim == 12
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)


def test_unknown_pooling_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="encdec.*mean"):
        DualEncoderConfig(pooling="cls")


def test_relative_position_buckets_match_t5_reference_values():
    # Bidirectional, 32 buckets, max distance 128: exact below 8, log-spaced up to 15, sign in the top half.
    rel = jnp.array([-200, -9, -8, -7, -1, 0, 1, 7, 8, 100, 200])
    got = np.asarray(relative_position_bucket(rel, True, 32, 128))
    np.testing.assert_array_equal(got, [15, 8, 8, 7, 1, 0, 17, 23, 24, 31, 31])
    # Causal: future positions all map to 0.
    got = np.asarray(relative_position_bucket(jnp.array([3, 0, -1, -20]), False, 32, 128))
    np.testing.assert_array_equal(got, [0, 0, 1, 17])
