"""What holds a compiled step's memory at its peak, in the compiler's own words.

XLA's buffer assignment ends with a breakdown of the buffers live at the program's peak, attributed
to the operation (its JAX name) or argument that made each; it writes it when asked to dump the
program, also for a program it then refuses as too large for the HBM, which is when the question
"what is it?" matters most. `compile_options` asks one compile for that dump (into a directory of
the caller's), and `read` turns the breakdown into the largest few contributors.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

TOP = 8  # contributors kept; the rest are summed into one "other" entry

_BREAKDOWN = "Stack trace breakdown for peak usage:"
# "      ├── <name> (12.3%, total: 1 234 bytes, current: ..." : a direct child of the entry computation
_CHILD = re.compile(r"^      [├└]── (?P<name>.+?) \([0-9.]+%, total: (?P<bytes>[0-9 ]+) bytes")
_OUTPUT_INDEX = re.compile(r"\{[0-9, ]*\}$")  # "while{9}": one output of a multi-output operation
_STEP_PREFIX = re.compile(r"^jit\([^)]*\)/")
# an XLA-made buffer: "copy-start.4", "custom-call.30", "convert_dynamic-update-slice_fusion.184", "and_select_fusion"
_INSTRUCTION = re.compile(r"^[a-z][a-z0-9_-]*(\.[0-9]+|fusion)$")
_ARGUMENT_ROOT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*")  # "state" of "state.opt_state[1][0].mu['t5']..."


def compile_options(dump_dir: str) -> dict[str, Any]:
    """`Lowered.compile(compiler_options=...)` that dumps the optimised program and its buffer
    assignment (with the peak breakdown) into `dump_dir`, and no intermediate pass."""
    return {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "NONE"}


def _contributor(name: str) -> str:
    """A breakdown entry as a reader groups it: an operation by its JAX name without the step's
    jit(), a buffer XLA made by its instruction, an argument by the tree it belongs to (the train
    step's "state": parameters, optimiser and multi-task state)."""
    name = _OUTPUT_INDEX.sub("", name)
    if "/" in name or _INSTRUCTION.match(name):
        return _STEP_PREFIX.sub("", name)
    root = _ARGUMENT_ROOT.match(name)
    return f"argument {root[0] if root else name}"


def read(dump_dir: str) -> list[dict[str, Any]]:
    """The largest contributors to the peak of the program dumped in `dump_dir`, largest first:
    [{"what": ..., "bytes": ...}], at most TOP of them plus "other"; [] when nothing was dumped."""
    totals: dict[str, int] = {}
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        start = next((i for i, line in enumerate(lines) if line.strip().startswith(_BREAKDOWN)), None)
        if start is None:
            continue
        found: dict[str, int] = {}
        for line in lines[start + 1:]:
            child = _CHILD.match(line)
            if child:
                what = _contributor(child["name"])
                found[what] = found.get(what, 0) + int(child["bytes"].replace(" ", ""))
        if sum(found.values()) > sum(totals.values()):  # several modules: the step is the largest
            totals = found
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    top = [{"what": what, "bytes": n} for what, n in ranked[:TOP]]
    rest = sum(n for _, n in ranked[TOP:])
    return top + ([{"what": "other", "bytes": rest}] if rest else [])
