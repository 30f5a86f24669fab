"""Fused attention (`models/attention.py`) against the plain attention it replaces.

Pallas TPU flash attention runs here in Pallas's interpret mode (`force_tpu_interpret_mode(True)`:
the kernel body run as a scan over its grid on CPU); cuDNN's call runs through jax's XLA
implementation of the same `jax.nn.dot_product_attention` call, which checks this project's layout,
bias and padding (cuDNN itself needs an NVIDIA GPU). Shapes are tiny and lengths not multiples of
the kernel's 128: interpret mode takes seconds per call. That `t5r plan` compiles the kernels for
the TPU inside the scanned, rematerialised stack, and prices them, is tested with the other plans
in tests/test_plan.py (one tiny plan serves both).
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from t5_retrieval.errors import ConfigError
from t5_retrieval.models import attention
from t5_retrieval.models.bert import BertConfig
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder
from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5Config, padding_bias

B, N, H = 2, 2, 8
TQ, TK = 24, 37  # a cross-attention's shape; neither a multiple of the kernel's 128


def plain_attention(q, k, v, bias):
    """softmax(q k^T + bias) v, [b, t, heads, d] in and out: the models' XLA path, in float32."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v, precision="highest")


def qkv(tq: int = TQ, tk: int = TK, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (B, tq, N, H))
    k, v = (jax.random.normal(key, (B, tk, N, H)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (B, tq, N, H))  # the last: a cotangent for the gradient


def masks(tq: int, tk: int) -> tuple[jax.Array, jax.Array]:
    """Row 0 padded (20 of its queries, 30 of its keys real), row 1 not."""
    q_mask = jnp.arange(tq)[None] < jnp.array([[20], [tq]])
    k_mask = jnp.arange(tk)[None] < jnp.array([[30], [tk]])
    return q_mask, k_mask


def value_and_grads(attend, q, k, v, *rest, cotangent):
    """The output and the gradient of <output, cotangent> w.r.t. every argument, one jit."""
    def loss(*args):
        out = attend(*args)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(3 + len(rest))), has_aux=True))(
        q, k, v, *rest)
    return out, grads


def worst(a, b) -> float:
    """The largest difference relative to the largest magnitude of `b`."""
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


# Measured on CPU (float32), relative to the largest value: forward <= 2.4e-7, gradients <= 5.7e-7.
FORWARD_TOL, GRADIENT_TOL = 2e-6, 5e-6


def test_pallas_flash_attention_with_t5_bias_equals_plain_attention_forward_and_gradient():
    """T5: a learned relative position bias [1, heads, q, k] with padding folded in as NEG_INF,
    broadcast and padded to 128 by `kernel_bias`; gradients reach q, k, v and the position bias."""
    q, k, v, cotangent = qkv()
    positions = jax.random.normal(jax.random.PRNGKey(7), (1, N, TQ, TK))
    q_mask, k_mask = masks(TQ, TK)
    padding = padding_bias(q_mask, k_mask)

    def fused(q, k, v, positions):
        bias = attention.kernel_bias(positions + padding, B, N, "pallas_tpu")
        assert bias.shape == (B, N, 24, 128)  # queries to a multiple of 8, keys of 128
        return attention.pallas_tpu_attention(q, k, v, bias)

    with pltpu.force_tpu_interpret_mode(True):
        out, grads = value_and_grads(fused, q, k, v, positions, cotangent=cotangent)
    ref_out, ref_grads = value_and_grads(lambda q, k, v, p: plain_attention(q, k, v, p + padding), q, k, v,
                                         positions, cotangent=cotangent)
    assert out.shape == (B, TQ, N, H)
    # every row, padded queries too (they spread over the real keys, as the XLA path's do)
    assert worst(out, ref_out) < FORWARD_TOL, worst(out, ref_out)
    for name, got, want in zip(("q", "k", "v", "position bias"), grads, ref_grads, strict=True):
        assert worst(got, want) < GRADIENT_TOL, f"d/d{name}: {worst(got, want)}"
    assert float(jnp.max(jnp.abs(ref_grads[3]))) > 0.1, "the position bias must receive a gradient"


