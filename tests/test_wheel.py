"""`pip install .` works away from the source tree: the wheel carries the gin configs, and `t5r`
installed from it shows its help and trains one step from another directory."""

import glob
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def test_installed_wheel_runs_help_and_a_train_step_from_elsewhere(tmp_path):
    wheel_dir, site, elsewhere = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Built from a copy of what the package is made of (the build writes build/ and egg-info beside
    # its sources), with the venv's own setuptools (no download), as `pip install .` would.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source)
    shutil.copytree(os.path.join(REPO, "t5_retrieval"), source / "t5_retrieval",
                    ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir),
         str(source)])
    wheels = glob.glob(str(wheel_dir / "t5_retrieval-*.whl"))
    assert len(wheels) == 1, wheels
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheels[0]])
    assert glob.glob(str(site / "t5_retrieval" / "gin_configs" / "runs" / "taco.gin")), "gin configs are package data"
    assert glob.glob(str(site / "t5_retrieval" / "demo_data" / "mini_kilt_slice.tar.gz")), "the demo slice ships"
    shipped_tasks = site / "t5_retrieval" / "data" / "tasks" / "shipped.py"
    assert shipped_tasks.is_file(), "the Task registrations ship in the package"
    assert not os.path.exists(site / "tasks"), "no top-level `tasks` package to collide with a user's own"
    # pip installs what the wheel declares: `t5r serve`'s server libraries must be among it.
    with open(glob.glob(str(site / "t5_retrieval-*.dist-info" / "METADATA"))[0]) as f:
        declared = {line.split(":", 1)[1].strip().split(">")[0].split("=")[0].split("<")[0].lower()
                    for line in f if line.startswith("Requires-Dist:")}
    assert {"uvicorn", "h11", "starlette"} <= declared, f"the HTTP server's libraries are not dependencies: {declared}"
    with open(glob.glob(str(site / "t5_retrieval-*.dist-info" / "METADATA"))[0]) as f:
        setuptools = [line.split(":", 1)[1].strip() for line in f if line.startswith("Requires-Dist: setuptools")]
    assert setuptools and "<81" in setuptools[0], f"tensorboard needs pkg_resources (setuptools < 81): {setuptools}"

    # as a user's shell: no JAX_COMPILATION_CACHE_DIR (the suite's own would take the place of the one
    # `t5r train` picks, which is checked below)
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}, "PYTHONPATH": str(site)}
    where = run([sys.executable, "-c", "import t5_retrieval; print(t5_retrieval.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(site)), f"the installed copy must run, not the checkout: {where.stdout}"
    t5r = str(site / "bin" / "t5r")
    assert "train" in run([t5r, "--help"], cwd=elsewhere, env=env).stdout

    model_dir, cache = elsewhere / "model", tmp_path / "xla_cache"
    run([t5r, "train", f"--model_dir={model_dir}", "--gin_file=models/t5_tiny.gin",
         "--gin.VOCAB_SIZE=128", "--gin.D_MODEL=32", "--gin.D_FF=64", "--gin.DROPOUT=0.0",
         "--gin.train.batches=@RandomBatches", "--gin.train.per_device_batch=4", "--gin.train.num_steps=1",
         f"--gin.train.compilation_cache_dir='{cache}'"],
        cwd=elsewhere, env=env)
    assert os.path.isdir(model_dir / "1"), sorted(os.listdir(model_dir))
    # `t5r train` turns JAX's persistent compilation cache on, so a restart does not compile again.
    assert os.listdir(cache), "the train step's compiled program is in the compilation cache"
