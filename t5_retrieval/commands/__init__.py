"""Every `t5r` subcommand: one module per command (or command group, `data.py`), each holding its
flag parsing and `main(argv) -> int` over library functions, and printing what the user asked for.

They sit above everything they assemble; `t5_retrieval.cli` maps names to them and is the one place
errors are shown. Library modules below have no `main`, no argparse and write nothing to stderr:
they raise `errors.UserError` (or a subclass) for what the user can fix.
"""
