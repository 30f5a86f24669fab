"""Shared test setup: a persistent XLA compilation cache so identical tiny steps compile once."""

import os

import jax
import pytest

import t5_retrieval.tasks  # noqa: F401  (registers the tasks and mixtures, as `t5r train` does)

CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mini_kilt")


@pytest.fixture
def clean_gin():
    """Gin bindings are global: give each test that parses gin a clean slate."""
    import gin
    gin.clear_config()
    yield
    gin.clear_config()
