"""Walks a traced program for tests that check what it computes (matmul dtypes, scan outputs)."""

from __future__ import annotations

from collections.abc import Iterator

import jax.extend


def equations(jaxpr: jax.extend.core.Jaxpr) -> Iterator[jax.extend.core.JaxprEqn]:
    """Every equation of `jaxpr`, those inside scans, remat, pjit and other sub-programs included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(inner)
