"""pytest plugin for tests/python/run_upstream.sh: keep a seeded random sample of the
collected tests (--upstream-sample N, --upstream-seed S; the same N, seed and test file
give the same sample), so that flash-attention's own test file can be run in part. The draw
is made from the tests left after pytest's own selection (-k, -m), so that `-k
test_flash_attn_causal` samples that test alone."""

import random

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("upstream sample")
    group.addoption("--upstream-sample", type=int, default=0,
                    help="run N tests drawn at random from those collected (0 = all)")
    group.addoption("--upstream-seed", type=int, default=0, help="seed of the draw")


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs
def pytest_collection_modifyitems(config, items):
    n = config.getoption("--upstream-sample")
    if n <= 0 or n >= len(items):
        return
    ids = sorted(item.nodeid for item in items)  # independent of collection order
    keep = set(random.Random(config.getoption("--upstream-seed")).sample(ids, n))
    deselected = [item for item in items if item.nodeid not in keep]
    items[:] = [item for item in items if item.nodeid in keep]
    config.hook.pytest_deselected(items=deselected)
