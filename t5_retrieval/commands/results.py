"""`t5r results`: flags -> `results.run_rows`, then the tables (the help shows the package's docstring)."""

from __future__ import annotations

import argparse

from t5_retrieval import logs, results
from t5_retrieval.errors import UserError
from t5_retrieval.results.page import refresh_page
from t5_retrieval.results.rows import ROWS, SEEDED


def _seeds(value: str) -> list[int]:
    try:
        seeds = sorted({int(s) for s in value.split(",") if s})
    except ValueError:
        raise UserError(f"--seeds must be comma-separated integers, got {value!r}") from None
    if not seeds or min(seeds) < 0:
        raise UserError(f"--seeds must list integers >= 0, got {value!r}")
    return seeds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r results", description=results.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="the mini-KILT directory, or 'slice' for the shipped demo slice of it "
                                       "(needed unless --rows is empty: then only the tables are printed)")
    parser.add_argument("--work_dir", required=True, help="where every row writes (resumed if it exists)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated training seeds for the method rows (" + ", ".join(SEEDED) + ")")
    parser.add_argument("--records_dir", default=None,
                        help="where every finished run's record goes and the tables are built from "
                             "(default <work_dir>/records; docs/run_records/mini_kilt holds docs/RESULTS.md's)")
    parser.add_argument("--compare_with", default=None,
                        help="records of the same rows under other inputs (e.g. docs/run_records/mini_kilt, "
                             "queries at 64 tokens): also print each row's change from them")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--page", default=None,
                        help="then print every table marked `<!-- records: KIND DIR -->` in this page again from "
                             "its records (e.g. docs/RESULTS.md; t5_retrieval/results/page.py)")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    seeds = _seeds(args.seeds)
    if rows and not args.data:
        raise UserError("--data is needed to run rows (or pass --rows= to print the tables only)")
    logs.setup()
    table = results.run_rows(args.work_dir, rows, seeds, args.data, args.records_dir, args.compare_with)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table, end="")
    if args.page:
        print(f"{args.page}: {refresh_page(args.page)} table(s) printed again from their records")
    return 0
