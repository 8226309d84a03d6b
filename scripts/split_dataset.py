"""Materialise a stratified train/val split of a class-folder tree (what the seed's makedata.py did).

    python scripts/split_dataset.py data/plant-seedlings data/seedlings-split            # 70/30, seed 42, copies
    python scripts/split_dataset.py data/plant-seedlings data/seedlings-split --link     # hard links, no extra space

SOURCE/<class>/<image> -> TARGET/train/<class>/<image> + TARGET/val/<class>/<image>. The split is the one
train_seedlings.py makes in memory with the same --val_fraction and --seed (scikit-learn's
train_test_split, stratified), so a run on TARGET sees the same images as a run on SOURCE. Every image
lands in exactly one split; files that are not images are left out and counted. A non-empty TARGET
is refused.
"""

import argparse
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
from common.cli import UserError, run  # noqa: E402
from common.folders import list_image_folder, split_dataset  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="folder of class folders")
    parser.add_argument("target", help="new or empty folder for train/ and val/")
    parser.add_argument("--val_fraction", type=float, default=0.3, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=42, help="default: %(default)s")
    parser.add_argument("--link", action="store_true", help="hard-link instead of copying (same filesystem)")
    return parser.parse_args(argv)


def main(args):
    source, target = Path(args.source), Path(args.target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"{target} exists and is not empty: choose a new folder, or remove it first")
    files, labels, classes, skipped = list_image_folder(source)
    train, val = split_dataset(labels, val_fraction=args.val_fraction, seed=args.seed)
    place = os.link if args.link else shutil.copy2
    for split, indices in (("train", train), ("val", val)):
        for i in indices:
            destination = target / split / classes[labels[i]] / files[i].name
            destination.parent.mkdir(parents=True, exist_ok=True)
            place(files[i], destination)
    counts = {split: Counter(labels[i] for i in indices) for split, indices in (("train", train), ("val", val))}
    width = max(map(len, classes))
    print(f"{'class':<{width}}  train    val")
    for label, name in enumerate(classes):
        print(f"{name:<{width}}  {counts['train'][label]:5d}  {counts['val'][label]:5d}")
    print(f"{'total':<{width}}  {len(train):5d}  {len(val):5d}   -> {target}/train, {target}/val"
          + (f"; left out {len(skipped)} files that are not images" if skipped else ""))


if __name__ == "__main__":
    run(main, parse_args())
