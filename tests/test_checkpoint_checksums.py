"""Checkpoint checksums: a corrupted or truncated array file in the newest checkpoint is caught at
restore, that checkpoint is set aside and the previous one's state comes back exactly."""

from __future__ import annotations

import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from t5_retrieval import checkpoint, checksums
from t5_retrieval.gin_utils import OPERATIVE_CONFIG


def states() -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    first = {"params": {"w": jnp.asarray(rng.standard_normal((256, 256), dtype=np.float32)),
                        "b": jnp.asarray(rng.standard_normal(7, dtype=np.float32))},
             "step": jnp.array(1, jnp.int32)}
    second = jax.tree.map(lambda x: x + 1, first)
    return first, second


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[str, dict, dict]:
    directory = str(tmp_path / "model")
    first, second = states()
    mngr = checkpoint.manager(directory, writer=True)
    checkpoint.save(mngr, 1, first, {"step": 1})
    checkpoint.save(mngr, 2, second, {"step": 2})
    return directory, first, second


def largest_array_file(directory: str, step: int) -> str:
    files = glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)
    assert files, f"no array files in {directory}/{step}"
    return max(files, key=os.path.getsize)


def flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def assert_same_tree(got, expected, what: str) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{what} at {jax.tree_util.keystr(path)}")


def test_checksums_cover_every_file_of_the_step(two_checkpoints):
    directory, _, _ = two_checkpoints
    step_dir = os.path.join(directory, "2")
    with open(os.path.join(step_dir, checksums.CHECKSUMS_FILE)) as f:
        listed = set(json.load(f)["files"])
    on_disk = {os.path.relpath(os.path.join(root, name), step_dir) for root, _, names in os.walk(step_dir)
               for name in names} - {checksums.CHECKSUMS_FILE}
    assert listed == on_disk, f"not checksummed: {sorted(on_disk - listed)}; listed but absent: {sorted(listed - on_disk)}"


def test_a_flipped_byte_in_the_newest_checkpoint_is_caught_and_the_previous_state_restored(two_checkpoints, caplog):
    directory, first, second = two_checkpoints
    broken = largest_array_file(directory, 2)
    flip_middle_byte(broken)
    # Orbax alone restores the flipped byte without complaint: only the checksum can catch it.
    raw = ocp.PyTreeCheckpointer().restore(os.path.join(directory, "2", "state"))
    assert not np.array_equal(np.asarray(raw["params"]["w"]), np.asarray(second["params"]["w"]))

    with caplog.at_level(logging.WARNING, logger="t5_retrieval.checkpoint"):
        state, data = checkpoint.restore(checkpoint.manager(directory, writer=True), checkpoint.abstract_like(first))
    assert data == {"step": 1}, f"expected the step-1 checkpoint's data position, got {data}"
    assert_same_tree(state, first, "restored state differs from the step-1 checkpoint")
    assert f"{broken}: fails its sha256 checksum" in caplog.text
    moved = glob.glob(os.path.join(directory, checkpoint.UNREADABLE_DIR, "2-*"))
    assert len(moved) == 1 and not os.path.exists(os.path.join(directory, "2")), os.listdir(directory)
    assert f"set aside the unreadable checkpoint {os.path.join(directory, '2')} as {moved[0]}" in caplog.text


def test_a_truncated_array_file_is_caught_and_the_previous_state_restored(two_checkpoints, caplog):
    directory, first, _ = two_checkpoints
    path = largest_array_file(directory, 2)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with caplog.at_level(logging.WARNING, logger="t5_retrieval.checkpoint"):
        state, data = checkpoint.restore(checkpoint.manager(directory, writer=True), checkpoint.abstract_like(first))
    assert data == {"step": 1}
    assert_same_tree(state, first, "restored state differs from the step-1 checkpoint")
    assert "truncated or overwritten" in caplog.text
    assert len(glob.glob(os.path.join(directory, checkpoint.UNREADABLE_DIR, "2-*"))) == 1


def test_inference_restore_skips_a_corrupted_checkpoint_but_moves_nothing(two_checkpoints):
    directory, first, _ = two_checkpoints
    flip_middle_byte(largest_array_file(directory, 2))
    params, step = checkpoint.restore_params(directory, checkpoint.abstract_like(first["params"]))
    assert step == 1
    assert_same_tree(params, first["params"], "restored params differ from the step-1 checkpoint")
    assert os.path.isdir(os.path.join(directory, "2")), "a reader must not move a writer's checkpoints"


