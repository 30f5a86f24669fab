"""A trained model's config.gin records the run, not the machine: `train.compilation_cache_dir` (where
this machine caches compiled programs) is left out, so a copied model directory names no path of the
machine it was trained on through it, and gin's default applies wherever config.gin is read back."""

import gin

from t5_retrieval import train

# gin's operative config as gin writes it: a long value wraps onto an indented continuation line.
OPERATIVE = """# Parameters for train:
# ==============================================================================
train.batches = @make_train_iterator
train.compilation_cache_dir = \\
    '/home/someone/.cache/t5_retrieval/xla/a/path/long/enough/to/wrap/onto/a/second/line'
train.num_steps = 20
"""


def test_the_compilation_cache_binding_and_its_continuation_are_left_out():
    assert train.portable_config(OPERATIVE) == """# Parameters for train:
# ==============================================================================
train.batches = @make_train_iterator
train.num_steps = 20
"""


def test_the_config_without_it_parses_and_train_takes_the_default(clean_gin):
    gin.parse_config(train.portable_config(OPERATIVE).replace("@make_train_iterator", "None"))
    assert gin.query_parameter("train.num_steps") == 20
    assert "train.compilation_cache_dir" not in gin.config_str()
