"""Console logging for the CLIs: our INFO lines, and only warnings from chatty libraries."""

import logging

QUIET = ("absl", "orbax", "jax._src", "tensorflow", "h5py", "matplotlib")


def setup(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
