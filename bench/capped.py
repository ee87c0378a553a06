"""train.py on GPUs held to less memory than they have, as on a smaller card:

    torchrun --nproc_per_node=N bench/capped.py GIB [train.py flags]

Each rank calls torch.cuda.set_per_process_memory_fraction for GIB GiB of its GPU before train.py runs: the caching
allocator then refuses to hold more (an out-of-memory error where an 80 GB card would have none left), and
memory.capacity reads the share, so the layout chooser plans for GIB too.
"""
import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    gib, device = float(sys.argv.pop(1)), int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_per_process_memory_fraction(gib * 2 ** 30 / torch.cuda.get_device_properties(device).total_memory,
                                               device)
    sys.path.insert(0, ROOT)
    sys.argv[0] = os.path.join(ROOT, "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
