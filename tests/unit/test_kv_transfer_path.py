"""How the store connector moves a cache's blocks (kvstore/transfer_path.py): the
choice for every kind of cache, decided without a GPU."""

from __future__ import annotations

import pytest

from tandem.kvstore.transfer_path import KVTransferPath, plan_kv_transfer


@pytest.mark.parametrize(
    "devices,one_tensor,path,pinned",
    [
        ({"cpu"}, True, KVTransferPath.IN_PLACE, False),
        # several ranks' shards (or a strided cache) on the host: staged, pageable
        ({"cpu"}, False, KVTransferPath.HOST_STAGING, False),
        # GPU memory: always through a pinned host buffer, one tensor or shards
        ({"cuda"}, True, KVTransferPath.HOST_STAGING, True),
        ({"cuda"}, False, KVTransferPath.HOST_STAGING, True),
        ({"cpu", "cuda"}, False, KVTransferPath.HOST_STAGING, True),
        ({"xpu"}, True, KVTransferPath.HOST_STAGING, False),
    ],
)
def test_plan(devices, one_tensor, path, pinned):
    plan = plan_kv_transfer(devices, one_tensor)
    assert (plan.path, plan.pinned) == (path, pinned)
    assert plan.reason


def test_plan_needs_a_device():
    with pytest.raises(ValueError, match="device_types"):
        plan_kv_transfer(set(), True)
