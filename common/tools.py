"""What the tools (predict.py, export.py, compute_mean_std.py, the benchmarks) share: the image files they are given,
read unlabelled, the output file they write, checked before any work, and the machine a benchmark ran on."""

import os
import platform
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch

from .distributed import cpu_computes_bf16
from .errors import UserError
from .images import (IMAGE_EXTENSIONS, check_names, entry_kind, is_hidden, list_image_folder, read_image,
                     refuse_run_folder, run_files, split_dataset)
from .outputs import check_not_in_a_run, check_not_inside, remove, write_atomically


def find_images(inputs):
    """Image files named in `inputs`, and those under the folders named there (recursive, sorted; hidden ones left
    out: `is_hidden`). A training run's output folder is refused where it is named and left out, with a line, where
    it is found inside a folder (`predict.py .` beside outputs/): its plots are not the user's images."""
    paths = []
    for item in map(Path, inputs):
        if not item.exists() and not item.is_symlink():
            raise UserError(f"{item} does not exist")
        if entry_kind(item) == "dir":
            refuse_run_folder(item, expected="image files or folders of them")
            found = [p for p in item.rglob("*") if not any(map(is_hidden, p.relative_to(item).parts))]
            runs = {folder for folder in {p.parent for p in found} if run_files(folder)}
            images = sorted(p for p in found if p.suffix.lower() in IMAGE_EXTENSIONS and entry_kind(p) == "file")
            in_runs = {p for p in images if runs.intersection(p.parents)} if runs else set()
            if in_runs:
                holders = sorted(str(run) for run in runs if any(run in p.parents for p in in_runs))
                print(f"left out {len(in_runs)} image(s) in {', '.join(holders)}: the output folder of a training "
                      "run (its plots), not images to read", file=sys.stderr)
            paths += [p for p in images if p not in in_runs]
        else:
            paths.append(item)
    if not paths:
        raise UserError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(inputs)}")
    once, seen, again, folders = [], set(), [], {}
    for path in paths:  # a folder and a file in it, or one folder twice: each image once, at its first place
        if path.parent not in folders:  # resolved once a folder: resolving each of 50,000 images took 1.1 s
            folders[path.parent] = path.parent.resolve()
        key = (folders[path.parent], path.name)
        (again if key in seen else once).append(path)
        seen.add(key)
    if again:
        print(f"left out {len(again)} image(s) named more than once (e.g. {again[0]}): each is read once",
              file=sys.stderr)
    check_names(once)
    return once


class ImageFiles(torch.utils.data.Dataset):
    """Unlabelled image files (predict.py, export.py); an unreadable one is named and comes out blank, ok False."""

    def __init__(self, paths, *, transform, channels, image_size):
        self.paths, self.transform, self.channels, self.image_size = paths, transform, channels, image_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        try:
            image, ok = self.transform(read_image(self.paths[index], channels=self.channels)), True
        except (OSError, ValueError) as error:
            print(f"skipped {self.paths[index]}: not a readable image ({error})", file=sys.stderr)
            image, ok = torch.zeros((self.channels, *self.image_size), dtype=torch.uint8), False
        return {"image": image, "ok": ok, "index": index}


def check_output_file(path, *, suffix, what, is_ours, inputs=(), overwrite=False):
    """Check, before any work, that a tool can write `path`; an existing file must be `is_ours` (`what` names it:
    "a CSV written by predict.py") unless `overwrite`; `is_ours` None: none is replaced without `overwrite`."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--output {path} is a folder: give a file name, e.g. {path / ('output' + suffix)}")
    if path.suffix.lower() != suffix:
        raise UserError(f"--output {path}: the output is {what}, so its name must end in {suffix} (after a shell "
                        "glob such as --output imgs/*.jpg, the first image would have been the output)")
    if not path.parent.is_dir():
        raise UserError(f"--output {path}: the folder {path.parent} does not exist; create it or choose another file")
    check_not_in_a_run(path, flag="--output")
    if any(path.resolve() == Path(item).resolve() for item in inputs):
        raise UserError(f"--output {path} is one of the inputs: writing there would destroy it. Choose another "
                        "file (a shell glob after --output names an input as the output)")
    if path.exists() and not overwrite and (is_ours is None or not is_ours(path)):
        raise UserError(f"--output {path} exists{'' if is_ours is None else f' and is not {what}'}: choose another "
                        "file, or pass --overwrite to replace it")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"--output {path}: the folder {path.parent} is not writable")


def describe_cpu(device):
    """The CPU's model and whether it computes bf16 natively (and the GPU, if one trains): times are comparable only
    on the same kind."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = {name: re.search(rf"^{name}\s*:\s*(.+)$", cpuinfo, re.MULTILINE) for name in ("model name", "cpu family",
                                                                                          "model")}
    name = fields["model name"].group(1).strip() if fields["model name"] else platform.processor() or "unknown CPU"
    if fields["cpu family"] and fields["model"]:  # a virtual machine may call it only "AMD EPYC"
        name += f" (family {fields['cpu family'].group(1)}, model {fields['model'].group(1)})"
    sets = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if re.search(rf"\b{flag}\b", cpuinfo)]
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "instruction_sets": sets,
            "bf16_native": cpu_computes_bf16(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}


