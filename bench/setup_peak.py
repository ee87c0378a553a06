"""The set-up peak on the CPU: the resident memory one `train.py ARGS --steps 0` process reaches above what it held
before set-up (VmHWM after, VmRSS before), next to the bytes of the weights it set up. --cuda-dtypes gives the
weights the dtypes a CUDA run gives them (optim.weight_dtypes: frozen and sharded-trained ones bf16), on the CPU.
Run it with glibc returning freed tensors at once, so that the peak is the tensors' (on a GPU tests/test_gpu.py
measures torch.cuda.max_memory_allocated instead):

  MALLOC_MMAP_THRESHOLD_=65536 python bench/setup_peak.py [--cuda-dtypes] --preset small --seq-len 128 \
      --mock-image-size 64 --vocab-size 65536 --hidden-size 512 --lora-rank 8

That run (LoRA: the base frozen; largest parameter the 65536 x 512 embedding, a 128 MiB fp32 draw): 1034.9 MiB
above the start for 896.9 MiB of fp32 weights, 586.6 MiB for 448.5 MiB with --cuda-dtypes (the weights and one
draw, + about 10 MiB); the fp32 init before init.py (commit a2b2a4a) reached 1156.7 MiB (the weights and two
full-size draws), and on CUDA the same, before its cast to bf16.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optim  # noqa: E402
import train  # noqa: E402


def status(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def main(argv):
    if argv[:1] == ["--cuda-dtypes"]:
        argv, real = argv[1:], optim.weight_dtypes

        def cuda_dtypes(par, vision, lm, cfg, device):
            return real(par, vision, lm, cfg, torch.device("cuda"))
        optim.weight_dtypes = cuda_dtypes
    torch.nn.utils.skip_init(torch.nn.Linear, 1, 1)   # the lazy imports set-up triggers, before the baseline
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    start = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:   # VmHWM := VmRSS
        f.write("5")
    _, modules = train.main(argv + ["--steps", "0"])
    weights = sum(t.numel() * t.element_size() for m in modules.values() for t in [*m.parameters(), *m.buffers()])
    print(f"set-up peak {(status('VmHWM:') - start) / 2**20:.1f} MiB above the start; weights "
          f"{weights / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
