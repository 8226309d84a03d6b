"""What the tools (predict.py, export.py, compute_mean_std.py, benchmark.py) share: the image files they are given,
read unlabelled, and the output file they write, checked before any work."""

import os
import sys
from pathlib import Path

import torch

from .errors import UserError
from .images import IMAGE_EXTENSIONS, entry_kind, read_image


def find_images(inputs):
    """Image files named in `inputs`, and those under the folders named there (recursive, sorted)."""
    paths = []
    for item in map(Path, inputs):
        if not item.exists() and not item.is_symlink():
            raise UserError(f"{item} does not exist")
        if entry_kind(item) == "dir":
            paths += sorted(p for p in item.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and entry_kind(p) == "file")
        else:
            paths.append(item)
    if not paths:
        raise UserError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(inputs)}")
    return paths


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
    "a CSV written by predict.py") unless `overwrite`."""
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
