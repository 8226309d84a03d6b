"""Where runs and tools write: checked before anything is computed, and nothing a user has is ever lost.

Three rules: everything a run reads and checks succeeds before anything is moved or replaced (an earlier run
goes aside into previous_run/ only at `set_aside_earlier_run`, once the data and the model are built); no
output is written onto an input (an image, the dataset tree); a file is replaced only by a rename of its
complete successor.
"""

import os
import shutil
import uuid
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from .errors import UserError

# a folder holding one of these holds a run; the others are written by a run too, and go aside with it
RUN_FILES = ("metrics.jsonl", "checkpoints", "best", "classification_report.json")
RUN_OUTPUTS = (*RUN_FILES, "classification_report.txt", "confusion_matrix.png", "curves.png", "logs", "test",
               "evaluation",
               ".best.tmp", ".best.old")
PREVIOUS_RUN = "previous_run"


def prepare_output_dir(output_dir, *, overwrite, resume, inputs, accelerator):
    """Check --output_dir before anything is built, and create it; moves and deletes nothing.

    Refused: a file, a folder that cannot be written, a folder inside an input (`inputs`: the data),
    and a folder holding an earlier run unless --resume or --overwrite. Every process checks; with
    several processes, all of them must see the main process's files there.
    """
    output_dir = Path(output_dir)
    check_not_inside(output_dir, inputs, flag="--output_dir")
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file: choose a folder (it is created if missing)")
    earlier = [] if resume else earlier_run(output_dir)
    if earlier and not overwrite:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        raise UserError(
            f"{output_dir} already holds a run ({', '.join(earlier)}). Pass --resume latest to continue it, "
            "--overwrite to replace it, or choose another --output_dir."
            + (f" This is the launcher's restart {restart} of the run: launch with --resume auto, and a restart "
               "continues from the last checkpoint." if restart else "")
        )
    if accelerator.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            probe = output_dir / f".write-check-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise UserError(f"cannot write to --output_dir {output_dir} ({error.strerror}): choose a folder on a "
                            "writable filesystem") from None
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:
        check_shared(output_dir, accelerator)
    return output_dir


def earlier_run(output_dir):
    """The RUN_FILES in `output_dir`: a run was there. A checkpoints/ folder without `latest` holds only what a
    save killed before its first checkpoint left, not a run."""
    return [name for name in RUN_FILES if (output_dir / name).exists()
            and (name != "checkpoints" or (output_dir / name / "latest").exists())]


def set_aside_earlier_run(output_dir, accelerator):
    """Move an earlier run's outputs (an --overwrite) into output_dir/previous_run/, replacing an older one there.

    Call it once everything the new run reads has been read and checked, before its first write: a run that
    fails before this point leaves the earlier run as it was. previous_run/ is deleted when the new run saves
    its first checkpoint (`remove_previous_run`), so a run that fails before that leaves it to recover from.
    Files of ours only: whatever else the folder holds (a scheduler's log, notes) stays where it is.
    """
    output_dir = Path(output_dir)
    if accelerator.is_main_process and earlier_run(output_dir):
        previous = output_dir / PREVIOUS_RUN
        shutil.rmtree(previous, ignore_errors=True)
        previous.mkdir()
        for name in RUN_OUTPUTS:
            if (output_dir / name).exists():
                os.replace(output_dir / name, previous / name)
        accelerator.print(f"--overwrite: the earlier run is in {previous} until this run's first checkpoint")
    accelerator.wait_for_everyone()


def remove_previous_run(output_dir):
    """The new run has a checkpoint of its own: the run it replaced is no longer needed (main process)."""
    shutil.rmtree(Path(output_dir) / PREVIOUS_RUN, ignore_errors=True)


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


def check_not_inside(output, inputs, *, flag):
    """Refuse an output that is one of the inputs or lies inside an input folder (a dataset tree)."""
    resolved = Path(output).resolve()
    for item in inputs:
        source = Path(item).resolve()
        if resolved == source or source in resolved.parents:
            raise UserError(f"{flag} {output} is inside the input {item}: its files would be mixed into the data "
                            f"(and read as images by the next run). Choose a place outside {item}.")


def check_output_file(path, *, suffix, what, is_ours, inputs=(), overwrite=False):
    """Check, before any work, that a tool can write its output file `path`: the name ends in `suffix`, its
    folder exists, it is not a folder and not one of `inputs`, and if it exists it is an earlier output of
    the tool (`is_ours(path)`, `what` names it: "a CSV written by predict.py") or `overwrite` is set."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--output {path} is a folder: give a file name, e.g. {path / ('output' + suffix)}")
    if path.suffix.lower() != suffix:
        raise UserError(f"--output {path}: the output is {what}, so its name must end in {suffix} (after a shell "
                        "glob such as --output imgs/*.jpg, the first image would have been the output)")
    if not path.parent.is_dir():
        raise UserError(f"--output {path}: the folder {path.parent} does not exist; create it or choose another file")
    if any(path.resolve() == Path(item).resolve() for item in inputs):
        raise UserError(f"--output {path} is one of the inputs: writing there would destroy it. Choose another "
                        "file (a shell glob after --output names an input as the output)")
    if path.exists() and not overwrite and not is_ours(path):
        raise UserError(f"--output {path} exists and is not {what}: choose another file, or pass --overwrite to "
                        "replace it")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"--output {path}: the folder {path.parent} is not writable")


def write_atomically(path, write):
    """Write through a temporary file beside `path` and rename it, so a kill never leaves a half-written `path`
    and a failure leaves the old one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
