"""Image files, the ground floor every dataset stands on: listing class folders, the stratified train/val split,
reading and converting an image, and the evaluation preprocessing."""

import errno
import os
import re
import stat
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def archive_note(path):
    """For a --data_dir (or an input) that is a file: " (a zip archive: extract it, then pass the folder it makes)"
    where the file is an archive, else "" (what a downloaded dataset most often is, before it is unpacked)."""
    import tarfile
    import zipfile

    try:
        kind = "zip" if zipfile.is_zipfile(path) else "tar" if tarfile.is_tarfile(path) else None
    except OSError:
        kind = None
    return f" (a {kind} archive: extract it, then pass the folder it makes)" if kind else ""


def list_image_folder(root):
    """`root/<class>/<image>` -> (files, labels, classes, skipped), sorted; `skipped` are the images beside the class
    folders, the files that are not images and the folders inside a class folder (a class's images are those in its
    folder itself, as the layout says)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} {'is not a folder' + archive_note(root) if root.exists() else 'not found'}: "
                        f"expected a folder of class folders, {root}/<class>/<image>.png")
    refuse_run_folder(root, expected=f"a folder of class folders, {root}/<class>/<image>.png")
    entries = folder_entries(root)
    classes = sorted(name for name, kind in entries if kind == "dir")
    if not classes:
        names = [name for name, _ in entries]
        other = ("MNIST-style IDX files, which scripts/train_mnist.py reads"  # -idx3-ubyte, or a mirror's .idx3-ubyte
                 if any("idx" in n and "ubyte" in n for n in names) else
                 "CIFAR-10's python batches, which scripts/train_cifar.py reads"
                 if any(n.startswith(("data_batch_", "cifar-10-")) for n in names) else None)
        raise UserError(f"{root} has no class folders: expected {root}/<class>/<image>.png"
                        + (f" (it holds {other})" if other else ""))
    files, labels = [], []
    skipped = [root / name for name, kind in entries  # images beside the class folders: in no class
               if kind == "file" and Path(name).suffix.lower() in IMAGE_EXTENSIONS]
    for label, name in enumerate(classes):
        listed = sorted(folder_entries(root / name))
        entries = [root / name / entry for entry, kind in listed if kind == "file"]
        images = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS]
        if not images:
            nested = [entry for entry, kind in listed if kind == "dir"]
            holding = [any(kind == "file" and Path(entry).suffix.lower() in IMAGE_EXTENSIONS
                           for entry, kind in folder_entries(root / other)) for other in classes if other != name]
            grouped = nested and sum(holding) > len(holding) / 2  # else most often: --data_dir one level too high
            raise UserError(f"class folder {root / name} has no images ({', '.join(IMAGE_EXTENSIONS)})" + (
                f", only folders ({', '.join(nested[:3])}{', ...' if len(nested) > 3 else ''}), where most other "
                "class folders hold their images: a class's images are read from its folder itself, not from folders "
                f"inside it. Move them up into {root / name}, or make each of those folders a class of its own"
                if grouped else f" but folders: did you mean --data_dir {root / name}? (a class's images are read "
                "from its folder itself, not from folders inside it)" if nested else ""))
        files += images
        labels += [label] * len(images)
        skipped += [p for p in entries if p.suffix.lower() not in IMAGE_EXTENSIONS]
        skipped += [root / name / entry for entry, kind in listed if kind == "dir"]
    return files, labels, classes, skipped


# what list_image_folder's `skipped` are, for the line that says how many were left out
SKIPPED = ("files that are not images, folders inside a class folder or images beside the class folders (a class's "
           "images are those in its folder itself)")


def run_files(folder):
    """The files that mark a training run's output folder, of those `folder` holds (none: not a run's)."""
    return [name for name in ("metrics.jsonl", "best/meta.json") if (Path(folder) / name).is_file()]


def refuse_run_folder(folder, *, expected):
    """A training run's output folder named where images are expected: its plots would be read as the images."""
    found = run_files(folder)
    if found:
        raise UserError(f"{folder} is the output folder of a training run (it holds {' and '.join(found)}), not "
                        f"images: expected {expected}; name the data the run trained on, or other images")


def is_hidden(name):
    """A dot name, or the __MACOSX folder of resource forks that macOS's zip puts beside the data: never a class or
    an image."""
    return name.startswith(".") or name == "__MACOSX"


