"""The real data iterator resumes on every host from a multi-host checkpoint, which holds only
process 0's iterator state (orbax writes JSON items from the primary host)."""

import json

import numpy as np
import pytest
from test_data_batches import _iterator, data_dir, vocab  # noqa: F401 (fixtures)


def test_host_1_resumes_its_own_shard_from_the_state_saved_by_host_0(data_dir, vocab):  # noqa: F811  (the fixtures imported above)
    hosts = [_iterator(data_dir, vocab, host_index=h, host_count=2) for h in range(2)]
    for it in hosts:
        for _ in range(5):
            next(it)
    saved = json.loads(json.dumps(hosts[0].state()))  # what the checkpoint holds
    expected = next(hosts[1])
    resumed = _iterator(data_dir, vocab, host_index=1, host_count=2)
    resumed.restore(saved)
    got = next(resumed)
    for name in expected:
        for key in expected[name]:
            np.testing.assert_array_equal(got[name][key], expected[name][key],
                                          err_msg=f"host 1 after restore: {name}/{key} is not its own next batch")
    with pytest.raises(ValueError, match="host_count"):
        _iterator(data_dir, vocab, host_index=0, host_count=1).restore(saved)
