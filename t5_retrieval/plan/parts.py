"""A per-task step's memory per device from its parts, for a host that cannot compile the whole step.

A per-task step (TACO, PCGrad) runs one gradient pass per task, one after another, keeps each pass's
gradient until all K are in, then applies the update. With remat, T5-base TACO's whole step at the
paper's batch outgrew a 23 GiB planning host, while each pass and the update compile alone in a few
GiB. So two moments bound the step's memory, each read from the compiler's buffer assignment of the
part compiled alone:

- during the last task pass: the train state, the whole batch, the K - 1 gradients already made, and
  that pass's own temporaries and output (its gradient), plus the gathered copy of the parameters
  with `train.gather_params_once`;
- at the update: the whole batch, the update's arguments (the state and the K gradients), its
  temporaries and the outputs it does not write in place.

The estimate is the larger moment plus every part's code. It leaves out what the whole program's scheduler would add
(buffers kept across parts) or save (a pass's temporaries reusing a gradient's space): a figure to
plan with, named as an estimate, not the whole program's buffer assignment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The buffers of one part compiled alone (`planner.compiled_memory`'s keys).
Buffers = Mapping[str, int]


def pass_moment(state: int, batch: int, gradient: int, num_tasks: int, task_pass: Buffers, gathered_copy: int) -> int:
    """Bytes alive while the last task pass runs: state, batch, the K - 1 earlier gradients, the pass's
    temporaries and output, and the gathered parameters (0 without `gather_params_once`)."""
    return (state + batch + (num_tasks - 1) * gradient + task_pass["temporaries"] + task_pass["outputs_not_donated"]
            + gathered_copy)


def update_moment(batch: int, update: Buffers) -> int:
    """Bytes alive during the update: the batch (an argument of the whole step, not donated) and the
    update's own arguments (state and K gradients), temporaries and outputs not written in place."""
    return batch + update["arguments"] + update["temporaries"] + update["outputs_not_donated"]


def memory_from_parts(arguments: Mapping[str, int], gradient: int, num_tasks: int, passes: Sequence[Buffers],
                      update: Buffers, gathered_copy: int, hbm: int) -> dict[str, int]:
    """The step's memory per device as `planner.memory_per_device` lays it out (the arguments by what
    they are, `temporaries` for what is not an argument, `peak` against `hbm`), from its parts:
    `arguments` (params, optimizer, multitask, batch: from their shardings), one task's `gradient`
    bytes, each distinct task pass's buffers and the update's."""
    state = arguments["params"] + arguments["optimizer"] + arguments["multitask"]
    batch = arguments["batch"]
    moments = [pass_moment(state, batch, gradient, num_tasks, p, gathered_copy) for p in passes]
    moments.append(update_moment(batch, update))
    code = sum(p["code"] for p in passes) + update["code"]  # the whole program holds every part's code
    peak = max(moments) + code
    return {**arguments, "arguments": state + batch, "outputs_not_donated": 0,
            "temporaries": peak - code - state - batch, "code": code, "peak": peak, "hbm": hbm, "margin": hbm - peak}
