"""BERT model structure: logical axis names everywhere, fp32 params with bf16 compute, pooling, towers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5_retrieval import sharding
from t5_retrieval.models.bert import Bert, BertConfig
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder, BertDualEncoderConfig

TINY = BertConfig(vocab_size=64, hidden_size=16, num_heads=2, intermediate_size=32, num_layers=2,
                  max_position_embeddings=16, dropout_rate=0.0)
# [CLS]=2 ... [SEP]=3, then padding
TOKENS = jnp.array([[2, 5, 6, 7, 3, 0], [2, 9, 3, 0, 0, 0]], jnp.int32)


def test_every_parameter_has_logical_axis_names():
    boxed = jax.eval_shape(lambda: Bert(TINY).init(jax.random.PRNGKey(0), (TOKENS,)))["params"]
    specs = jax.tree_util.tree_flatten_with_path(nn.get_partition_spec(boxed),
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    shapes = jax.tree.leaves(nn.unbox(boxed))
    assert len(specs) == len(shapes) == 5 + 16 * TINY.num_layers, f"expected 5 + 16 per layer, got {len(shapes)}"
    for (path, spec), shape in zip(specs, shapes):
        assert isinstance(spec, jax.sharding.PartitionSpec) and len(spec) == len(shape.shape), (
            f"{jax.tree_util.keystr(path)}: expected logical names for all {len(shape.shape)} axes, got {spec}")
        assert all(isinstance(name, str) for name in spec), f"{jax.tree_util.keystr(path)}: unnamed axis in {spec}"


def test_tensor_parallel_rules_shard_heads_mlp_and_vocab():
    boxed = jax.eval_shape(lambda: Bert(TINY).init(jax.random.PRNGKey(0), (TOKENS,)))["params"]
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), sharding.logical_axis_rules("tensor_parallel"))
    layer = specs["layers_0"]
    assert layer["attention"]["query_kernel"] == jax.sharding.PartitionSpec(None, "model", None)
    assert layer["mlp"]["wi"]["kernel"] == jax.sharding.PartitionSpec(None, "model")
    assert specs["embeddings"]["word"]["embedding"] == jax.sharding.PartitionSpec("model", None)


def test_bf16_compute_keeps_fp32_params_and_close_embeddings():
    model = BertDualEncoder(BertConfig(**{**TINY.__dict__, "dtype": "bfloat16"}))
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    assert {x.dtype for x in jax.tree.leaves(nn.unbox(params))} == {jnp.dtype("float32")}
    out = model.apply({"params": params}, TOKENS)
    assert out.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(out)))
    full = BertDualEncoder(TINY).apply({"params": params}, TOKENS)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), atol=0.1, rtol=0.1,
                               err_msg="bf16 embeddings should stay close to fp32 ones")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_pooling_ignores_padding(pooling):
    model = BertDualEncoder(TINY, BertDualEncoderConfig(pooling=pooling, l2_normalize=True))
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    a = np.asarray(model.apply({"params": params}, TOKENS))
    b = np.asarray(model.apply({"params": params}, jnp.pad(TOKENS, ((0, 0), (0, 5)))))
    np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"extra padding changed the {pooling}-pooled embedding")
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5, err_msg="l2_normalize: unit norms")
    assert model.embedding_dim == 16


def test_cls_and_mean_pooling_differ_and_mean_averages_token_states():
    params = BertDualEncoder(TINY).init(jax.random.PRNGKey(0), TOKENS)["params"]
    states = np.asarray(Bert(TINY).apply({"params": params["bert"]}, (TOKENS,))[0])
    cls = np.asarray(BertDualEncoder(TINY, BertDualEncoderConfig(pooling="cls")).apply({"params": params}, TOKENS))
    mean = np.asarray(BertDualEncoder(TINY, BertDualEncoderConfig(pooling="mean")).apply({"params": params}, TOKENS))
    np.testing.assert_allclose(cls, states[:, 0], atol=1e-6, err_msg="cls pooling must be the first token's state")
    np.testing.assert_allclose(mean[1], states[1, :3].mean(0), atol=1e-5, err_msg="mean over the 3 real tokens")


def test_tower_layouts_create_the_expected_encoders():
    layouts = {BertDualEncoderConfig(): {"bert"},
               BertDualEncoderConfig(separate_query_encoder=True): {"bert", "query_bert_0"},
               BertDualEncoderConfig(query_towers=3): {"bert", "query_bert_0", "query_bert_1", "query_bert_2"}}
    for config, expected in layouts.items():
        params = jax.eval_shape(lambda c=config: BertDualEncoder(TINY, c).init(jax.random.PRNGKey(0), TOKENS))
        assert set(params["params"]) == expected, f"{config}: expected encoders {sorted(expected)}"
    assert [BertDualEncoderConfig(separate_query_encoder=True).query_tower(k) for k in range(3)] == [0, 0, 0]
    assert [BertDualEncoderConfig(query_towers=3).query_tower(k) for k in range(3)] == [0, 1, 2]
    assert BertDualEncoderConfig().query_tower(2) is None


def test_invalid_configs_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="cls.*mean"):
        BertDualEncoderConfig(pooling="encdec")
    with pytest.raises(ValueError, match="not both"):
        BertDualEncoderConfig(query_towers=2, separate_query_encoder=True)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Bert(TINY).init(jax.random.PRNGKey(0), (jnp.ones((1, 17), jnp.int32),))


def test_rematerialised_layers_give_the_same_embeddings_and_gradients():
    model, remat = BertDualEncoder(TINY), BertDualEncoder(BertConfig(**{**TINY.__dict__, "remat": True}))
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]

    def grads(m):
        return jax.grad(lambda p: jnp.sum(m.apply({"params": p}, TOKENS) ** 2))(params)

    np.testing.assert_allclose(np.asarray(remat.apply({"params": params}, TOKENS)),
                               np.asarray(model.apply({"params": params}, TOKENS)), atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads(remat)), jax.tree.leaves(grads(model))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg="remat changed a gradient")


def test_head_major_attention_product_equals_the_direct_einsum():
    """`attend` changes only the layout XLA computes in: the values agree to float32 rounding."""
    from t5_retrieval.models.t5 import attend

    rng = np.random.default_rng(0)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 4, 7, 9)), jnp.float32), axis=-1)
    values = jnp.asarray(rng.normal(size=(3, 9, 4, 5)), jnp.float32)
    direct = jax.jit(lambda w, v: jnp.einsum("bhqs,bshk->bqhk", w, v))(weights, values)
    np.testing.assert_allclose(np.asarray(jax.jit(attend)(weights, values)), np.asarray(direct), rtol=0, atol=1e-6)
