"""User errors and exit codes: a mistake the user can fix is one `error:` line and exit code 2, never a traceback."""

import re
import sys

import torch


class UserError(Exception):
    """A mistake the user can fix (bad path, bad flag, wrong launch): printed as one message, exit code 2."""


class Interrupted(Exception):
    """The run saved a checkpoint and stopped because it was asked to (SIGTERM); the message is already printed."""


# what gloo and NCCL say when a collective's peer is gone or silent (other timeouts, a DataLoader's say, stay
# tracebacks: the error must also come from the process group)
PEER_LOST = r"time ?out|timed out|closed by peer|connection reset|broken pipe"


def run(main, args):
    """Call `main(args)`; a UserError becomes one `error: ...` line on stderr and exit code 2, not a traceback.

    A run stopped by SIGTERM exits with 143, the code of a process killed by SIGTERM, so schedulers see
    that it did not finish. A collective that timed out (--dist_timeout) or lost its peer is another
    process's failure: it is said in one line, exit code 1.
    """
    try:
        return main(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted:
        sys.exit(143)
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C); with checkpoints, --resume latest continues from the last one",
              file=sys.stderr, flush=True)
        sys.exit(130)
    except RuntimeError as error:
        from_collective = isinstance(error, torch.distributed.DistError) or re.search(r"gloo|nccl|c10d", str(error))
        if not (torch.distributed.is_initialized() and from_collective
                and re.search(PEER_LOST, str(error), re.IGNORECASE)):
            raise
        print(f"error: lost the other processes ({' '.join(str(error).split())}): one of them failed, hung longer "
              "than --dist_timeout, or its machine was lost; its own output says which. Continue from the last "
              "checkpoint with --resume latest.", file=sys.stderr, flush=True)
        sys.exit(1)
