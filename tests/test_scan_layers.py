"""`scan_layers` compiles one layer body instead of one copy per layer, with the same parameters and
results as the unrolled stack: forward outputs and gradients, rematerialised or not, and the train step."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jaxpr_equations import equations

from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.models import t5
from t5_retrieval.models.bert import Bert, BertConfig
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5, T5Config
from t5_retrieval.train_step import summed_gradient

T5_CFG = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=3,
                  num_decoder_layers=2, dropout_rate=0.0)
BERT_CFG = BertConfig(vocab_size=64, hidden_size=16, num_heads=2, intermediate_size=32, num_layers=3,
                      max_position_embeddings=16, dropout_rate=0.0)
TOKENS = jnp.array([[5, 9, 3, 7, 0, 0], [4, 8, 2, 6, 1, 11]], jnp.int32)
DECODER_TOKENS = jnp.array([[0, 3, 5], [0, 2, 9]], jnp.int32)


def _t5_loss(cfg: T5Config, params: dict, deterministic: bool = True, rng: jax.Array | None = None) -> jax.Array:
    rngs = {} if rng is None else {"dropout": rng}
    logits = T5(cfg).apply({"params": params}, TOKENS, DECODER_TOKENS, deterministic, rngs=rngs)
    return jnp.mean(jnp.square(logits))


def _bert_loss(cfg: BertConfig, params: dict) -> jax.Array:
    return jnp.mean(jnp.square(Bert(cfg).apply({"params": params}, (TOKENS,))[0]))


def _assert_trees_close(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def _t5_params() -> dict:
    return T5(T5_CFG).init(jax.random.PRNGKey(0), TOKENS, DECODER_TOKENS)["params"]


def _assert_scan_matches_unrolled(loss_fn, cfg, params) -> None:
    """The loss and its gradients with the layers scanned, with and without remat, equal the unrolled ones."""
    unrolled_loss, unrolled_grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(cfg, p)))(params)
    for remat in (False, True):
        scanned = dataclasses.replace(cfg, scan_layers=True, remat=remat)
        loss, grad = jax.jit(jax.value_and_grad(lambda p, c=scanned: loss_fn(c, p)))(params)
        np.testing.assert_allclose(float(loss), float(unrolled_loss), rtol=1e-6)
        _assert_trees_close(grad, unrolled_grad)


def test_scanned_t5_initialises_the_unrolled_parameter_tree():
    scanned = dataclasses.replace(T5_CFG, scan_layers=True)
    shapes = jax.eval_shape(lambda: T5(scanned).init(jax.random.PRNGKey(0), TOKENS, DECODER_TOKENS))["params"]
    reference = jax.tree.map(lambda x: (x.shape, x.dtype), _t5_params())
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == reference
    assert "layers_2" in shapes["encoder"] and "layers_1" in shapes["decoder"]


def test_scanned_t5_encode_decode_and_gradients_match_unrolled():
    params = _t5_params()
    _assert_scan_matches_unrolled(_t5_loss, T5_CFG, params)
    encoded = T5(T5_CFG).apply({"params": params}, (TOKENS,), method=T5.encode)[0]
    scanned = T5(dataclasses.replace(T5_CFG, scan_layers=True)).apply({"params": params}, (TOKENS,), method=T5.encode)[0]
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(encoded), atol=1e-5)


def test_scanned_bert_outputs_and_gradients_match_unrolled():
    _assert_scan_matches_unrolled(_bert_loss, BERT_CFG, Bert(BERT_CFG).init(jax.random.PRNGKey(0), (TOKENS,))["params"])


def _scan_outputs(jaxpr: jax.extend.core.Jaxpr) -> list[jax.core.ShapedArray]:
    """The stacked outputs (ys) of every `scan` in `jaxpr`, nested ones included."""
    return [v.aval for eqn in equations(jaxpr) if eqn.primitive.name == "scan"
            for v in eqn.outvars[eqn.params["num_carry"]:]]


def _assert_bf16_stacking_is_float32_stacking(monkeypatch, grad_fn, params: dict, layer_params: dict,
                                              layers: int) -> None:
    """`grad_fn` (bf16 activations, scanned layers) outputs every stacked matrix of its scans in bf16,
    and its loss and float32 gradients are bit for bit those with the matrices stacked in float32."""
    matrices = {(layers, *x.shape) for x in jax.tree.leaves(layer_params) if x.ndim >= 2}
    stacked = [a for a in _scan_outputs(jax.make_jaxpr(grad_fn)(params).jaxpr) if a.shape in matrices]
    assert stacked and {a.dtype for a in stacked} == {jnp.dtype(jnp.bfloat16)}, stacked
    loss, grad = jax.jit(grad_fn)(params)
    float32_stacking = functools.partial(t5._stack_layers, matrix_dtype=jnp.float32)
    with monkeypatch.context() as patch:
        patch.setattr(t5, "_stack_layers", lambda p, n, matrix_dtype: float32_stacking(p, n))
        reference_loss, reference_grad = jax.jit(grad_fn)(params)
    assert {x.dtype for x in jax.tree.leaves(grad)} == {jnp.dtype(jnp.float32)}
    assert float(loss) == float(reference_loss)
    for x, y in zip(jax.tree.leaves(grad), jax.tree.leaves(reference_grad), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_scanned_bf16_layers_build_their_matrices_gradients_in_bf16_and_compute_the_same(monkeypatch):
    """With bf16 activations the stacked copy of the layers' matrices is bf16, so the gradient each
    scan's backward pass stacks up for it is bf16, not float32 (half the memory of those stacks, which
    held most of T5-XXL's temporaries). The layers cast their matrices at use anyway, so loss and
    float32 gradients are bit for bit those of float32 stacking: T5 with dropout, with and without
    remat, and BERT."""
    params = _t5_params()
    for remat in (False, True):
        cfg = dataclasses.replace(T5_CFG, dtype="bfloat16", dropout_rate=0.2, scan_layers=True, remat=remat)
        grad_fn = jax.value_and_grad(lambda p, c=cfg: _t5_loss(c, p, False, jax.random.PRNGKey(3)))
        _assert_bf16_stacking_is_float32_stacking(monkeypatch, grad_fn, params, params["encoder"]["layers_0"],
                                                  T5_CFG.num_encoder_layers)
    bert = dataclasses.replace(BERT_CFG, dtype="bfloat16", scan_layers=True)
    params = Bert(BERT_CFG).init(jax.random.PRNGKey(0), (TOKENS,))["params"]
    _assert_bf16_stacking_is_float32_stacking(monkeypatch, jax.value_and_grad(lambda p: _bert_loss(bert, p)), params,
                                              params["layers_0"], BERT_CFG.num_layers)


def test_scanned_dropout_draws_a_different_mask_per_layer():
    cfg = dataclasses.replace(T5_CFG, dropout_rate=0.5, scan_layers=True)
    params = _t5_params()
    same = jax.tree.map(lambda x: x, params)
    for stack in ("encoder", "decoder"):  # every layer identical: only the dropout masks tell them apart
        layers = [k for k in same[stack] if k.startswith("layers_")]
        same[stack] = {**same[stack], **{k: same[stack]["layers_0"] for k in layers}}
    loss = jax.jit(lambda p, r: _t5_loss(cfg, p, False, r))
    a, b = loss(same, jax.random.PRNGKey(1)), loss(same, jax.random.PRNGKey(2))
    assert np.isfinite(float(a)) and float(a) != float(b)
    assert float(a) != float(_t5_loss(cfg, same)), "dropout should change the output"
    grads = jax.jit(jax.grad(lambda p: _t5_loss(cfg, p, False, jax.random.PRNGKey(1))))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_train_step_gradient_with_scanned_layers_matches_unrolled():
    tasks = ["a", "b"]
    batch = next(RandomBatches(per_device_batch=4, local_data_devices=1, task_names=tasks, vocab_size=64,
                               query_len=6, passage_len=10, num_negatives=1))
    unrolled, scanned = DualEncoder(T5_CFG), DualEncoder(dataclasses.replace(T5_CFG, scan_layers=True))
    params = unrolled.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    rng = jax.random.PRNGKey(1)
    expected, expected_losses, _ = jax.jit(lambda p: summed_gradient(unrolled, 1.0, p, batch, tasks, rng))(params)
    grad, losses, _ = jax.jit(lambda p: summed_gradient(scanned, 1.0, p, batch, tasks, rng))(params)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(expected_losses), rtol=1e-5)
    _assert_trees_close(grad, expected)


def test_rematerialised_unrolled_t5_initialises_and_matches_with_dropout():
    """Remat keeps `deterministic` static (a traced flag cannot choose dropout): init works, and with
    dropout on the loss and gradients equal the plain stack's, in float32 and bfloat16 activations."""
    for dtype in ("float32", "bfloat16"):
        plain = dataclasses.replace(T5_CFG, dropout_rate=0.3, dtype=dtype)
        remat = dataclasses.replace(plain, remat=True)
        params = T5(remat).init(jax.random.PRNGKey(0), TOKENS, DECODER_TOKENS)["params"]
        rng = jax.random.PRNGKey(3)
        expected = jax.jit(jax.value_and_grad(lambda p, c=plain, r=rng: _t5_loss(c, p, False, r)))(params)
        got = jax.jit(jax.value_and_grad(lambda p, c=remat, r=rng: _t5_loss(c, p, False, r)))(params)
        np.testing.assert_allclose(float(got[0]), float(expected[0]), rtol=1e-2 if dtype == "bfloat16" else 1e-6)
        if dtype == "float32":
            _assert_trees_close(got[1], expected[1])


