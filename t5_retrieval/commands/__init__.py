"""The `t5r` subcommands of the retrieval stages (encode, eval, mine, serve).

They sit above everything they assemble: a model opened by `inference.load_encoder` (or the
lexical baseline), the retrieval library, and the data. `t5_retrieval.cli` maps names to them.
"""
