"""What a compile told the planner, read once from the compiled program and optionally kept on disk.

The planner reads three things of a compiled program: its buffer assignment (memory per device),
the compiler's cost analysis (time) and its optimised HLO text (collectives, custom kernels, custom
calls the cost model does not price). `CompiledProgram` holds exactly those, so the program itself (up to
gigabytes of host memory for T5-XXL) is dropped as soon as it is read.

With a store directory (`t5r plan --cache_dir`), each compile's result is written there, keyed by
the lowered program, the devices it is compiled for, the compiler's versions and whether its peak
was dumped. A plan that stopped part way (T5-base's steps compile for an hour or more each on a CPU
host) or is run again reads back what it compiled and compiles only the rest. A changed program,
device set or compiler misses and compiles again; a file that cannot be read is compiled again
and rewritten.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gzip
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from t5_retrieval.artefact_io import open_replaced_on_success
from t5_retrieval.plan import gpu

log = logging.getLogger(__name__)

# Environment variables that change what XLA or libtpu compile.
COMPILER_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A compiled program as the planner reads it: `memory`, the buffer assignment's bytes per device
    (`arguments`, `outputs`, `aliased`, `temporaries`, `code`); `cost`, the compiler's cost analysis
    (a GPU program's roofline, `gpu.cost_analysis`); `text`, the optimised HLO text, or None with
    `unreadable` saying why jax cannot read it back (libtpu 0.0.52's v5p programs under jax 0.10.2)."""

    memory: dict[str, int]
    cost: dict[str, Any]
    text: str | None
    unreadable: str | None = None

    @classmethod
    def read(cls, compiled: jax.stages.Compiled) -> CompiledProgram:
        memory = compiled.memory_analysis()
        if memory is None:
            raise RuntimeError("the compiler gave no memory analysis of the compiled program")
        cost = compiled.cost_analysis() or gpu.cost_analysis(compiled) or {}
        try:
            text, unreadable = compiled.as_text() or "", None
        except jax.errors.JaxRuntimeError as e:
            text, unreadable = None, " ".join(str(e).split())[:300]
        return cls({"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                    "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
                    "code": memory.generated_code_size_in_bytes},
                   dict(cost[0] if isinstance(cost, list) else cost), text, unreadable)


@dataclasses.dataclass(frozen=True)
class Result:
    """One compile: the program as read (None when the compiler refused it), the seconds it took,
    the compiler's out-of-HBM message (or None) and what held the memory at the program's peak when
    asked for (`peak.read`; else []). One read back from the store is counted there (`Store.counts`)."""

    program: CompiledProgram | None
    seconds: float
    refusal: str | None
    peak: list[dict[str, Any]]


def program_devices(lowered: jax.stages.Lowered) -> list[str]:
    """The devices a program was lowered for, kind and id (jax keeps them on the lowering, unexposed):
    its text names none, so two programs of one text for other chips differ only here."""
    return [f"{d.device_kind} {d!r}" for d in getattr(lowered._lowering, "_device_list", None) or ()]


class Store:
    """Compile results on disk, one gzipped JSON file per program, and this plan's count of reads and compiles."""

    def __init__(self, directory: str, compiler: dict[str, str]):
        self.directory = directory
        self.compiler = compiler
        self.counts = {"compiled": 0, "reused": 0}
        os.makedirs(directory, exist_ok=True)

    def key(self, lowered: jax.stages.Lowered, peak_breakdown: bool) -> str:
        """The program's text names no device kind, so its devices are part of the key, as are the
        compiler's versions and flags."""
        devices = program_devices(lowered)
        flags = {name: os.environ.get(name, "") for name in COMPILER_FLAG_VARIABLES}
        header = json.dumps({"devices": devices, "compiler": self.compiler, "flags": flags, "peak": peak_breakdown},
                            sort_keys=True)
        return hashlib.sha256(header.encode() + b"\n" + lowered.as_text().encode()).hexdigest()

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.json.gz")

    def load(self, key: str) -> Result | None:
        path = self.path(key)
        if not os.path.exists(path):
            return None
        try:
            with gzip.open(path, "rt") as f:
                stored = json.load(f)
            program = None if stored["program"] is None else CompiledProgram(**stored["program"])
            result = Result(program, float(stored["seconds"]), stored["refusal"], stored["peak"])
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: unreadable (%s); compiling the program again", path, e)
            return None
        self.counts["reused"] += 1
        return result

    def save(self, key: str, result: Result) -> None:
        self.counts["compiled"] += 1
        stored = {"program": None if result.program is None else dataclasses.asdict(result.program),
                  "seconds": result.seconds, "refusal": result.refusal, "peak": result.peak}
        with open_replaced_on_success(self.path(key), "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as f:
            f.write(json.dumps(stored).encode())


_STORE: contextvars.ContextVar[Store | None] = contextvars.ContextVar("t5r_plan_store", default=None)


@contextlib.contextmanager
def kept_in(directory: str | None, compiler: dict[str, str]) -> Iterator[Store | None]:
    """Within the block, `compiled_once` keeps and reads back compile results in `directory` (None: not kept)."""
    store = None if directory is None else Store(directory, compiler)
    token = _STORE.set(store)
    try:
        yield store
    finally:
        _STORE.reset(token)


def compiled_once(lowered: jax.stages.Lowered, peak_breakdown: bool,
                  compile_program: Callable[[jax.stages.Lowered, bool], Result]) -> Result:
    """`compile_program(lowered, peak_breakdown)`, or its result read back from the store in use."""
    store = _STORE.get()
    if store is None:
        return compile_program(lowered, peak_breakdown)
    key = store.key(lowered, peak_breakdown)
    found = store.load(key)
    if found is not None:
        return found
    result = compile_program(lowered, peak_breakdown)
    store.save(key, result)
    return result