def _dot_count(cfg: T5Config, params: dict) -> int:
    """dot_generals in the gradient's program, inside scans and remat included (a recomputed
    forward matmul counts again)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: _t5_loss(cfg, p)))(params).jaxpr
    return sum(eqn.primitive.name == "dot_general" for eqn in equations(jaxpr))


def test_remat_policies_give_the_plain_gradients_and_recompute_less_as_they_save_more():
    """Each `T5Config.remat_policy`, unrolled and scanned: the plain stack's loss and gradients. Saving
    the weight matmuls' outputs recomputes fewer matmuls than saving nothing, every matmul none."""
    from t5_retrieval.models.t5 import REMAT_POLICIES

    params = _t5_params()
    expected = jax.jit(jax.value_and_grad(lambda p: _t5_loss(T5_CFG, p)))(params)
    for scan in (False, True):
        dots = {}
        for policy in REMAT_POLICIES:
            cfg = dataclasses.replace(T5_CFG, remat=True, remat_policy=policy, scan_layers=scan)
            loss, grad = jax.jit(jax.value_and_grad(lambda p, c=cfg: _t5_loss(c, p)))(params)
            np.testing.assert_allclose(float(loss), float(expected[0]), rtol=1e-6)
            _assert_trees_close(grad, expected[1])
            dots[policy] = _dot_count(cfg, params)
        plain = _dot_count(dataclasses.replace(T5_CFG, scan_layers=scan), params)
        assert dots["nothing_saveable"] > dots["dots_with_no_batch_dims_saveable"] > dots["dots_saveable"], dots
        assert dots["dots_saveable"] == plain, (dots, plain)