def test_a_checkpoint_without_checksums_is_not_trusted_and_the_previous_state_restored(two_checkpoints):
    """Killed between orbax's rename and the checksums, or altered and its record deleted: either way
    unverifiable, so it is set aside like a corrupted one."""
    directory, first, second = two_checkpoints
    os.remove(os.path.join(directory, "2", checksums.CHECKSUMS_FILE))
    state, data = checkpoint.restore(checkpoint.manager(directory, writer=True), checkpoint.abstract_like(first))
    assert data == {"step": 1}
    assert_same_tree(state, first, "the previous, verified checkpoint should come back")


def test_an_older_checkpoint_without_checksums_restores_after_the_hinted_accept_command(two_checkpoints, capsys):
    from t5_retrieval import cli

    directory, first, second = two_checkpoints
    for step in ("1", "2"):
        os.remove(os.path.join(directory, step, checksums.CHECKSUMS_FILE))
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint") as raised:
        checkpoint.restore(checkpoint.manager(directory, writer=True), checkpoint.abstract_like(first))
    hint = str(raised.value).rpartition("as it is now: ")[2]
    assert hint == f"t5r checksum --accept {os.path.join(directory, '2')}", str(raised.value)
    assert cli.main(hint.split()[1:]) == 0
    state, data = checkpoint.restore(checkpoint.manager(directory, writer=True), checkpoint.abstract_like(first))
    assert data == {"step": 2}
    assert_same_tree(state, second, "the accepted checkpoint should restore as saved")


@pytest.fixture
def trained_model_dir(tmp_path) -> tuple[str, dict]:
    """Two steps saved after the run wrote its config.gin, as `t5r train` does."""
    directory = str(tmp_path / "model")
    os.makedirs(directory)
    with open(os.path.join(directory, OPERATIVE_CONFIG), "w") as f:
        f.write("make_train_iterator.task_module = 'my_tasks'\n")
    first, second = states()
    mngr = checkpoint.manager(directory, writer=True)
    checkpoint.save(mngr, 1, first, {"step": 1})
    checkpoint.save(mngr, 2, second, {"step": 2})
    return directory, first


def test_config_gin_is_covered_by_the_step_record_and_a_changed_one_is_refused(trained_model_dir, capsys):
    from t5_retrieval import cli

    directory, first = trained_model_dir
    config = os.path.join(directory, OPERATIVE_CONFIG)
    with open(config, "a") as f:
        f.write("make_train_iterator.task_module_path = ['/tmp/elsewhere']\n")  # would import other code
    differs = f"{config}: .*; it differs from the one this checkpoint was trained with"
    with pytest.raises(checkpoint.CheckpointError, match=differs) as raised:
        checkpoint.restore_params(directory, checkpoint.abstract_like(first["params"]))
    step_dir = os.path.join(directory, "2")
    assert cli.main(["checksum", step_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{config}: 103 bytes where 45 were written" in err, err
    hint = str(raised.value).rpartition("as it is now: ")[2]
    assert hint == f"t5r checksum --accept {step_dir}", str(raised.value)
    assert cli.main(hint.split()[1:]) == 0
    assert cli.main(["checksum", step_dir]) == 0
    assert checkpoint.restore_params(directory, checkpoint.abstract_like(first["params"]))[1] == 2


MALFORMED_STEP_RECORDS = {
    "a list": lambda doc: [doc],
    "files empty": lambda doc: {**doc, "files": {}},
    "an entry without sha256": lambda doc: {**doc, "files": {name: {"size": 1} for name in doc["files"]}},
    "model_files a list": lambda doc: {**doc, "model_files": ["config.gin"]},
    "an entry removed": lambda doc: {**doc, "files": dict(sorted(doc["files"].items())[1:])},
}


@pytest.mark.parametrize("shape", sorted(MALFORMED_STEP_RECORDS))
def test_a_malformed_step_record_is_an_unreadable_checkpoint_in_one_line(trained_model_dir, shape, capsys):
    from t5_retrieval import cli

    directory, first = trained_model_dir
    for step in ("1", "2"):
        path = os.path.join(directory, step, checksums.CHECKSUMS_FILE)
        with open(path) as f:
            doc = json.load(f)
        with open(path, "w") as f:
            json.dump(MALFORMED_STEP_RECORDS[shape](doc), f)
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"):
        checkpoint.restore_params(directory, checkpoint.abstract_like(first["params"]))
    assert cli.main(["checksum", os.path.join(directory, "2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(f"t5r checksum --accept {os.path.join(directory, '2')}"), err