def test_pallas_flash_attention_with_bert_padding_as_segment_ids_equals_plain_attention():
    """BERT: no bias, padded keys as segment 0 (the kernel's segment ids); q scaled beforehand."""
    t = 29
    q, k, v, cotangent = qkv(t, t, seed=1)
    q = q * H ** -0.5
    _, key_mask = masks(t, t)
    with pltpu.force_tpu_interpret_mode(True):
        out, grads = value_and_grads(lambda q, k, v: attention.pallas_tpu_attention(q, k, v, key_mask=key_mask),
                                     q, k, v, cotangent=cotangent)
    bias = padding_bias(jnp.ones_like(key_mask), key_mask)
    ref_out, ref_grads = value_and_grads(lambda q, k, v: plain_attention(q, k, v, bias), q, k, v, cotangent=cotangent)
    assert worst(out, ref_out) < FORWARD_TOL, worst(out, ref_out)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert worst(got, want) < GRADIENT_TOL, f"d/d{name}: {worst(got, want)}"


def test_short_attention_with_a_shared_per_head_bias_equals_plain_attention_forward_and_gradient():
    """'pallas_tpu_short': T5's bias per head (or one for every head), shared by the batch, padding as
    query and key masks (rows with one real query, with no real query among the first 5, with two
    real keys); gradients reach q, k, v and the shared bias, summed over the batch. Batch 6 runs as
    three grid steps of 2 rows, so the bias gradient accumulates across steps."""
    from t5_retrieval.models.short_attention import short_attention

    b = 6
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q, cotangent = (jax.random.normal(key, (b, N, TQ, H)) for key in keys[:2])
    k, v = (jax.random.normal(key, (b, N, TK, H)) for key in keys[2:4])
    query_mask = jnp.arange(TQ)[None] < jnp.array([[20], [TQ], [5], [TQ], [TQ], [1]])
    key_mask = jnp.arange(TK)[None] < jnp.array([[30], [TK], [3], [TK], [2], [TK]])
    padding = padding_bias(query_mask, key_mask)  # the models' XLA path: NEG_INF added, [b, 1, q, k]
    # A padded query's output is never read, so a model gives it no gradient; the XLA path would pass
    # one through its added NEG_INF, the kernel's mask passes none.
    cotangent = jnp.where(query_mask[:, None, :, None], cotangent, 0.0)
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731

    def plain(q, k, v, shared):
        return heads_major(plain_attention(*map(heads_major, (q, k, v)), shared[None] + padding))

    for heads in (N, 1):
        shared = jax.random.normal(keys[4], (heads, TQ, TK))
        with pltpu.force_tpu_interpret_mode(True):
            out, grads = value_and_grads(lambda q, k, v, s: short_attention(q, k, v, s, query_mask, key_mask),
                                         q, k, v, shared, cotangent=cotangent)
        ref_out, ref_grads = value_and_grads(plain, q, k, v, shared, cotangent=cotangent)
        assert out.shape == (b, N, TQ, H)
        assert worst(out, ref_out) < FORWARD_TOL, (heads, worst(out, ref_out))
        for name, got, want in zip(("q", "k", "v", "shared bias"), grads, ref_grads, strict=True):
            assert worst(got, want) < GRADIENT_TOL, f"{heads} bias heads, d/d{name}: {worst(got, want)}"
        assert grads[3].shape == (heads, TQ, TK) and float(jnp.max(jnp.abs(ref_grads[3]))) > 0.1


def test_short_attention_refuses_a_sequence_longer_than_a_row_on_chip_in_one_line():
    from t5_retrieval.models.short_attention import MAX_LENGTH, short_attention

    x = jnp.zeros((1, 1, MAX_LENGTH + 1, 8))
    with pytest.raises(ConfigError, match="at most 1024 positions") as e:
        short_attention(x, x, x, jnp.zeros((1, MAX_LENGTH + 1, MAX_LENGTH + 1)),
                        jnp.ones((1, MAX_LENGTH + 1), bool), jnp.ones((1, MAX_LENGTH + 1), bool))
    assert "\n" not in str(e.value) and str(e.value).endswith("""use --gin.ATTENTION_IMPL="'pallas_tpu'\"""")


