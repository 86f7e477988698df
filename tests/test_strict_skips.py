"""``--strict-skips`` (tests/conftest.py): under it a test or a module that skips for any reason
but a missing CUDA device fails, naming the reason; without it skips stay skips."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SKIPS = """
import pytest

def test_missing_file():
    pytest.skip("test checkpoint beside the checkout not available")

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_cuda():
    pass

@pytest.mark.xfail(reason="a known failure")
def test_known():
    assert False

def test_passes():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A suite of the skips above and a module that skips as a whole, under the project's hooks."""
    pytester.makeconftest("from tests.conftest import pytest_addoption, pytest_make_collect_report, pytest_runtest_makereport")
    pytester.makepyfile(test_skips=SKIPS, test_module_skip='import pytest\npytest.importorskip("kvlib_no_such_package")\n')
    return pytester


def test_a_skip_for_anything_but_the_machine_fails_under_strict_skips(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--strict-skips", "--continue-on-collection-errors", "-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*--strict-skips: skipped for a reason other than 'needs a CUDA device': *kvlib_no_such_package*",  # ERRORS come first
            "*--strict-skips: skipped for a reason other than 'needs a CUDA device': Skipped: test checkpoint beside the checkout not available*",
        ]
    )


def test_without_strict_skips_skips_stay_skips(suite: pytest.Pytester) -> None:
    suite.runpytest("-p", "no:cacheprovider", "-n", "0").assert_outcomes(passed=1, skipped=3, xfailed=1)