def folder_entries(folder):
    """(name, "file" or "dir") of a folder's entries that are not hidden (`is_hidden`). os.scandir gives the type
    without a stat per file (a million files: seconds, not minutes). Names that are not text are refused
    (`check_names`)."""
    found = []
    for entry in os.scandir(folder):
        if is_hidden(entry.name):
            continue
        try:
            kind = "file" if entry.is_file() else "dir" if entry.is_dir() else entry_kind(entry.path)
        except OSError:  # is_file() follows links, and raises on a loop
            kind = entry_kind(entry.path)
        found.append((entry.name, kind))
    if not_utf8([folder, *(name for name, _ in found)]):  # the paths built only then: a million names, a second
        check_names([folder, *(Path(folder) / name for name, _ in found)])
    return found


def check_names(paths):
    """Refuse paths whose names are not UTF-8 text (an old zip's Latin-1 names, say), which the log, the CSV files
    and the reports that name images could not write: one message with the fix, before any work, instead of a
    traceback."""
    bad = not_utf8(paths)
    if bad:
        raise UserError(f"{len(bad)} file or folder name(s) are not UTF-8 text, e.g. {', '.join(bad[:3])}: the "
                        "reports and CSV files that name images could not write them. Rename them to UTF-8: from "
                        "Latin-1, an old zip's usual names, convmv -r -f latin1 -t utf-8 --notest FOLDER (it leaves "
                        "UTF-8 names as they are)")


def not_utf8(paths):
    """Those of `paths` that are not UTF-8 text (bytes of another encoding, which Python holds as surrogates), shown
    as their bytes: caf\\xe9.png."""
    bad = []
    for path in map(str, paths):
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            bad.append(repr(os.fsencode(path))[2:-1])
    return bad


def entry_kind(path):
    """"file" or "dir" for what `path` is or links to; anything else (a broken link, a loop, a FIFO, a device),
    which reading could not use or would block on, is refused by name."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        what = ("a symbolic link loop" if error.errno == errno.ELOOP else "a broken symbolic link"
                if os.path.islink(path) else f"unreadable ({error.strerror})")
    else:
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return "file" if stat.S_ISREG(mode) else "dir"
        what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
    raise UserError(f"{path} is {what}, not an image or a folder: remove it (or fix the link) and run again")


def check_classes(classes, root):
    """A classifier needs two classes (one would train to 100% on anything)."""
    if len(classes) < 2:
        raise UserError(f"{root} has one class folder ({classes[0]}): a classifier needs at least 2 classes, one "
                        "folder of images each")


def check_same_classes(train_classes, train_root, held_out_classes, held_out_root):
    """Both splits of a tree have the same class folders: a label is a class's index in the sorted names."""
    if held_out_classes != train_classes:
        only_train = sorted(set(train_classes) - set(held_out_classes))
        only_held_out = sorted(set(held_out_classes) - set(train_classes))
        raise UserError(f"{train_root} and {held_out_root} have different class folders (only in "
                        f"{Path(train_root).name}: {only_train or 'none'}; only in {Path(held_out_root).name}: "
                        f"{only_held_out or 'none'}). Give both the same classes.")


def split_dataset(labels, *, val_fraction, seed, classes=None):
    """Stratified (train, val) index lists, as scikit-learn's train_test_split draws them (the seed's makedata.py):
    they depend only on the sorted listing and the seed, so every process and every run agree."""
    counts = np.bincount(labels)
    if counts.min() < 2:
        names = classes or [f"class {label}" for label in range(len(counts))]
        few = [f"{name} ({count})" for name, count in zip(names, counts) if count < 2]
        raise UserError(f"cannot split into train and val: every class needs at least 2 images, and "
                        f"{', '.join(few)} {'has' if len(few) == 1 else 'have'} fewer. Add images, or remove the class "
                        "folder")
    val = int(np.ceil(val_fraction * len(labels)))
    if min(val, len(labels) - val) < len(counts):
        short = "validation" if val < len(counts) else "training"
        raise UserError(f"cannot split {len(labels)} images into train/val with --val_fraction {val_fraction}: it "
                        f"leaves {val if short == 'validation' else len(labels) - val} {short} images for "
                        f"{len(counts)} classes, which need one each. {'Raise' if short == 'validation' else 'Lower'} "
                        "--val_fraction, or add images")
    train, val = stratified_split(np.asarray(labels), test_fraction=val_fraction, seed=seed)
    return sorted(train.tolist()), sorted(val.tolist())


