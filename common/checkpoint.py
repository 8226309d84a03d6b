"""Checkpoints that a kill cannot break, and exact resuming from them.

A checkpoint is `accelerator.save_state` plus trainer_state.json (where the run stands, the LR schedule, the model
description, the arguments). Resuming unpickles only through `torch.load(weights_only=True)` (Accelerate >= 1.1).
"""

import difflib
import json
import os
import shutil
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError

from .errors import NothingToDo, UserError
from .flags import ArgumentParser, args_to_dict, check_args
from .models import check_weights, read_json
from .outputs import (PREVIOUS_RUN, earlier_run, failed_write_is_said, find_damage, finish_later, finish_writes,
                      has_checkpoint, latest_checkpoint, publish, remove, remove_previous_run, sha256, write_atomically)
from .reporting import truncate_metrics


def save_checkpoint(accelerator, output_dir, name, *, state, keep, later=False):
    """Save the run as checkpoints/NAME (`state` as trainer_state.json), point `latest` at it and keep the newest
    `keep`; every process calls it. Written in .tmp-NAME, then published: after any kill `latest` names a whole one.
    `later`: process 0 checksums, flushes and publishes it on common.outputs.finish_later's thread while
    training goes on (every file is complete when save_state returns; the next save or the run's end waits)."""
    checkpoints = Path(output_dir) / "checkpoints"
    tmp, final = checkpoints / f".tmp-{name}", checkpoints / name
    if accelerator.is_main_process:
        remove(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        with failed_write_is_said(final):
            accelerator.save_state(tmp, safe_serialization=True)
        accelerator.wait_for_everyone()
    except BaseException:
        if accelerator.is_main_process:
            remove(tmp)  # after a failure: nothing half-written stays
        raise

    def finish():
        try:
            with failed_write_is_said(final):  # each file's size and checksum, verified before a resume uses them
                files = {str(file.relative_to(tmp)): [file.stat().st_size, sha256(file)]
                         for file in sorted(tmp.rglob("*")) if file.is_file()}
                (tmp / "trainer_state.json").write_text(json.dumps({**state, "files": files}, indent=1))
                publish(tmp, final)  # may replace the same point (a resumed run that stopped again at once)
        finally:
            remove(tmp)
        write_atomically(checkpoints / "latest", lambda path: path.write_text(name + "\n"))
        remove_previous_run(output_dir)  # the run an --overwrite replaced: this run can now be resumed instead
        names = sorted(path.name for path in checkpoints.glob("epoch_*"))  # training order; `name` is the last
        for old in names[:-keep]:
            remove(checkpoints / old)

    if accelerator.is_main_process:
        if later:
            finish_later(finish)
        else:
            finish_writes()  # in order: what was handed over before
            finish()
    accelerator.wait_for_everyone()
    return final


def resolve_args(args, *, parse_args):
    """(the run's arguments, its checkpoint or None); with --resume, the checkpoint's arguments. `--resume auto`
    starts a run that has no checkpoint, and stops a finished one with NothingToDo (exit 0), where `latest` refuses."""
    check_args(args)
    if not args.resume or (args.resume == "auto" and not has_checkpoint(args.output_dir)):
        return args, None  # nothing to resume yet: a new run
    checkpoint = find_checkpoint(args.output_dir, "latest" if args.resume == "auto" else args.resume)
    if args.resume == "auto":
        check_same_run(args, checkpoint)
    args = restore_args(args, checkpoint["args"], parse_args=parse_args)
    finished = finished_because(checkpoint, epochs=args.epochs, max_steps=args.max_steps,
                                patience=getattr(args, "patience", None))
    if finished and args.resume == "auto":
        # report.html is the last file a finished run writes: without it (a full disk at the end) the run stopped
        # writing its final reports, and evaluate.py writes them
        unreported = not (Path(args.output_dir) / "report.html").exists()
        raise NothingToDo(f"--resume auto: the run in {args.output_dir} is finished ({finished}): nothing to do. "
                          f"Its best model is in {Path(args.output_dir) / 'best'}"
                          + (f"; its final reports were not written (scripts/evaluate.py --model_dir "
                             f"{args.output_dir} writes those of best/)" if unreported else ""))
    if finished:
        raise UserError(f"checkpoint {checkpoint['path']} is the end of a finished run ({finished}): nothing to "
                        "resume. Its best model is in best/.")
    args.grad_accum = keep_global_batch(checkpoint, processes=int(os.environ.get("WORLD_SIZE", 1)))  # if unfinished
    return args, checkpoint


def keep_global_batch(checkpoint, *, processes):
    """The accumulation steps that keep the checkpoint's global batch on `processes` (8 x 1 -> 4 x 2): a run is
    defined by its seed and global batch, not by its process count. Refused when they cannot keep it."""
    per_step = checkpoint["num_processes"] * checkpoint["args"]["grad_accum"]
    if per_step % processes:
        counts = " or ".join(str(n) for n in range(1, per_step + 1) if per_step % n == 0)
        raise UserError(f"checkpoint {checkpoint['path']} trains {per_step} micro-batch(es) of --batch_size "
                        f"{checkpoint['args']['batch_size']} per optimizer step ({checkpoint['num_processes']} "
                        f"process(es) x {checkpoint['args']['grad_accum']} accumulation step(s)), which {processes} "
                        f"processes cannot share out evenly: launch {counts} process(es) to continue it.")
    return per_step // processes


def check_same_run(args, checkpoint):
    """--resume auto continues only the run this very command started: all but the runtime flags as saved."""
    ours, shown = args_to_dict(args), lambda value: "unset" if value is None else value
    differ = [f"--{name} {shown(saved)} there, {shown(ours.get(name))} here"
              for name, saved in checkpoint["args"].items()
              if name not in args.runtime and ours.get(name) != saved]
    if differ:
        raise UserError(f"--resume auto: {args.output_dir} holds another run ({'; '.join(differ)}). Continue that "
                        "run with --resume latest (it keeps its own arguments), replace it with --overwrite in place "
                        "of --resume, or choose another --output_dir.")


def restore_args(args, saved, *, parse_args):
    """The checkpoint's arguments, except the runtime flags; a flag typed with another value (even its default) is
    refused. Parsed again, so that a value edited by hand in trainer_state.json is checked like a typed one."""
    defaults, restored = vars(parse_args([])), dict(vars(args))
    foreign = [f"--{name}" for name in saved if name not in defaults]
    if foreign:  # else the other script's values were checked against this one's flags, and called edited by hand
        raise UserError(f"the checkpoint is another training script's (or another version's): its arguments "
                        f"{', '.join(foreign[:4])} are not this script's. Resume it with the script that trained it, "
                        "or choose another --output_dir.")
    typed = getattr(args, "typed", None)  # None: built without our parser; a value other than the default was typed
    for name, value in saved.items():
        if name in args.runtime or name not in restored or restored[name] == value:
            continue
        if (name in typed) if typed is not None else restored[name] != defaults[name]:
            raise UserError(f"--{name} is {restored[name]} on the command line but "
                            f"{'unset (its default)' if value is None else value} in the checkpoint. A resumed run "
                            f"keeps its arguments: drop --{name}, or start a new run in another --output_dir.")
        restored[name] = value
    argv = []
    for name, value in restored.items():
        if value == defaults[name]:
            continue
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        elif value is not None:
            argv += [f"--{name}", str(value)]
    ArgumentParser.raise_errors = True
    try:
        parsed = parse_args(argv)
    except UserError as error:
        raise UserError(f"the arguments saved in the checkpoint (trainer_state.json) are not valid ({error}); was "
                        "the file edited? Resume from another checkpoint, or fix the value.") from None
    finally:
        ArgumentParser.raise_errors = False
    # what the checkpoint left unset stays unset where the recipe has a default since (CIFAR-10's clipping to norm 1)
    for name, value in restored.items():
        if value is None:
            setattr(parsed, name, None)
    return parsed


def find_checkpoint(output_dir, resume):
    """The checkpoint --resume names: its trainer state + "path". Only JSON is read: it runs before any build."""
    output_dir, checkpoints = Path(output_dir), Path(output_dir) / "checkpoints"
    others = sorted(p.name for p in checkpoints.glob("epoch_*")) if checkpoints.is_dir() else []
    choose = (f"Pass one of {', '.join(str(checkpoints / name) for name in others)}" if others
              else "Check --output_dir, or start a new run without --resume") + "."
    if (output_dir / PREVIOUS_RUN).is_dir():
        choose += (f" {output_dir / PREVIOUS_RUN} holds what was set aside until a first checkpoint (the run an "
                   "--overwrite replaced, or the later checkpoints of a run resumed from an older one): move its files "
                   f"back into {output_dir} to continue from them.")
    if resume == "latest":
        pointer, earlier = checkpoints / "latest", earlier_run(output_dir)
        if not pointer.is_file() and earlier:
            raise UserError(f"--resume latest: {output_dir} holds the outputs of a run that never reached its first "
                            f"checkpoint ({', '.join(earlier)}): there is nothing to continue. Start it again with "
                            "--resume auto or --overwrite.")
        if not pointer.is_file() and output_dir.name == "checkpoints" and (output_dir / "latest").is_file():
            raise UserError(f"--resume latest: --output_dir {output_dir} is the run's checkpoints/ folder: pass the "
                            f"run's own folder, --output_dir {output_dir.parent}")
        if not pointer.is_file():
            raise UserError(f"--resume latest: no checkpoint in {checkpoints} ({pointer.name} not found). {choose}")
        path = latest_checkpoint(checkpoints)
        if not path.is_dir():
            raise UserError(f"--resume latest: {pointer} names {path.name}, which no longer exists. {choose}")
    else:
        path = Path(resume)
        if not path.exists():  # a checkpoint's name, or a path in the run's folder: found there
            path = next((folder for folder in (checkpoints / resume, output_dir / resume)
                         if (folder / "trainer_state.json").is_file()), path)
        if path.is_file() and (path.parent / "trainer_state.json").is_file():  # a file of a checkpoint: its folder
            path = path.parent
    state_path = path / "trainer_state.json"
    if not state_path.is_file():
        run = next((folder for folder in (path, path.parent) if (folder / "checkpoints" / "latest").is_file()), None)
        meant = difflib.get_close_matches(str(resume), ["latest", "auto"], n=1)
        if not path.exists() and meant:
            raise UserError(f"--resume {resume}: no such checkpoint folder; did you mean --resume {meant[0]}?")
        raise UserError(f"--resume {resume}: {path} "
                        + ("is not a checkpoint (no trainer_state.json in it). " if path.exists() else "not found. ")
                        + (f"To continue the run in {run} from its last checkpoint, pass --resume latest"
                           + ("" if run.resolve() == output_dir.resolve() else f" --output_dir {run}") + "."
                           if run else "Pass `latest`, `auto` or a folder from OUTPUT_DIR/checkpoints/."))
    state, problem = read_json(state_path, check=_check_state)
    if problem:
        raise UserError(f"{state_path} is damaged or not written by our training scripts ({problem}); resume from "
                        f"another checkpoint. {choose}")
    damage = find_damage(path, state.get("files", {}))  # checkpoints written before the field existed: not checked
    if damage:
        others = [name for name in others if name != path.name]
        raise UserError(f"checkpoint {path} is damaged: {damage}. It was not used. Resume from another checkpoint ("
                        + (f"--resume {' or '.join(str(checkpoints / name) for name in others)}" if others else
                           f"there is none left in {checkpoints}") + "), or start again with --overwrite.")
    run_dir = path.resolve().parent.parent
    if run_dir != output_dir.resolve() and earlier_run(output_dir):
        raise UserError(f"{path} comes from the run in {run_dir}, but --output_dir {output_dir} holds another run. "
                        f"Resume with --output_dir {run_dir}, or into an empty --output_dir.")
    return {**state, "path": path}


ORDER = "global micro-batches"  # trainer_state.json's `batch` counts MicroBatches' micro-batches of all processes

# what trainer_state.json must hold, and of which type (it is JSON: a hand edit can put anything there)
STATE_FIELDS = {"args": dict, "architecture": str, "model_kwargs": dict, "epoch": int, "batch": int, "step": int,
                "best_accuracy": (int, float), "lr_scheduler": dict, "num_processes": int}


def _check_state(state):
    if not isinstance(state, dict):
        return "not a JSON object"
    for name, kind in STATE_FIELDS.items():
        if not isinstance(state.get(name), kind) or isinstance(state.get(name), bool):
            return f"{name!r} is {state.get(name)!r}"
    if min(state["epoch"] - 1, state["batch"], state["step"], state["num_processes"] - 1) < 0:
        return f"epoch {state['epoch']}, batch {state['batch']}, step {state['step']} is not a point in a run"
    files = state.get("files", {})
    if not (isinstance(files, dict) and all(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                                            and isinstance(entry[1], str) for entry in files.values())):
        return "'files' is damaged"
    totals = state.get("epoch_totals")
    if state["batch"] and not (isinstance(totals, dict) and isinstance(totals.get("loss_sum"), (int, float))
                               and isinstance(totals.get("indices"), list)
                               and isinstance(totals.get("samples_per_process"), list)
                               and len(totals["samples_per_process"]) == state["num_processes"]):
        return "'epoch_totals' is missing or damaged"
    return None


def say_thread_count(accelerator, checkpoint):
    """On a CPU, a resumed run computing with another number of threads per process than the checkpoint's (a
    2-process launch has 1 each; a plain `python` run, one per core) splits its kernels' sums otherwise: its
    weights come out other than the uninterrupted run's beyond float rounding. Said, with the command that matches."""
    theirs, ours = checkpoint.get("threads_per_process"), torch.get_num_threads()
    if accelerator.device.type == "cpu" and isinstance(theirs, int) and theirs != ours:
        accelerator.print(f"{checkpoint['path']} was computed with {theirs} thread(s) per process, this run with "
                          f"{ours}: its weights will differ from the uninterrupted run's beyond float rounding (the "
                          f"CPU kernels split their sums by thread). For the same weights, run it with "
                          f"OMP_NUM_THREADS={theirs} in its environment.")


def load_checkpoint(accelerator, checkpoint, *, model, lr_scheduler, model_info, output_dir):
    """Restore `find_checkpoint`'s checkpoint into the prepared objects; later checkpoints and metrics lines go.
    Refuses another model. Any process count continues it: resolve_args kept the global batch."""
    path = checkpoint["path"]
    theirs, ours = [(info["architecture"], info["model_kwargs"]) for info in (checkpoint, model_info)]
    if theirs != ours:
        raise UserError(f"checkpoint {path} holds {theirs[0]} with {theirs[1]}, but this run builds {ours[0]} with "
                        f"{ours[1]}. Resume it with the script and data it was trained on, or start a new run.")
    check_weights(accelerator.unwrap_model(model, keep_torch_compile=False), path / "model.safetensors",
                  expected=f"{ours[0]} with {ours[1]}")
    if checkpoint["batch"] and checkpoint.get("order") != ORDER:
        raise UserError(f"checkpoint {path} was written inside an epoch by an earlier version of these scripts, which "
                        "shared the samples out otherwise: resume from an epoch_*_end checkpoint.")
    written_by, launched = checkpoint["num_processes"], accelerator.num_processes
    if written_by != launched:
        accelerator.print(f"{path} was written by {written_by} process(es) x {checkpoint['args']['grad_accum']} "
                          f"accumulation step(s), this launch has {launched} x "
                          f"{accelerator.gradient_accumulation_steps}: the same global batch and samples, so the "
                          "run goes on as the uninterrupted one, equal within float rounding (the gradients are "
                          "summed in another order)")
    say_thread_count(accelerator, checkpoint)
    try:
        accelerator.load_state(path)
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        # checkpoints are taken at optimizer steps: the next micro-batch starts one. load_state restores Accelerate's
        # count of micro-batches, which another number of accumulation steps would cut at the wrong place
        accelerator.step = 0
    except (RuntimeError, OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        raise UserError(f"checkpoint {path} is damaged ({error}); resume from an earlier one in "
                        f"{path.parent}") from None
    if accelerator.is_main_process:
        set_aside_later_checkpoints(output_dir, path)
        truncate_metrics(output_dir, before_epoch=checkpoint["epoch"])
    accelerator.wait_for_everyone()


def finished_because(checkpoint, *, epochs, max_steps=None, patience=None):
    """Why the checkpoint's run has nothing left to train, or None. Counted in epochs, not in steps, which depend
    on the process count: a finished run stays finished on any number of processes."""
    epoch, step, best_epoch = checkpoint["epoch"], checkpoint["step"], checkpoint.get("best_epoch", 0)
    if epoch > epochs:
        return f"epoch {epochs} of {epochs} done"
    if max_steps and step >= max_steps:
        return f"step {step} of --max_steps {max_steps}"
    if patience and epoch - 1 - best_epoch >= patience:
        return (f"stopped early after epoch {epoch - 1}: val accuracy did not improve for {patience} epoch(s) after "
                f"epoch {best_epoch}, --patience {patience}")
    return None


def set_aside_later_checkpoints(output_dir, path):
    """A run resumed from an older checkpoint of its own goes on from there (main process): its later checkpoints,
    and metrics.jsonl as it was, go into previous_run/ until the resumed run's first checkpoint (a mistaken --resume
    stopped before then has lost nothing)."""
    output_dir, path = Path(output_dir), Path(path)
    checkpoints = output_dir / "checkpoints"
    if path.resolve().parent != checkpoints.resolve():
        return  # a checkpoint of another folder: this one holds no later checkpoints of that run
    # the pointer first: a kill among the moves below leaves `latest` at a checkpoint that is there, and the run
    # resumed from it moves the rest
    write_atomically(checkpoints / "latest", lambda pointer: pointer.write_text(path.name + "\n"))
    later = sorted(checkpoint for checkpoint in checkpoints.glob("epoch_*") if checkpoint.name > path.name)
    if later:
        previous = output_dir / PREVIOUS_RUN
        with failed_write_is_said(previous):
            (previous / "checkpoints").mkdir(parents=True, exist_ok=True)
            if (output_dir / "metrics.jsonl").exists() and not (previous / "metrics.jsonl").exists():
                write_atomically(previous / "metrics.jsonl", partial(shutil.copy2, output_dir / "metrics.jsonl"))
            for checkpoint in later:
                remove(previous / "checkpoints" / checkpoint.name)  # a name left by an earlier going back
                os.replace(checkpoint, previous / "checkpoints" / checkpoint.name)
        names = later[0].name + (f" to {later[-1].name}" if len(later) > 1 else "")
        print(f"going back to {path.name}: the {len(later)} later checkpoint(s) ({names}) and metrics.jsonl as it "
              f"was are in {previous} until this run's first checkpoint, which deletes them", flush=True)
