"""Importing `tasks` registers every retrieval Task and Mixture by name (seqio registries)."""

from tasks import demo, kilt, mini_kilt  # noqa: F401  (registration side effects)
