"""Command-line plumbing shared by the scripts: the common flags, user errors, the output folder."""

import argparse
import re
import shutil
import sys
import uuid
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list


class UserError(Exception):
    """A mistake the user can fix (bad path, bad flag, wrong launch): printed as one message, exit code 2."""


class Interrupted(Exception):
    """The run saved a checkpoint and stopped because it was asked to (SIGTERM); the message is already printed."""


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
    except RuntimeError as error:
        from_collective = isinstance(error, torch.distributed.DistError) or re.search(r"gloo|nccl|c10d", str(error))
        if not (torch.distributed.is_initialized() and from_collective
                and re.search(PEER_LOST, str(error), re.IGNORECASE)):
            raise
        print(f"error: lost the other processes ({' '.join(str(error).split())}): one of them failed, hung longer "
              "than --dist_timeout, or its machine was lost; its own output says which. Continue from the last "
              "checkpoint with --resume latest.", file=sys.stderr, flush=True)
        sys.exit(1)


# what gloo and NCCL say when a collective's peer is gone or silent (other timeouts, a DataLoader's say, stay
# tracebacks: the error must also come from the process group)
PEER_LOST = r"time ?out|timed out|closed by peer|connection reset|broken pipe"


def add_common_args(parser, *, output_dir, epochs, batch_size, lr, weight_decay, label_smoothing, schedule,
                    warmup_fraction=0.2, max_grad_norm=None):
    """The flags every training script has; each script passes its own defaults so they stay visible there."""
    parser.add_argument("--data_dir", default="data", help="dataset location (default: %(default)s)")
    parser.add_argument("--download", action="store_true", help="fetch the dataset into --data_dir if missing")
    parser.add_argument("--output_dir", default=output_dir, help="run folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output_dir")
    parser.add_argument("--resume", default=None, metavar="latest|PATH",
                        help="continue a run: `latest` (the newest checkpoint in --output_dir) or a checkpoint folder")
    parser.add_argument("--checkpoint_every", type=int, default=None, metavar="N",
                        help="also checkpoint every N optimizer steps (default: at the end of each epoch only)")
    parser.add_argument("--keep_checkpoints", type=int, default=2, metavar="K",
                        help="keep the newest K checkpoints (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=epochs, help="default: %(default)s")
    parser.add_argument("--batch_size", type=int, default=batch_size, help="per process (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--weight_decay", type=float, default=weight_decay, help="default: %(default)s")
    parser.add_argument("--label_smoothing", type=float, default=label_smoothing, help="default: %(default)s")
    parser.add_argument("--schedule", choices=["onecycle", "cosine", "constant"], default=schedule,
                        help="LR schedule, stepped per optimizer step (default: %(default)s)")
    parser.add_argument("--warmup_fraction", type=float, default=warmup_fraction,
                        help="share of the steps spent warming up (onecycle, cosine; default: %(default)s)")
    parser.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    parser.add_argument("--max_grad_norm", type=float, default=max_grad_norm,
                        help="clip gradients to this norm (default: %(default)s)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="override the accelerate config's setting (bf16 on a recent GPU)")
    parser.add_argument("--channels_last", action="store_true",
                        help="keep the model in channels-last memory format (faster convolutions with bf16/fp16 on GPUs)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model through Accelerate's dynamo plugin (pays a compile at the start)")
    parser.add_argument("--max_steps", type=int, default=None, help="stop after this many optimizer steps (smoke runs)")
    parser.add_argument("--seed", type=int, default=42, help="default: %(default)s")
    parser.add_argument("--dist_timeout", type=float, default=600, metavar="SECONDS",
                        help="a collective that waits longer (a hung or lost process) ends the job (default: %(default)s)")
    parser.add_argument("--report_to", choices=["none", "tensorboard", "wandb", "all"], default="none",
                        help="experiment tracker through Accelerate (default: %(default)s)")


def check_args(args):
    """Reject flag values that cannot work before anything is built."""
    for name in ("epochs", "batch_size", "grad_accum", "keep_checkpoints", "max_steps", "checkpoint_every",
                 "dist_timeout"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --output_dir and --overwrite deletes it: pass one of them")


# flags that say where a run lives, how it loads data, how it reports and how fast it computes, not what it
# computes: a resumed run takes them from the command line, and every other argument from its checkpoint
RUNTIME_ARGS = {"data_dir", "download", "output_dir", "overwrite", "resume", "checkpoint_every", "keep_checkpoints",
                "report_to", "num_workers", "cache_images", "channels_last", "compile", "dist_timeout"}


def restore_args(args, saved, *, defaults):
    """The arguments of a resumed run: the checkpoint's, except the RUNTIME_ARGS flags.

    A flag left at its default takes the checkpoint's value; one given with another value than the
    checkpoint's is refused, since the run could not continue as it began.
    """
    restored = argparse.Namespace(**vars(args))
    for name, value in saved.items():
        if name in RUNTIME_ARGS or not hasattr(args, name) or getattr(args, name) == value:
            continue
        if getattr(args, name) != defaults.get(name):
            raise UserError(
                f"--{name} is {getattr(args, name)} on the command line but {value} in the checkpoint. A resumed run "
                f"keeps its arguments: drop --{name}, or start a new run in another --output_dir."
            )
        setattr(restored, name, value)
    return restored


RUN_FILES = ("metrics.jsonl", "checkpoints", "best", "classification_report.json")


def prepare_output_dir(output_dir, *, overwrite, resume, accelerator):
    """Refuse to train over an earlier run unless --resume or --overwrite; every rank checks before the main one writes."""
    output_dir = Path(output_dir)
    earlier = [] if resume else [name for name in RUN_FILES if (output_dir / name).exists()]
    if earlier and not overwrite:
        raise UserError(
            f"{output_dir} already holds a run ({', '.join(earlier)}). Pass --resume latest to continue it, "
            "--overwrite to replace it, or choose another --output_dir."
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name in earlier:
            path = output_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:
        check_shared(output_dir, accelerator)
    return output_dir


def check_shared(output_dir, accelerator):
    """Every process must see the main process's files: checkpoints hold each process's RNG state, and a node
    that writes its share to a local disk makes a checkpoint that cannot resume the run."""
    token = broadcast_object_list([uuid.uuid4().hex])[0]
    probe = output_dir / f".shared-check-{token}"
    if accelerator.is_main_process:
        probe.touch()
    accelerator.wait_for_everyone()
    seen = accelerator.gather(torch.tensor([probe.exists()], device=accelerator.device)).tolist()  # every process
    if accelerator.is_main_process:
        probe.unlink()
    if not all(seen):
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        raise UserError(
            f"--output_dir {output_dir} is not shared between the machines: processes {blind} do not see the file "
            "process 0 wrote there. Put --output_dir on a filesystem every node mounts (checkpoints hold every "
            "process's state)."
        )


def args_to_dict(args):
    """The run's arguments as JSON- and tracker-friendly scalars."""
    return {key: (value if isinstance(value, (int, float, str, bool)) or value is None else str(value))
            for key, value in vars(args).items()}

