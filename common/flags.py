"""Command-line flags: one parser style for every script and tool. Every numeric flag has a `type=` from here, so
`--lr nan` or `--batch_size 0` stops at parse time with one line naming the flag, never as a traceback later."""

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from .errors import UserError, exit_with_message
from .images import not_utf8
from .optim import SCHEDULES


class ParsedArgs(argparse.Namespace):
    """argparse's result, which also knows the flags typed (`typed`) and the runtime flags (`runtime`); slots, so
    that vars(args), the run's arguments, leave them out."""

    __slots__ = ("typed", "runtime")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (a 30-flag usage would bury the message) that records which flags were
    typed, so that a resumed run tells `--epochs 2` from the default 2."""

    raise_errors = False  # restore_args: a bad saved value is a UserError of its own, not an exit

    def error(self, message):
        text = f"{self.prog}: error: {message} (see --help)"
        if ArgumentParser.raise_errors:
            raise UserError(text)
        exit_with_message(text, 2)

    runtime_flags = frozenset()

    def add_runtime_argument(self, *args, **kwargs):
        """A flag on where a run lives, how it loads data, reports or how fast it runs, not on what it computes: a
        resumed run takes it from the command line, every other flag from its checkpoint."""
        action = self.add_argument(*args, **kwargs)
        self.runtime_flags = self.runtime_flags | {action.dest}
        return action

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        parsed, extras = super().parse_known_args(args, ParsedArgs() if namespace is None else namespace)
        if isinstance(parsed, ParsedArgs):
            parsed.typed, parsed.runtime = self._typed(args), self.runtime_flags
        return parsed, extras

    def _typed(self, args):
        """Parsed again with no defaults, what is left was typed (abbreviations and --flag=value included). Flags
        only: a positional with nargs '*' keeps its default (SUPPRESS would be checked against its choices)."""
        saved = self._defaults, {action: action.default for action in self._actions}
        self._defaults = {}
        for action in self._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
        try:
            return frozenset(vars(super().parse_known_args(args, argparse.Namespace())[0])) - {
                action.dest for action in self._actions if not action.option_strings}
        finally:
            self._defaults = saved[0]
            for action, default in saved[1].items():
                action.default = default


def number(kind=float, *, min=None, max=None, min_open=False, max_open=False):
    """An argparse `type`: an int or a finite float within [min, max] (`min_open`/`max_open` exclude the bound)."""
    bounds = [f"{'above' if min_open else 'at least'} {min}" if min is not None else "",
              f"{'below' if max_open else 'at most'} {max}" if max is not None else ""]
    wanted = f"{'an integer' if kind is int else 'a number'} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        outside = ((min is not None and (value <= min if min_open else value < min))
                   or (max is not None and (value >= max if max_open else value > max)))
        if not math.isfinite(value) or outside:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse calls the type in its own messages
    return parse


positive_int = number(int, min=1)
nonnegative_int = number(int, min=0)
positive_float = number(float, min=0, min_open=True)
nonnegative_float = number(float, min=0)
probability = number(float, min=0, max=1)
seed = number(int, min=0, max=2**32 - 1)  # what numpy's and torch's generators accept


def path(text):
    """An argparse `type` for a path: not empty (`--output_dir ""` would be the current folder), UTF-8 text, and `~`
    the home folder (a shell leaves it in `--output_dir=~/runs` and in quotes: a folder named ~ in the current one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path")
    bad = not_utf8([text])
    if bad:  # a run given such an --output_dir trained, then stopped at its report.html
        raise argparse.ArgumentTypeError(
            f"{bad[0]} is not UTF-8 text, which the log and the reports could not write: give a path whose names are "
            "UTF-8 (an existing one renamed: convmv -f latin1 -t utf-8 --notest PATH)")
    return os.path.expanduser(text)


def device(text):
    """An argparse `type` for --device: `cpu`, `cuda`, `cuda:1`, ... and only one this machine has."""
    try:
        value = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N") from None
    if value.type not in ("cpu", "cuda"):  # torch's mps, xpu, meta ...: the scripts would run on the CPU instead
        raise argparse.ArgumentTypeError(f"{text}: these scripts run on cpu, cuda or cuda:N only")
    if value.type == "cuda" and (not torch.cuda.is_available() or (value.index or 0) >= torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA devices; "
                                         "use --device cpu")
    return text


# test-time augmentation, by name: the views whose probabilities common.evaluation.probabilities averages
TTA = ("none", "flip", "flip_translate")


def add_tta_arg(parser, *, training=False):
    """--tta: the training scripts average each epoch's evaluation (and the test set's) over it, the tools their
    images."""
    images = ("each epoch's evaluation and the test set's (the suspected-label pass stays plain)" if training
              else "the images")
    parser.add_argument("--tta", choices=TTA, default="none",
                        help=f"test-time augmentation of {images}: flip (averaged with the mirror image), "
                             "flip_translate (and with 1-pixel shifts, the fast CIFAR-10 recipe's; default: "
                             "%(default)s)")


def add_common_args(parser):
    """The flags every training script has; each script sets its recipe's defaults (`parser.set_defaults`), so they
    stay visible there. The runtime ones may change when a run is resumed."""
    parser.add_runtime_argument("--data_dir", type=path, default="data", help="dataset location (default: %(default)s)")
    parser.add_runtime_argument("--download", action="store_true", help="fetch the dataset into --data_dir if missing")
    parser.add_runtime_argument("--output_dir", type=path, default=None, help="run folder (default: %(default)s)")
    parser.add_runtime_argument("--overwrite", action="store_true",
                                help="replace an earlier run in --output_dir (it is kept in previous_run/ until this "
                                     "run's first checkpoint)")
    parser.add_runtime_argument("--resume", type=path, default=None, metavar="latest|auto|PATH",
                                help="continue a run: `latest` (the newest checkpoint in --output_dir), a checkpoint "
                                     "folder, or `auto`: continue when --output_dir holds a checkpoint of this very "
                                     "command, start when it holds none (for launcher restarts and requeued jobs)")
    parser.add_runtime_argument("--checkpoint_every", type=positive_int, default=None, metavar="N",
                                help="also checkpoint every N optimizer steps (default: at the end of each epoch only)")
    parser.add_runtime_argument("--keep_checkpoints", type=positive_int, default=2, metavar="K",
                                help="keep the newest K checkpoints (default: %(default)s)")
    parser.add_argument("--epochs", type=positive_int, default=None, help="default: %(default)s")
    parser.add_argument("--batch_size", type=positive_int, default=None, help="per process (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="peak learning rate, used as given (default: the recipe's, scaled to the global batch; "
                             "the first log line says how)")
    parser.add_argument("--weight_decay", type=nonnegative_float, default=None, help="default: %(default)s")
    parser.add_argument("--label_smoothing", type=number(float, min=0, max=1, max_open=True), default=None,
                        help="default: %(default)s")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                        help="LR schedule, stepped per optimizer step (default: %(default)s)")
    parser.add_argument("--warmup_fraction", type=number(float, min=0, max=1, max_open=True), default=0.2,
                        help="share of the steps spent warming up (onecycle, cosine; default: %(default)s)")
    parser.add_runtime_argument("--grad_accum", type=positive_int, default=1,
                                help="gradient accumulation steps; the global batch is --batch_size x processes x "
                                     "this. A resumed run keeps its global batch and sets this from the process count "
                                     "(default: 1)")
    parser.add_argument("--ema_decay", type=number(float, min=0, max=1, min_open=True, max_open=True), default=None,
                        help="also keep an exponential moving average of the weights (e.g. 0.999), evaluated beside "
                             "them every epoch; best/ takes the better (default: off)")
    add_tta_arg(parser, training=True)
    parser.add_argument("--max_grad_norm", type=nonnegative_float, default=None,
                        help="clip gradients to this norm, 0: not clipped (default: %(default)s)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="override the accelerate config's setting; without a config: bf16 where the device "
                             "computes it natively (GPUs since Ampere, CPUs with AVX-512 BF16 or AMX), else no")
    parser.add_runtime_argument("--channels_last", action=argparse.BooleanOptionalAction, default=True,
                                help="keep the model in channels-last (NHWC) memory format: the same model, "
                                     "faster convolutions on CPUs (oneDNN) and under bf16/fp16 on GPUs (default: on)")
    parser.add_runtime_argument("--compile", action="store_true",
                                help="torch.compile the model through Accelerate's dynamo plugin (pays a compile at "
                                     "the start)")
    parser.add_runtime_argument("--find_label_issues", action=argparse.BooleanOptionalAction, default=True,
                                help="at the end, score the training images with the final model for the mistakes "
                                     "report's suspected wrong labels (one pass over them; default: on)")
    parser.add_argument("--max_steps", type=positive_int, default=None,
                        help="stop after this many optimizer steps (smoke runs)")
    parser.add_argument("--seed", type=seed, default=42, help="default: %(default)s")
    parser.add_runtime_argument("--dist_timeout", type=number(float, min=0, max=7 * 24 * 3600, min_open=True),
                                default=600, metavar="SECONDS", help="a collective that waits longer (a hung or lost "
                                                                     "process) ends the job (default: %(default)s)")
    parser.add_runtime_argument("--report_to", choices=["none", "tensorboard", "wandb", "all"], default="none",
                                help="experiment tracker through Accelerate (default: %(default)s)")


def check_args(args):
    """The checks that concern several flags at once."""
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --output_dir and --overwrite replaces it: pass one of them")
    logs = Path(args.output_dir) / "logs"
    if args.report_to in ("tensorboard", "all") and logs.exists() and not logs.is_dir() and not args.overwrite:
        raise UserError(f"--report_to {args.report_to}: {logs} is a file, and the tracker writes its logs into a "
                        "folder of that name. Move the file away, or choose another --output_dir")
    if args.report_to in ("tensorboard", "wandb"):
        from accelerate.utils import is_tensorboard_available, is_wandb_available

        if not (is_tensorboard_available if args.report_to == "tensorboard" else is_wandb_available)():
            raise UserError(f"--report_to {args.report_to}: the {args.report_to} package is not installed, so nothing "
                            f"would be logged. pip install {args.report_to}, or leave --report_to out")


def args_to_dict(args):
    """The run's arguments as JSON- and tracker-friendly scalars."""
    return {key: (value if isinstance(value, (int, float, str, bool)) or value is None else str(value))
            for key, value in vars(args).items()}
