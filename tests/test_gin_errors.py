"""A gin file or binding that cannot work is one line naming the file and line, exit status 2, before
any work (and before any model directory exists): syntax errors, unbalanced brackets, bytes that are
not UTF-8, and every required macro left unset at once."""

from __future__ import annotations

import os

import gin
import pytest

from t5_retrieval import cli


@pytest.fixture(autouse=True)
def clean_gin():
    yield
    gin.clear_config()


@pytest.mark.parametrize("content,expected", [
    (b"train.num_steps = = 3\n", ":1:19: Unable to parse value. ('train.num_steps = = 3')"),
    (b"train.num_steps = 3\ntrain.log_every = [1, 2\n", ":3:1: EOF in multi-line statement"),
    (b"train.num_steps = 3\n# caf\xe9\n", ":2:6: not UTF-8 (byte 0xe9); gin files are UTF-8 text"),
    (b"train.num_steps = 3\ntrain.log_every = often\n",
     ":2:19: 'often' is a bare word, not a gin value: quote a string ('often'), or write @often for a "
     "configurable, %often for a macro ('train.log_every = often')"),
    (b"train.num_steps = 3\nno_such_thing.x = 1\n", ":2:1: No configurable matching 'no_such_thing' "
     "('no_such_thing.x = 1')"),
])
def test_an_unreadable_gin_file_is_one_line_naming_it(tmp_path, capsys, content, expected):
    path = tmp_path / "bad.gin"
    path.write_bytes(content)
    model_dir = tmp_path / "model"
    assert cli.main(["train", f"--model_dir={model_dir}", f"--gin_file={path}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"t5r train: error: gin: {path}{expected}"], err
    assert not os.path.exists(model_dir), "a failed start leaves no model directory"


def test_a_bare_word_on_the_command_line_is_one_line_naming_it(tmp_path, capsys):
    assert cli.main(["train", f"--model_dir={tmp_path / 'model'}", "--gin_file=models/minilm_l6.gin",
                     "--gin.TRAIN_STEPS=many"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "t5r train: error: gin: the --gin. bindings:1:15: 'many' is a bare word, not a gin value: quote a string "
        "('many'), or write @many for a configurable, %many for a macro ('TRAIN_STEPS = many')"], err


def test_every_required_macro_left_unset_is_named_in_one_message(tmp_path, capsys):
    assert cli.main(["train", f"--model_dir={tmp_path / 'model'}", "--gin_file=models/minilm_l6.gin",
                     "--gin_file=runs/naive_multitask.gin"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("t5r train: error: gin: DATA_DIR, TRAIN_STEPS are required by models/minilm_l6.gin "
                   "runs/naive_multitask.gin; set them, e.g. --gin.DATA_DIR=... --gin.TRAIN_STEPS=..."), err