def link_or_copy(source, target):
    """A hard link where the filesystem allows one, else a copy (a `copy_function` for shutil.copytree)."""
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)


def write_split(source, target, *, val_fraction=0.3, seed=42, place=shutil.copy2):
    """SOURCE/<class>/<image> -> TARGET/train/<class>/<image> + TARGET/val/<class>/<image>, the stratified split
    train_seedlings.py makes in memory with the same `val_fraction` and `seed` (scripts/split_dataset.py), each image
    written by `place(image, destination)`: a copy, a hard link or `link_or_copy`; TARGET is written whole or not at
    all (an error `place` raises leaves nothing of it). -> (classes, {"train": Counter, "val": Counter} of images
    per class index, the entries left out as not images)."""
    source, target = Path(source), Path(target)
    check_not_inside(target, [source], flag="target")  # the next listing would take train/ and val/ for classes
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} is a file: choose a new folder to write the split into (it is created)")
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{target} exists and is not empty: choose a new folder, or remove it first")
    if (source / "train").is_dir() and (source / "val").is_dir():
        raise UserError(f"{source} is already split into train/ and val/: train on it as it is")
    files, labels, classes, skipped = list_image_folder(source)
    parts = dict(zip(("train", "val"), split_dataset(labels, val_fraction=val_fraction, seed=seed, classes=classes)))

    def write(tree):  # a hidden folder beside the target, renamed at the end: a failure leaves no half target
        for part, indices in parts.items():
            for i in indices:
                destination = tree / part / classes[labels[i]] / files[i].name
                destination.parent.mkdir(parents=True, exist_ok=True)
                place(files[i], destination)

    write_atomically(target, write)
    return classes, {part: Counter(labels[i] for i in indices) for part, indices in parts.items()}, skipped


def split_once(data_dir, work_dir, *, derived=()):
    """(WORK_DIR/split, whether it was made now): DATA_DIR's train/ and val/, or its class folders split 70/30 as
    train_seedlings.py splits them (scripts/split_dataset.py), as hard links where the filesystem allows. Made once
    for a dataset: WORK_DIR/source.txt names the one it holds, and a split of another --data_dir is made again,
    with the `derived` folders of WORK_DIR made from it removed. A split/ (or derived folder) that source.txt does
    not vouch for is the user's: refused, never removed."""
    data_dir, work_dir = Path(data_dir), Path(work_dir)
    split, source = work_dir / "split", work_dir / "source.txt"
    if source.is_file() and source.read_text() == str(data_dir.resolve()) and split.is_dir():
        return split, False
    ours = [split, *(work_dir / name for name in derived)]
    theirs = [] if source.is_file() else [folder for folder in ours if folder.exists() or folder.is_symlink()]
    if theirs:  # no split of ours there: a split/ is the user's
        raise UserError(f"--work_dir {work_dir} holds {theirs[0].name}/, which this tool did not make (no "
                        f"{source.name} beside it) and would replace: choose another --work_dir")
    for item in (source, *ours):
        remove(item)
    if (data_dir / "train").is_dir() and (data_dir / "val").is_dir():
        for part in ("train", "val"):
            shutil.copytree(data_dir / part, split / part, copy_function=link_or_copy)
    else:
        try:
            write_split(data_dir, split, place=link_or_copy)
        except UserError as error:
            raise UserError(f"could not split {data_dir}: error: {error}") from None
    source.write_text(str(data_dir.resolve()))
    return split, True
