"""Where a train.py process's start-up goes: seconds to import torch and the project, then main() under cProfile with
backward on the calling thread (autograd runs a CUDA backward on its own thread, which cProfile does not see): the
functions by their own time, and torch.compile's time per frame. TRITON_PRINT_AUTOTUNING=1 adds a line per Triton
autotune (seconds, config chosen). cProfile's call tree is unreliable inside torch.compile'd frames (Dynamo
evaluates them itself); the own-time list is not.

  python bench/startup.py [--stats FILE] --preset tiny --steps 3      (any train.py flags)

Run it twice on a machine (the first process fills the caches, the second shows what a restart pays) and once on
one just started. --stats keeps the profile for pstats. bench/2026-11-26-startup.md has what it found.
"""
import cProfile
import os
import pstats
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

t_train = time.perf_counter()


def main(argv):
    path = None
    if argv[:1] == ["--stats"]:
        path, argv = argv[1], argv[2:]
    torch.autograd.set_multithreading_enabled(False)
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    prof.runcall(train.main, argv)
    t2 = time.perf_counter()
    if path:
        prof.dump_stats(path)
    stats = pstats.Stats(prof)
    print(f"import torch {t_torch - t0:.1f} s, the project {t_train - t_torch:.1f} s, main() {t2 - t1:.1f} s")
    stats.sort_stats("tottime").print_stats(25)
    if "torch._dynamo" in sys.modules:
        print(sys.modules["torch._dynamo"].utils.compile_times())


if __name__ == "__main__":
    main(sys.argv[1:])
