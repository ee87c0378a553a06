"""train.py with each step's samples on lanes in index order, as before lanes.assign: the A/B of balanced lanes
(bench/2026-11-28-data-speed.md §2). The same flags as train.py, under torchrun as it is:

  torchrun --nproc_per_node=2 bench/index_order.py --preset 20l ... --data PATH --pack ...

The logged lane imbalance is then index order's. The class lives in this module, which spawned loader workers
import by name (PYTHONPATH below), since they unpickle the order."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import lanes  # noqa: E402


class IndexLanes(lanes.Lanes):
    def step(self, base):
        if base not in self.cache:
            work = lanes.costs(self.cfg, self.ds, range(base, base + self.group), self.trains, self.rates)
            self.cache = {base: (list(range(base, base + self.group)), work)}
        return self.cache[base]


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    import index_order
    lanes.Lanes = index_order.IndexLanes
    sys.argv = [os.path.join(os.path.dirname(HERE), "train.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
