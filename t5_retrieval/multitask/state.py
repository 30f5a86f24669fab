"""What the trainer reads from a multi-task transform's state, wherever it sits in an optax chain.

A stateful multi-task transform keeps a NamedTuple state that is a `MultitaskState`: next to its
arrays, a field ``hyperparams`` ({name: scalar array}, the numeric hyperparameters its update ran
with, as `optax.inject_hyperparams` keeps them, so every checkpoint says what produced it and
``optax.tree_utils.tree_get(opt_state, "tau")`` finds one by name), and five methods that say what
to log, what to export for analysis, how to start over, and whether the method still runs as
defined (`problems`: TACO's normaliser collapsing, say). The functions below find such states in
any chain state by that protocol, so the trainer, the probe and ANCE name no algorithm; a new
transform is found as soon as its state has these members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class MultitaskState(Protocol):
    """The members the trainer reads from a multi-task transform's state."""

    hyperparams: dict[str, jax.Array]

    def metrics(self) -> dict[str, jax.Array]:
        """Scalars logged every step, named as logged (e.g. ``"cgd/weight/0"``); cheap."""

    def statistics(self) -> dict[str, jax.Array]:
        """Scalars that cost a pass over the state, logged at logging steps only; may be empty."""

    def exported(self) -> Any | None:
        """The arrays `t5r analyze` reads (leaves [K, ...]), written when training ends; or None."""

    def reset(self) -> MultitaskState:
        """The state as ``init`` built it (same hyperparameters, dtypes and shardings)."""

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """What makes the last update not the method it names, one line each (host side: reads
        the state); empty when it ran as defined. The trainer stops on a fatal one."""


class MultitaskProblem(NamedTuple):
    """A one-line finding about a multi-task state: ``fatal`` stops the run, otherwise a warning.

    ``key`` names what the finding is about (e.g. one task's zero median), so the trainer warns once
    per key even when the message's figures change from step to step."""

    message: str
    fatal: bool
    key: str


class ExportedState(NamedTuple):
    """A multi-task state's arrays for analysis and the hyperparameters that produced them."""

    arrays: Any  # leaves [K, ...]
    hyperparams: dict[str, jax.Array]


def hyperparameter_arrays(**values: int | float) -> dict[str, jax.Array]:
    """{name: scalar array} of a transform's numeric hyperparameters: an int as int32, a float as
    float32 (callers pass ``float(x)`` for a real-valued one, so a gin ``tau = 2`` is stored as 2.0).

    Only numbers are kept, as `optax.inject_hyperparams` keeps only numbers in its state: strings,
    flags and dtypes are fixed structure, not values a state holds.
    """
    return {name: jnp.asarray(value, jnp.int32 if isinstance(value, int) else jnp.float32)
            for name, value in values.items()}


def _is_multitask_state(x: Any) -> bool:
    return isinstance(x, MultitaskState)


def multitask_states(opt_state: Any) -> list[MultitaskState]:
    """Every `MultitaskState` inside an optimiser state (a bare one, a chain, a partition)."""
    return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_multitask_state) if _is_multitask_state(x)]


def multitask_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The per-step scalars of whichever multi-task states ``opt_state`` holds."""
    return {name: value for state in multitask_states(opt_state) for name, value in state.metrics().items()}


def multitask_statistics(opt_state: Any) -> dict[str, jax.Array]:
    """The logging-step scalars (a pass over the state each) of whichever multi-task states it holds."""
    return {name: value for state in multitask_states(opt_state) for name, value in state.statistics().items()}


def multitask_problems(opt_state: Any, task_names: Sequence[str]) -> list[MultitaskProblem]:
    """The problems every multi-task state in ``opt_state`` reports (`MultitaskState.problems`)."""
    return [problem for state in multitask_states(opt_state) for problem in state.problems(task_names)]


def exported_state(opt_state: Any) -> ExportedState | None:
    """The arrays and hyperparameters of the multi-task state that exports some, or None."""
    found = [ExportedState(arrays, state.hyperparams) for state in multitask_states(opt_state)
             if (arrays := state.exported()) is not None]
    if len(found) > 1:
        raise ValueError(f"{len(found)} multi-task states export arrays; a chain holds one multi-task transform")
    return found[0] if found else None


def reset_multitask(opt_state: Any) -> Any:
    """``opt_state`` with every multi-task state started over (e.g. each TACO EMA zeroed), the
    rest untouched: a new episode's burn-in without a new optimiser."""
    return jax.tree_util.tree_map(lambda x: x.reset() if _is_multitask_state(x) else x, opt_state,
                                  is_leaf=_is_multitask_state)
