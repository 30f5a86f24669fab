"""What the pipeline stores and reads back: the passage store (KB), KB embedding shards, BM25 over the KB."""
