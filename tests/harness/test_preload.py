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
