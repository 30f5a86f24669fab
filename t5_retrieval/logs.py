"""Console logging for the CLIs: our INFO lines, and only warnings from chatty libraries."""

import logging

QUIET = ("absl", "orbax", "jax._src", "tensorflow", "h5py", "matplotlib", "uvicorn")


def setup(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    # basicConfig does nothing when an imported library already configured the root logger (one
    # of ours does, at WARNING), which silenced every INFO line; the level must still be ours.
    logging.getLogger().setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
