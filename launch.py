"""torchrun (`python launch.py` takes its arguments) with the run's own last word last: a rank that ends the run
says why in one line (docs/failures.md), after which torchrun would print 20-40 lines of its own and exit 1 whatever
the rank's status, and no torchrun option keeps them off the console. Here its log lines and failure table go to
torchrun.log in its --log-dir, and the exit status is the rank's. A rank ended without a word by a signal torchrun
did not send (the out-of-memory killer, a segfault) gets one line here, naming the file.
"""
import logging
import os
import sys
import tempfile

from torch.distributed import run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

REPORT = "torchrun.log"
# what torchrun logs when it signals a rank itself: its SIGTERM to those still running once one ended, its SIGKILL
# to those still running --shutdown-timeout later (a stopped rank); the pid is the first argument
SIGNALLING = ("Sending process %s closing signal %s", "Unable to shutdown process %s via %s, forcefully exiting via %s")


class Signalled(logging.Filter):
    """The pids torchrun signalled, from its log records."""

    def __init__(self):
        super().__init__()
        self.pids = set()

    def filter(self, record):
        if record.msg in SIGNALLING:
            self.pids.add(record.args[0])
        return True


def main(argv):
    args = run.parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
    os.makedirs(args.log_dir, exist_ok=True)   # torchrun logs before it makes it (OMP_NUM_THREADS unset)
    report = os.path.join(args.log_dir, REPORT)
    torch_log = logging.getLogger("torch.distributed")   # torchrun's loggers write through this one's handler
    to_file, signalled = logging.FileHandler(report, delay=True), Signalled()
    to_file.setFormatter(next((h.formatter for h in torch_log.handlers if h.formatter), None))
    to_file.addFilter(signalled)
    torch_log.handlers = [to_file]
    try:
        run.run(args)
    except SignalException as e:   # torchrun forwarded it to the ranks and waited for them: they said the rest
        return 128 + e.sigval
    except ChildFailedError as e:
        with open(report, "a") as f:
            f.write(e.format_msg() + "\n")
        killed = {r: x for r, x in e.failures.items() if x.exitcode < 0 and x.pid not in signalled.pids}
        for rank, failure in killed.items():
            print(f"error: rank {rank} (pid {failure.pid}) was ended by {failure.signal_name()} without a word. "
                  f"See the kernel's log (dmesg: an out-of-memory kill, a segfault) and torchrun's report, {report}",
                  file=sys.stderr, flush=True)
        rank, failure = next(iter(killed.items()), e.get_first_failure())   # else the first rank to end itself
        return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
