"""`t5r`: subcommand dispatch, help, gin flag parsing and unknown-command errors."""

import subprocess
import sys

import pytest

from t5_retrieval import cli, gin_utils


def test_every_command_resolves_to_an_importable_main():
    import importlib
    for name, (target, _) in cli.COMMANDS.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), f"{name} -> {target}"


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*name.split(), "--help"])
    assert exit_info.value.code == 0, f"t5r {name} --help exited with {exit_info.value.code}"
    assert "usage:" in capsys.readouterr().out, f"t5r {name} --help printed no usage"


@pytest.mark.parametrize("group", cli.GROUPS)
def test_a_command_group_lists_its_subcommands(group, capsys):
    for argv in ([group], [group, "--help"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        subcommands = [name for name in cli.COMMANDS if name.startswith(group + " ")]
        listed = [" ".join(line.split()[:2]) for line in out.splitlines() if line.startswith("  ")]
        assert subcommands and listed == subcommands, out


def test_two_word_commands_are_resolved_before_one_word_ones():
    assert cli.resolve(["data", "kb", "--x"]) == ("data kb", ["--x"])
    assert cli.resolve(["train", "--model_dir", "d"]) == ("train", ["--model_dir", "d"])


def test_unknown_command_lists_the_known_ones():
    with pytest.raises(SystemExit, match="unknown command 'trian'.*train"):
        cli.resolve(["trian"])


def test_gin_overrides_use_t5x_syntax():
    bindings, rest = gin_utils.split_gin_overrides(["--gin.train.num_steps=5", "--model_dir", "x"])
    assert bindings == ["train.num_steps = 5"] and rest == ["--model_dir", "x"]
    with pytest.raises(SystemExit, match="--gin.NAME=value"):
        gin_utils.split_gin_overrides(["--gin.train.num_steps"])


def test_help_of_the_entry_point_and_of_train():
    top = subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "train" in top.stdout and "serve" in top.stdout
    train = subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "train", "--help"], capture_output=True,
                           text=True)
    assert train.returncode == 0 and "--model_dir" in train.stdout and "--gin_file" in train.stdout, train.stderr
