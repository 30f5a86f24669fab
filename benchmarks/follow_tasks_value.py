"""Follows a `--tasks` value through the code: every library function that receives it (or a value
holding it), in call order, and how often the path crosses the package's layers.

    python benchmarks/follow_tasks_value.py [--json out.json]

Runs `t5r eval --tasks=fever` (a dataset name the model resolves to its task `demo_fever`) on a tiny
model, data and index built in a temporary directory, with a profiler that records each call into
`t5_retrieval` whose arguments hold "fever" or "demo_fever" (as a string, in a list, tuple or set, or as
a dict key). Prints the files in the order the value reaches them, the number of distinct files and
folders, and the steps down and up the layer order of tests/test_layers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.test_layers import LAYER_OF, component_of  # noqa: E402  (the layer order the tests enforce)
from tests.tiny_model import build_tiny_run  # noqa: E402

VALUES = ("fever", "demo_fever")
PACKAGE = os.path.join(REPO, "t5_retrieval") + os.sep


def holds_value(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return value in VALUES
    if depth > 1:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_value(v, depth + 1) for v in list(value)[:64])
    if isinstance(value, dict):
        return any(isinstance(k, str) and k in VALUES for k in list(value)[:64])
    return False


def follow(argv: list[str]) -> list[str]:
    """The library files (relative to the repository) whose functions receive the value, in call order,
    consecutive repeats folded."""
    from t5_retrieval import cli

    path: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(holds_value(frame.f_locals.get(n)) for n in names):
            where = os.path.relpath(code.co_filename, REPO)
            if not path or path[-1] != where:
                path.append(where)

    sys.setprofile(profiler)
    try:
        status = cli.main(argv)
    finally:
        sys.setprofile(None)
    if status != 0:
        raise SystemExit(f"t5r {' '.join(argv)} exited {status}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the path and counts here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        run = build_tiny_run(root)
        path = follow(["eval", f"--checkpoint_dir={run.model_dirs[0]}", f"--index_dir={run.index_dirs[0]}",
                       f"--data_dir={run.data_dir}", "--tasks=fever", "--split=dev",
                       f"--output_dir={os.path.join(root, 'eval')}"])
    layers = [LAYER_OF[component_of(p.removesuffix(".py").replace(os.sep, "."))] for p in path]
    down = sum(b < a for a, b in zip(layers, layers[1:]))
    up = sum(b > a for a, b in zip(layers, layers[1:]))
    files = sorted(set(path))
    folders = sorted({os.path.dirname(p) for p in path})
    for p, layer in zip(path, layers):
        print(f"  layer {layer:2d}  {p}")
    summary = {"steps": len(path), "files": len(files), "folders": len(folders), "down": down, "up": up}
    print(f"follow_tasks_value: {len(path)} steps through {len(files)} files in {len(folders)} folders; "
          f"{down} steps down the layers, {up} up")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "path": path}, f, indent=1)


if __name__ == "__main__":
    main()
