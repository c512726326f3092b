import os
import random

import pytest


@pytest.fixture
def seed(request):
    """A fresh random seed per test, printed on failure (FLASHATTN_TEST_SEED pins it)."""
    value = int(os.environ.get("FLASHATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    request.node.user_properties.append(("seed", value))
    print(f"seed = {value} (rerun with FLASHATTN_TEST_SEED={value})")
    return value