def test_cudnn_call_layout_bias_and_padding_equal_plain_attention_under_jax_xla_implementation():
    """The exact `jax.nn.dot_product_attention` call 'cudnn' makes ([B, T, N, H], a full bias padded
    to even lengths), run by jax's XLA implementation: odd lengths, T5 bias and padding."""
    tq, tk = 23, 37
    q, k, v, cotangent = qkv(tq, tk, seed=2)
    positions = jax.random.normal(jax.random.PRNGKey(3), (1, N, tq, tk))
    q_mask, k_mask = masks(tq, tk)
    padding = padding_bias(q_mask, k_mask)

    def via_jax(q, k, v, positions):
        bias = attention.kernel_bias(positions + padding, B, N, "cudnn")
        assert bias.shape == (B, N, 24, 38)
        return attention.cudnn_attention(q, k, v, bias, jax_implementation="xla")

    out, grads = value_and_grads(via_jax, q, k, v, positions, cotangent=cotangent)
    ref_out, ref_grads = value_and_grads(lambda q, k, v, p: plain_attention(q, k, v, p + padding), q, k, v,
                                         positions, cotangent=cotangent)
    assert worst(out, ref_out) < FORWARD_TOL, worst(out, ref_out)
    for name, got, want in zip(("q", "k", "v", "position bias"), grads, ref_grads, strict=True):
        assert worst(got, want) < GRADIENT_TOL, f"d/d{name}: {worst(got, want)}"


def test_cudnn_without_the_cuda_plugin_is_one_clear_line():
    from jax._src.cudnn import fused_attention_stablehlo

    if fused_attention_stablehlo.cuda_versions is not None:
        pytest.skip("jax's CUDA plugin is installed: cuDNN is detected")
    q, k, v, _ = qkv(8, 8)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    bias = attention.kernel_bias(jnp.zeros((1, 1, 8, 8)), B, N, "cudnn")
    with pytest.raises(ConfigError) as refused:
        attention.cudnn_attention(q, k, v, bias)
    assert str(refused.value) == (
        f"attention 'cudnn': cuDNN is not detected. (this jax has no CUDA plugin; pip install "
        f"\"jax[cuda12]=={jax.__version__}\" on a GPU host, or run with --gin.ATTENTION_IMPL=\"'xla'\")")


def test_an_implementation_is_checked_when_the_config_is_built():
    with pytest.raises(ConfigError) as unknown:
        T5Config(attention="flash")
    assert str(unknown.value).splitlines()[0] == (
        "T5Config.attention: expected one of ('xla', 'pallas_tpu', 'pallas_tpu_short', 'cudnn'), got 'flash'")
    with pytest.raises(ConfigError) as float32:
        BertConfig(attention="cudnn")
    assert str(float32.value).splitlines()[0] == (
        "BertConfig.attention 'cudnn': cuDNN's fused attention takes bfloat16 or float16, and BertConfig.dtype is "
        "'float32'; --gin.DTYPE=\"'bfloat16'\" computes in bfloat16")
    assert T5Config(attention="cudnn", dtype="bfloat16").attention == "cudnn"