def stratified_split(labels, *, test_fraction, seed):
    """(train, test) indices as scikit-learn's StratifiedShuffleSplit draws them: each class's share of the test
    set rounded by the largest remainders (ties broken at random), each class shuffled, then each set."""
    rng = np.random.RandomState(seed)
    n_test = int(np.ceil(test_fraction * len(labels)))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])

    def share(counts, draws):  # sklearn.utils.extmath._approximate_mode
        exact = counts / counts.sum() * draws
        taken = np.floor(exact)
        missing, remainder = int(draws - taken.sum()), exact - taken
        for value in np.sort(np.unique(remainder))[::-1]:
            if missing <= 0:
                break
            tied = np.where(remainder == value)[0]
            chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
            taken[chosen] += 1
            missing -= len(chosen)
        return taken.astype(int)

    n_train = share(counts, len(labels) - n_test)
    n_test = share(counts - n_train, n_test)
    train, test = [], []
    for indices, first, then in zip(by_class, n_train, n_test):
        shuffled = indices.take(rng.permutation(len(indices)))
        train.extend(shuffled[:first])
        test.extend(shuffled[first:first + then])
    return rng.permutation(train), rng.permutation(test)


# Pillow warns of images between MAX_IMAGE_PIXELS and twice that (a 144-megapixel scan), each time and with its own
# file and line: they open, and are resized like any other. Above twice, read_image's own message says what to do.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def read_image(path, *, channels=3):
    """An image file (or a source with `open()`, a Hugging Face dataset's image: common.hf.HFImage) as an RGB
    (`channels` 3) or grayscale PIL image; OSError or ValueError if unreadable."""
    a_file = isinstance(path, (str, os.PathLike))
    try:
        with Image.open(path if a_file else path.open()) as image:
            return convert_image(image, channels=channels)
    except OSError as error:
        # out of file descriptors is not the image's fault: not an unreadable image to leave out, but a RuntimeError
        # that common.errors.call_main names, with the fix
        if error.errno == errno.EMFILE:
            raise RuntimeError(f"Too many open files, opening {path}") from None
        raise
    except Image.DecompressionBombError as error:  # not an OSError: make it one more unreadable image
        size = re.search(r"\((\d+) pixels\)", str(error))
        raise ValueError(f"{int(size[1]):,} pixels, more than Pillow opens (its guard against decompression "
                         f"bombs: {2 * Image.MAX_IMAGE_PIXELS:,}); the scripts resize it to a few hundred pixels a "
                         "side anyway, so downscale it once beforehand (e.g. ImageMagick: mogrify -resize "
                         f"'4096x4096>' {path if a_file else 'FILE'})" if size else str(error)) from None


def convert_image(image, *, channels=3):
    """A PIL image in RGB or grayscale; 16-bit images are scaled to 8 bits (Pillow's convert clips them to white);
    a palette image with a transparent colour goes through RGBA, as Pillow's warning asks (the same pixels; the
    warning, once a process, named no image).
    A floating-point image (a TIFF of mode F) is refused: its values have no fixed range (Pillow's convert clips
    them to 0-255, and an image of values in 0-1 came out black)."""
    if image.mode == "F":
        raise ValueError("a 32-bit floating-point image (mode F), whose values have no fixed range: save it as 8 or "
                         "16 bits, scaled as the whole dataset should be (e.g. numpy: (x / top * 65535).astype("
                         "'uint16'), with one top for every image)")
    if image.mode.startswith("I"):
        wide = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(np.round(wide / 257), 0, 255).astype(np.uint8))
    if image.mode == "P" and "transparency" in image.info:  # the same pixels, without Pillow's warning
        image = image.convert("RGBA")
    return image.convert("L" if channels == 1 else "RGB")


def build_eval_transform(spec):
    """The evaluation preprocessing a model description's "eval_transform" names, uint8 (C, H, W) out:
    {"resize": S, "center_crop": [H, W]} (folder datasets: a PIL image or a tensor in) or {"resize": [H, W]} (the
    in-memory ones: a PIL image resized with PIL's bilinear filter, as they were decoded)."""
    if "center_crop" not in spec:
        return partial(_resize, size=tuple(spec["resize"]))
    return partial(_resize_and_crop, size=spec["resize"], crop=spec["center_crop"])


def _resize_and_crop(image, *, size, crop):
    # torchvision's v2.Compose([ToImage(), Resize(antialias=True), CenterCrop(), ToPureTensor()]) pixel for pixel,
    # through its functions: a fifth of the time per image (31 against 166 us for a CIFAR-10 JPEG). Imported here:
    # torchvision takes a second to import, and training on tensors needs none
    from torchvision.transforms.v2 import functional

    if not isinstance(image, torch.Tensor):
        image = functional.pil_to_tensor(image)
    return functional.center_crop(functional.resize(image, size, antialias=True), crop)


def _resize(image, *, size):
    # PIL and numpy alone: torchvision's transforms would double the time of a 32x32 image
    if image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.BILINEAR)
    array = np.asarray(image)
    return torch.from_numpy(array.reshape(*array.shape[:2], -1).copy()).permute(2, 0, 1)
