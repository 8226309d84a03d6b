"""Exact per-channel mean and std of every pixel of a folder of images, for --mean_std.

    python scripts/compute_mean_std.py data/seedlings-split/train --output mean_std.json
    python scripts/compute_mean_std.py hf:NAME_OR_PATH --split train --output mean_std.json

Streams the images (one at a time, converted to RGB, at their stored size) and sums pixel values and
their squares per channel in float64: the mean and standard deviation over all pixels of all images,
not the seed's average of per-image standard deviations. Compute it on the training images only.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
try:  # a copy of this script needs the folder of what the scripts share (docs/recipes.md)
    import common.errors  # noqa: E402
except ModuleNotFoundError as missing:
    sys.exit(f"error: {Path(__file__).name} needs the common/ folder it came with, beside it or one folder up "
             f"({missing}): copy common/ into your repository too")
common.errors.on_another_version_of_common(__file__)
from common.errors import UserError, refuse_several_processes, run_main  # noqa: E402
from common.flags import ArgumentParser, path  # noqa: E402
from common.hf import hf_images, hf_options, is_hf  # noqa: E402
from common.images import archive_note, read_image  # noqa: E402
from common.outputs import write_atomically  # noqa: E402
from common.tools import check_output_file, find_images  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=path,
                        help="images, searched recursively, or hf:NAME_OR_PATH (a Hugging Face dataset)")
    parser.add_argument("--split", default=None, help="hf: the split (default: train)")
    parser.add_argument("--dataset_config", default=None,
                        help="hf: the configuration (subset) of a dataset that has several (default: its only one)")
    parser.add_argument("--image_column", default=None, help="hf: the image column (default: the Image feature)")
    parser.add_argument("--output", type=path, default="mean_std.json",
                        help="JSON to write; an existing one is replaced only if this script wrote it (default: %(default)s)")
    return parser.parse_args(argv)


def mean_std(paths):
    """(mean, std, pixels) per RGB channel over all pixels of `paths`, values scaled to [0, 1]."""
    total, squares, pixels = np.zeros(3), np.zeros(3), 0
    for file in paths:
        try:
            image = np.asarray(read_image(file), dtype=np.float64).reshape(-1, 3) / 255.0
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read image {file}: {error}{archive_note(file)}") from None
        total += image.sum(0)
        squares += (image * image).sum(0)
        pixels += len(image)
    mean = total / pixels
    return mean, np.sqrt(np.maximum(squares / pixels - mean * mean, 0.0)), pixels


def is_mean_std_json(file):
    try:
        return {"mean", "std"} <= json.loads(Path(file).read_text()).keys()
    except (OSError, ValueError, AttributeError):
        return False


def main(args):
    refuse_several_processes("compute_mean_std.py")
    columns = hf_options(args, args.folder, flag="")  # --image_column: refused with a folder
    if args.split is not None and not is_hf(args.folder):
        raise UserError(f"--split chooses a split of a Hugging Face dataset (hf:...), and {args.folder} is a folder: "
                        f"pass the split's own folder instead, e.g. {Path(args.folder) / args.split}")
    paths = (hf_images(args.folder, args.split or "train", **columns) if is_hf(args.folder)
             else find_images([args.folder]))
    check_output_file(args.output, suffix=".json", what="a JSON written by compute_mean_std.py",
                      is_ours=is_mean_std_json)
    mean, std, pixels = mean_std(paths)
    flat = [name for name, value in zip("RGB", std.round(6).tolist()) if value <= 0]
    if flat:  # training divides by it: refused there too, so not written
        several = len(flat) > 1
        raise UserError(f"{'channels' if several else 'channel'} {', '.join(flat)} {'have' if several else 'has'} one "
                        f"value in all {pixels:,} pixels of these {len(paths)} images (std 0), which normalising would "
                        "divide by: compute it over more images (the training set), or leave --mean_std out to use "
                        "ImageNet's")
    stats = {"mean": mean.round(6).tolist(), "std": std.round(6).tolist(), "images": len(paths), "pixels": pixels,
             "folder": str(args.folder) if is_hf(args.folder) else str(Path(args.folder))}
    write_atomically(args.output, lambda tmp: tmp.write_text(json.dumps(stats, indent=2) + "\n"))
    print(f"{len(paths)} images, {pixels:,} pixels: mean {stats['mean']}, std {stats['std']} -> {args.output}")


if __name__ == "__main__":
    run_main(main, parse_args())
