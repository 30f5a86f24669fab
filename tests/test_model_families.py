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
