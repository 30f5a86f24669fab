"""`t5r demo` (`make demo`): flags -> `demo.real_data_demo` or `demo.synthetic_demo`, then their tables
and the total wall time (the help shows `demo`'s docstring)."""

from __future__ import annotations

import argparse
import time

from t5_retrieval import demo, logs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r demo", description=demo.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="slice",
                        help="'slice' (the shipped mini-KILT slice), 'synthetic', or a KILT-format directory")
    parser.add_argument("--out", default="demo_out",
                        help="work directory for the data, models and results; a rerun reuses what it holds")
    args = parser.parse_args(argv)
    logs.setup()
    start = time.time()
    if args.data == "synthetic":
        print(demo.synthetic_demo(args.out), end="")
    else:
        table = demo.real_data_demo(args.data, args.out)
        source = "the shipped mini-KILT slice" if args.data == "slice" else args.data
        print(f"\nDev queries of {source}, page-level KILT R-precision and recall@20 per task (wall time per row):")
        print(table, end="")
        print(f"(every row's metrics: {args.out}/<row>/eval/results.txt; what the rows are: README.md, "
              "docs/RESULTS.md)")
    print(f"(total {time.time() - start:.0f} s)")
    return 0
