"""tuned.py's pinning rule, on the CPU (tests/test_gpu.py checks that the kernels take the tabled configs)."""
import tuned


def test_a_tabled_shape_benchmarks_its_config_alone():
    prune = tuned._prune_to({"16,8": "picked"}, ["chunk_size", "nheads"], None)
    # the key's values come from positional arguments (nargs) and keyword arguments alike
    assert prune(["other", "picked"], {"chunk_size": 16}, nheads=8) == ["picked"]
    assert prune(["other", "picked"], {"chunk_size": 16, "nheads": 8}) == ["picked"]
    assert prune(["other", "picked"], {"chunk_size": 16}, nheads=4) == ["other", "picked"]   # untabled: autotunes


def test_an_untabled_shape_keeps_the_kernels_own_pruning():
    def before(configs, nargs, **kwargs):
        return configs[:1]
    prune = tuned._prune_to({"16,8": "picked"}, ["chunk_size", "nheads"], before)
    assert prune(["other", "picked"], {"chunk_size": 32, "nheads": 8}) == ["other"]
    assert prune(["other", "picked"], {"chunk_size": 16, "nheads": 8}) == ["picked"]