def test_an_unknown_remat_policy_is_a_config_error():
    import pytest

    from t5_retrieval.errors import ConfigError

    with pytest.raises(ConfigError, match="T5Config.remat_policy: expected one of"):
        dataclasses.replace(T5_CFG, remat_policy="save_everything")


def _scan_count(fn, *args) -> int:
    return sum(eqn.primitive.name == "scan" for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr))


def test_groups_of_texts_share_one_pass_of_each_stack_and_embed_as_they_would_alone():
    """`embed_groups` takes texts of several shapes through one scan of each stack (one loop to
    compile, one stack of weight gradients, each layer's weights read once), and embeds each group
    as a call of its own would; the naive train step sends its query lengths and passages that way."""
    groups = (TOKENS, TOKENS[:, :4], jnp.tile(TOKENS, (2, 2)))
    models = (DualEncoder(dataclasses.replace(T5_CFG, scan_layers=True, remat=True)),
              BertDualEncoder(dataclasses.replace(BERT_CFG, scan_layers=True, remat=True)))
    for model in models:
        params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
        together = model.apply({"params": params}, groups, method="embed_groups")
        for group, embedded in zip(groups, together, strict=True):
            alone = model.apply({"params": params}, group)
            np.testing.assert_allclose(np.asarray(embedded), np.asarray(alone), atol=1e-6)

        def loss(p, texts, model=model):
            return sum(jnp.sum(e ** 2) for e in model.apply({"params": p}, texts, method="embed_groups"))

        one_group = _scan_count(jax.grad(loss), params, groups[:1])
        assert one_group >= 2 and _scan_count(jax.grad(loss), params, groups) == one_group

    tasks = ["a", "b"]
    rows = jax.random.randint(jax.random.PRNGKey(2), (3, 8, 10), 1, 64)
    batch = {"a": {"query_tokens": rows[0, :4, :6], "passage_tokens": rows[1]},
             "b": {"query_tokens": rows[0, 4:, :9], "passage_tokens": rows[2]}}
    model = models[0]
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    step = functools.partial(summed_gradient, model, 1.0, batch=batch, task_names=tasks, rng=jax.random.PRNGKey(1))
    single = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, TOKENS) ** 2))
    assert _scan_count(lambda p: step(params=p)[0], params) == _scan_count(single, params)


def test_one_array_where_groups_are_expected_is_refused_not_read_row_by_row():
    import pytest

    with pytest.raises(TypeError, match=r"got one array of shape \(2, 6\): pass \(tokens,\)"):
        Bert(BERT_CFG).init(jax.random.PRNGKey(0), TOKENS)
    with pytest.raises(TypeError, match=r"got one array of shape \(2, 6\): pass \(tokens,\)"):
        T5(T5_CFG).init(jax.random.PRNGKey(0), TOKENS, method=T5.encode)
