"""`rank_preload` (ini): modules imported once in the parent, which forked ranks then already have."""

BODY = '''
import sys
from shardcheck.harness import distributed

@distributed(world_size=2)
def test_ranks_have_the_preloaded_module(ctx):
    assert "tabnanny" in sys.modules  # listed in rank_preload: imported by the parent, inherited
    assert "pyclbr" not in sys.modules  # not listed, never imported
'''


def test_ranks_inherit_the_preloaded_modules(pytester):
    pytester.makeini("[pytest]\nrank_preload =\n    tabnanny\n")
    pytester.makepyfile(test_preload_body=BODY)
    result = pytester.runpytest_subprocess("--shardcheck-backend", "gloo", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


MARKED = '''
import sys
import pytest
from shardcheck.harness import distributed

@distributed(world_size=2)
def test_unmarked_first(ctx):  # the pool's ranks fork here
    assert "tabnanny" in sys.modules and "pyclbr" not in sys.modules  # pyclbr: a deselected test's mark

@distributed(world_size=2)
@pytest.mark.rank_preload("tabnanny")
def test_marked(ctx):
    assert "tabnanny" in sys.modules  # marked on a selected test: imported by the parent, inherited

@distributed(world_size=2)
@pytest.mark.rank_preload("pyclbr")
def test_deselected(ctx):
    pass
'''


def test_a_selected_tests_rank_preload_mark_is_imported_before_its_ranks_fork(pytester):
    """The mark, as the zoo's cells carry it (checks/support/zoo.py): its modules join `rank_preload`
    when the test is selected; ranks forked before the marked test ran already have them."""
    pytester.makepyfile(test_marked_body=MARKED)
    result = pytester.runpytest_subprocess("--shardcheck-backend", "gloo", "-q", "-p", "no:cacheprovider",
                                           "-k", "not deselected")
    result.assert_outcomes(passed=2)