TINY_T5 = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                   num_decoder_layers=1, dropout_rate=0.0)
TOKENS = np.array([[5, 6, 7, 8, 9, 3] + [0] * 7, [4] * 12 + [2]], np.int32)  # 13 positions, row 0 padded


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_tpu_short"])
def test_tiny_t5_dual_encoder_with_pallas_equals_xla(kernel):
    """The model-level switch: ST5-EncDec's embedding (encoder self-attention through the kernel,
    the one decoder step on the XLA path) and the teacher-forced decoder (causal self-attention
    and cross-attention through the kernel) of a tiny T5, each Pallas kernel against 'xla'."""
    head = DualEncoderConfig(query_generation=True)  # with the LM head
    model = DualEncoder(TINY_T5, head)
    params = model.init(jax.random.PRNGKey(0), TOKENS)["params"]
    decoder_tokens = TOKENS[:, :9]

    def outputs(cfg: T5Config):
        def run(params):
            model = DualEncoder(cfg, head)
            embedded = model.apply({"params": params}, TOKENS)
            # GDMTL's teacher-forced T5: the encoder, then the decoder over 9 positions
            logits = model.apply({"params": params}, TOKENS, decoder_tokens,
                                 method=DualEncoder.query_generation_logits)
            return embedded, logits
        return jax.jit(run)(params)

    with pltpu.force_tpu_interpret_mode(True):
        fused = outputs(dataclasses.replace(TINY_T5, attention=kernel))
        jaxpr = str(jax.make_jaxpr(lambda p: DualEncoder(dataclasses.replace(TINY_T5, attention=kernel)).apply(
            {"params": p}, TOKENS))(params))
    plain = outputs(TINY_T5)
    assert jaxpr.count("pallas_call") == 1, "the encoder's self-attention alone runs the kernel"
    for name, got, want in zip(("embedding", "decoder logits"), fused, plain, strict=True):
        assert worst(got, want) < FORWARD_TOL, f"{name}: {worst(got, want)}"


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_tpu_short"])
def test_tiny_bert_dual_encoder_with_pallas_equals_xla(kernel):
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_heads=2, intermediate_size=32, num_layers=1,
                     max_position_embeddings=32, dropout_rate=0.0)
    params = BertDualEncoder(cfg).init(jax.random.PRNGKey(0), TOKENS)["params"]

    def embed(cfg: BertConfig):
        return jax.jit(lambda p: BertDualEncoder(cfg).apply({"params": p}, TOKENS))(params)

    with pltpu.force_tpu_interpret_mode(True):
        fused = embed(dataclasses.replace(cfg, attention=kernel))
    assert worst(fused, embed(cfg)) < FORWARD_TOL, worst(fused, embed(cfg))


def test_gin_macro_selects_the_kernel_and_the_stored_config_leaves_it_out():
    """`ATTENTION_IMPL` reaches the network config a model is built from, but not the config stored
    with a model: a model directory loads anywhere, with the loading run's own choice."""
    import t5_retrieval.multitask  # noqa: F401  (registers multitask.taco, which bert_base.gin binds)
    from t5_retrieval import gin_utils
    from t5_retrieval.models.build import build_model, model_config, upgraded_config

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/t5_tiny.gin"], ["ATTENTION_IMPL = 'pallas_tpu'"])
        config = model_config()
        assert "attention" not in config["t5"]
        assert build_model(config).t5_config.attention == "pallas_tpu"
        stored = {**config, "t5": {**config["t5"], "attention": "cudnn"}}  # as if a version had stored it
        assert upgraded_config(stored, config) == config
        gin.clear_config()
        gin_utils.parse_gin(["models/bert_tiny.gin"], ["ATTENTION_IMPL = 'pallas_tpu'"])
        bert = model_config()
        assert "attention" not in bert["bert"]
        assert build_model(bert).bert_config.attention == "pallas_tpu"
    finally:
        gin.clear_config()
    assert build_model(config).t5_config.attention == "xla"  # no binding: the default


def test_flash_cost_counts_the_padded_matmuls():
    fwd = attention.flash_cost(2, 12, 160, 160, 64, 2, with_bias=True)
    assert fwd["flops"] == 2 * 2 * 2 * 12 * 160 * 256 * 64  # keys padded to 256: two matmuls
    assert fwd["bytes"] == 2 * 2 * 12 * (160 + 256) * 64 * 2 + 2 * 12 * 160 * 256 * 4
    bwd = attention.flash_cost(2, 12, 160, 160, 64, 2, with_bias=True, backward=True)
    assert bwd["flops"] == 3.5 * fwd["flops"]
