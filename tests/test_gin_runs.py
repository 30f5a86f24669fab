"""Every run file of gin_configs/runs/ parses with a model file, and what it names exists."""

import glob
import importlib
import os

import gin
import pytest

from t5_retrieval import gin_utils

RUNS = sorted(glob.glob(os.path.join(gin_utils.GIN_CONFIGS_DIR, "runs", "*.gin")))
# The modules whose configurables the run files bind (what `t5r train/ance/query-side` import).
MODULES = ("t5_retrieval.train", "t5_retrieval.ance", "t5_retrieval.query_side", "t5_retrieval.multitask")
# What a user gives on the command line (a run is reproducible from its command line).
COMMAND_LINE = ["DATA_DIR = '/data'", "VOCABULARY = '/spm.model'", "TRAIN_STEPS = 10", "INITIAL_CHECKPOINT_PATH = '/runs/loo'"]


@pytest.mark.parametrize("run_file", [os.path.basename(p) for p in RUNS])
def test_run_file_parses_and_its_mixture_and_model_exist(run_file, clean_gin):
    for module in MODULES:
        importlib.import_module(module)
    import t5_retrieval.tasks  # noqa: F401  (registers the mixtures)
    from t5_retrieval.data.tasks import retrieval_tasks
    from t5_retrieval.models.build import model_config

    bindings = COMMAND_LINE + (["MIXTURE_OR_TASK_NAME = 'kilt_nq'"] if run_file == "single_task.gin" else [])
    gin_utils.parse_gin(["models/t5_tiny.gin", f"runs/{run_file}"], bindings)
    config = model_config()
    assert config["t5"]["d_model"] == 64, "the model file's size must survive the run file"
    try:
        mixture = gin.query_parameter("%MIXTURE_OR_TASK_NAME")
    except ValueError:
        mixture = None  # runs that train nothing (e.g. query_side.gin)
    if mixture is not None:
        assert retrieval_tasks.resolve(mixture), f"{run_file}: MIXTURE_OR_TASK_NAME {mixture!r} resolves to no task"


def test_leave_one_out_mixtures_hold_every_task_but_one():
    import t5_retrieval.tasks  # noqa: F401  (registers the mixtures)
    from t5_retrieval.data.tasks.retrieval_tasks import resolve

    full = [t.name for t, _ in resolve("kilt_noprefix")]
    for held_out in ("fever", "nq", "wow"):
        loo = [t.name for t, _ in resolve(f"kilt_noprefix_without_{held_out}")]
        assert set(full) - set(loo) == {f"kilt_{held_out}_noprefix"} and len(loo) == len(full) - 1, loo
