"""`t5r analyze`: an EMA state file -> `multitask.analysis.write_analysis` (figures and numbers)."""

from __future__ import annotations

import argparse

from t5_retrieval.commands.gin_flags import parse_args
from t5_retrieval.multitask import analysis


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r analyze", description=analysis.__doc__.splitlines()[0])
    parser.add_argument("--state_npz", required=True,
                        help="EMA state written by save_state_npz (leaf arrays, task_names, hyperparams), "
                             "e.g. <model_dir>/multitask_state.npz.")
    parser.add_argument("--out", required=True, help="output directory for figures and JSON.")
    parser.add_argument("--tau", type=float, default=None,
                        help="TACO softmax temperature (default: the one saved with the state, else the "
                             "model's config.gin, else TACO's default).")
    parser.add_argument("--entropy_threshold", type=float, default=0.3,
                        help="an activated parameter whose task entropy (nats) is below this is task specific.")
    parser.add_argument("--inactive_threshold", type=float, default=1e-6,
                        help="a parameter whose every task's EMA sensitivity is at most this is not activated.")
    args = parse_args(parser, argv)
    saved = analysis.load_state_npz(args.state_npz)
    tau = analysis.saved_tau(args.state_npz, saved) if args.tau is None else args.tau
    summary = analysis.write_analysis(saved.arrays, saved.task_names, tau, args.out, args.entropy_threshold,
                                      args.inactive_threshold)
    print(f"analyze: {summary['num_params']} params, {summary['num_tasks']} tasks: "
          f"task specific {100 * summary['task_specific_fraction']:.2f}%, not activated "
          f"{100 * summary['not_activated_fraction']:.2f}%, mean entropy "
          f"{summary['mean_entropy']:.3f} nats -> {args.out}")
    return 0
