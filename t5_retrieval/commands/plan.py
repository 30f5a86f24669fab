"""`t5r plan`: compile the real train and KB encode steps for a TPU or GPU slice on this (CPU) host.

Takes what `t5r train` takes (model, run and sharding gin files, `--gin.` bindings) plus the
topology, builds the train step `t5r train` jits (with the run's multi-task method) and the KB
encode step of `t5r encode` from abstract parameters, compiles both with the TPU compiler
(libtpu, a development dependency) or, for a GPU slice (h100:8, two hosts of them h100:8x2), XLA's
GPU compiler (jax's CUDA plugin), and reports per device: parameters, optimiser and multi-task
state, activations against HBM, the step-time estimate (libtpu's cost model; a roofline for GPUs),
collectives and parameters left replicated. Exits 2 when the train step does not fit, saying what
would.

    t5r plan --topology=v5e:4x4 --gin_file=models/t5_base.gin --gin_file=runs/taco.gin \
        --gin_file=sharding/fsdp.gin

DATA_DIR, VOCABULARY and TRAIN_STEPS may be left out: planning reads no data.
"""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

# Bound first, so that the gin files and flags override them: a plan reads no data.
UNREAD_MACROS = ("DATA_DIR = None", "VOCABULARY = None", "TRAIN_STEPS = 1000")


def train_settings() -> Any:
    """`TrainSettings` from the bindings of `train` and `make_train_iterator` (defaults where unbound)."""
    import gin

    from t5_retrieval import gin_utils
    from t5_retrieval import train as trainer
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.errors import ConfigError
    from t5_retrieval.plan.steps import TrainSettings

    def values(fn: Any, name: str) -> dict[str, Any]:
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return {**defaults, **gin.get_bindings(name)}

    run, data = values(trainer.train, "train"), values(make_train_iterator, "make_train_iterator")
    if getattr(gin_utils.bound_value("train.batches"), "selector", None) != "make_train_iterator":
        raise ConfigError("train.batches: t5r plan takes the batch shapes from @make_train_iterator's mixture; "
                          "bind train.batches = @make_train_iterator (runs/base.gin does)")
    return TrainSettings(
        mixture=data["mixture_or_task_names"], query_len=data["query_len"], passage_len=data["passage_len"],
        num_negatives=data["num_negatives"], per_device_batch=run["per_device_batch"], multitask=run["multitask"],
        num_steps=run["num_steps"] or 1000, stop_passage_gradient=run["stop_passage_gradient"],
        max_nonfinite_in_a_row=run["max_nonfinite_in_a_row"],
        stored_passage_embeddings=data["passage_embeddings"] is not None, task_module=data["task_module"],
        task_module_path=data["task_module_path"], gather_params_once=run["gather_params_once"])


def main(argv: list[str]) -> int:
    from t5_retrieval import (
        logs,
        sharding,
        train,  # noqa: F401  (its configurables, which the run files bind)
    )
    from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
    from t5_retrieval.errors import UserError
    from t5_retrieval.models.build import model_config
    from t5_retrieval.plan import planner, text
    from t5_retrieval.plan.chips import MIB

    parser = argparse.ArgumentParser(prog="t5r plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", required=True, help="TPU slice (v5e:4x4, v4:2x2x1, v5p:4x4x4) or GPU slice "
                        "<gpu>:<GPUs per host>[x<hosts>] (h100:8, h200:8x2, a100:8)")
    parser.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN (the data axis spans them)")
    parser.add_argument("--per_tensorcore", action="store_true",
                        help="v4 only: one device per TensorCore (2 per chip, 16 GiB each) instead of one megacore "
                             "device per chip (32 GiB), which is how JAX runs v4 by default")
    parser.add_argument("--replicated_mib", type=float, default=1.0,
                        help="report parameters at least this large that a sharding layout leaves replicated")
    parser.add_argument("--from_parts", action="store_true",
                        help="per-task steps (TACO) only: do not compile the whole train step, estimate its memory "
                             "from its task passes and update compiled alone (for a host without the memory: T5-base "
                             "TACO with remat needs more than 23 GiB whole)")
    parser.add_argument("--cache_dir", metavar="DIR",
                        help="keep what each compile gives (memory, cost, program text) in DIR and read it back: a "
                             "plan stopped part way, or run again, compiles only what it has not compiled (keyed by "
                             "the program, its devices and the compiler)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for tools)")
    args = parse_args(parser, [*(f"--gin.{b.replace(' = ', '=')}" for b in UNREAD_MACROS), *argv], reads=TASK_MODULE)
    logs.setup()
    rules = sharding.logical_axis_rules()
    layout = next(name for name, r in sharding.LAYOUTS.items() if r == rules)
    report = planner.plan(args.topology, args.num_slices, layout, rules, model_config(), train_settings(),
                          int(args.replicated_mib * MIB), per_tensorcore=args.per_tensorcore, from_parts=args.from_parts,
                          cache_dir=args.cache_dir)
    print(json.dumps(report, indent=1) if args.json else text.render(report))
    if not report["steps"]["train"]["fits"]:
        raise UserError(f"{report['problems'][0]}; {report['advice']}")
    return 0
