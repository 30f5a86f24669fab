"""t5-retrieval: one dense retriever for many knowledge-intensive tasks, in JAX/Flax."""

__version__ = "0.1.0"
