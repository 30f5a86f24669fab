"""The model-family registry (`models/families.py`): what build.py and `t5r plan` dispatch through."""

from __future__ import annotations

import dataclasses
import json

import pytest

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.build import build_model, initial_params, model_config
from t5_retrieval.models.families import FAMILIES, family_of, register_family


def test_t5_and_bert_are_registered_and_a_stored_config_without_a_family_is_t5s():
    assert set(FAMILIES) >= {"t5", "bert"}
    assert family_of({"t5": {}, "dual_encoder": {}}).name == "t5"
    assert "family" not in model_config("t5"), "T5 configs are stored as before BERT existed (same fingerprints)"
    assert model_config("bert")["family"] == "bert"


def test_an_unknown_family_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"model_config.family: expected one of \(.*'t5'.*'bert'.*got 'gpt'"):
        model_config("gpt")
    with pytest.raises(ConfigError, match="model family 'gpt': this version knows"):
        build_model({"family": "gpt", "gpt": {}, "dual_encoder": {}})


def test_a_taken_name_is_not_registered_again_with_another_family():
    t5 = FAMILIES["t5"]
    with pytest.raises(ValueError, match="'t5' is already registered"):
        register_family(dataclasses.replace(t5, depth_keys=()))
    assert FAMILIES["t5"] is t5
    assert register_family(t5) is t5, "registering the same family again (a module imported twice) is harmless"


def test_a_hugging_face_directory_no_family_imports_is_refused_naming_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(ConfigError, match=r"model_type 'roberta': this version imports \['t5', 'bert'\]"):
        initial_params(str(tmp_path), {"t5": {}}, model_config())


def test_t5_reads_its_parameters_as_declared_so_a_bfloat16_copy_embeds_the_same():
    """`as_read` (what `train.gather_params_once` gathers) casts all but `float32_params` to the
    compute dtype: under bfloat16 compute the embeddings are bit-identical to those from the stored
    float32 parameters, and casting a parameter the network reads in float32 changes them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    config = model_config("t5")
    config["t5"].update(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                        num_decoder_layers=1, dtype="bfloat16")
    family, model = family_of(config), build_model(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, size=(3, 12)), jnp.int32)
    params = jax.tree.map(lambda x: getattr(x, "value", x), model.init(jax.random.PRNGKey(0), tokens)["params"],
                          is_leaf=lambda x: hasattr(x, "value"))
    read = family.as_read(config, params)
    kept = {jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(read)
            if x.dtype == jnp.float32}
    assert kept and all(name.endswith(("['scale']", "['rel_embedding']")) for name in kept), kept
    assert {x.dtype for x in jax.tree.leaves(read)} == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}

    def embed(p):
        return model.apply({"params": p}, tokens)

    np.testing.assert_array_equal(np.asarray(embed(read)), np.asarray(embed(params)))
    wrong = dataclasses.replace(family, float32_params=("scale",))  # would also cast the position biases
    assert not np.array_equal(np.asarray(embed(wrong.as_read(config, params))), np.asarray(embed(params)))
    assert FAMILIES["bert"].as_read(model_config("bert"), {"w": jnp.ones(2)})["w"].dtype == jnp.float32, (
        "a family that does not declare what it reads in float32 is read as stored")
