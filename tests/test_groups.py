"""``make test``'s workers keep each ``xdist_group`` on one worker (``--dist loadgroup``)."""

import pytest


@pytest.mark.xdist_group("measured")
def test_make_test_keeps_a_group_on_one_worker(request):
    """The groups share work (the ``measured`` points, one fresh process for the cycle check) and keep
    the GPU tests one after another. pytest 9.2 with pytest-xdist 3.8.0 drops them without a word
    (pytest-xdist issue 1386: xdist writes the group into ``Item._nodeid``, which pytest 9.2's
    structured node ids no longer read), so pyproject.toml keeps pytest below 9.2. Fails when a
    pytest and xdist pair loses the groups again."""
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not under make test's --dist loadgroup (pytest-xdist)")
    assert request.node.nodeid.endswith("@measured"), request.node.nodeid
