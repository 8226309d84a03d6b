"""Materialise a stratified train/val split of a class-folder tree (what the seed's makedata.py did).

    python scripts/split_dataset.py data/plant-seedlings data/seedlings-split            # 70/30, seed 42, copies
    python scripts/split_dataset.py data/plant-seedlings data/seedlings-split --link     # hard links, no extra space

SOURCE/<class>/<image> -> TARGET/train/<class>/<image> + TARGET/val/<class>/<image>. The split is the one
train_seedlings.py makes in memory with the same --val_fraction and --seed (scikit-learn's
train_test_split, stratified), so a run on TARGET sees the same images as a run on SOURCE. Every image
lands in exactly one split; files or folders that are not images are left out and counted. A non-empty TARGET
is refused.
"""

import errno
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
try:  # a copy of this script needs the folder of what the scripts share (docs/recipes.md)
    import common.errors  # noqa: E402
except ModuleNotFoundError as missing:
    sys.exit(f"error: {Path(__file__).name} needs the common/ folder it came with, beside it or one folder up "
             f"({missing}): copy common/ into your repository too")
common.errors.on_another_version_of_common(__file__)
from common.errors import UserError, refuse_several_processes, run_main  # noqa: E402
from common.flags import ArgumentParser, number, path, seed  # noqa: E402
from common.images import SKIPPED  # noqa: E402
from common.tools import write_split  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=path, help="folder of class folders")
    parser.add_argument("target", type=path, help="new or empty folder for train/ and val/")
    parser.add_argument("--val_fraction", type=number(float, min=0, max=1, min_open=True, max_open=True), default=0.3,
                        help="default: %(default)s")
    parser.add_argument("--seed", type=seed, default=42, help="default: %(default)s")
    parser.add_argument("--link", action="store_true", help="hard-link instead of copying (same filesystem)")
    return parser.parse_args(argv)


def main(args):
    refuse_several_processes("split_dataset.py")

    def hard_link(source, destination):
        try:
            os.link(source, destination)
        except OSError as error:
            if error.errno == errno.EXDEV:
                raise UserError(f"cannot write the split into {args.target} ({error.strerror}); --link needs the "
                                "source and the target on the same filesystem: drop --link to copy") from None
            raise

    classes, counts, skipped = write_split(args.source, args.target, val_fraction=args.val_fraction, seed=args.seed,
                                           place=hard_link if args.link else shutil.copy2)
    width = max(map(len, classes))
    print(f"{'class':<{width}}  train    val")
    for label, name in enumerate(classes):
        print(f"{name:<{width}}  {counts['train'][label]:5d}  {counts['val'][label]:5d}")
    print(f"{'total':<{width}}  {sum(counts['train'].values()):5d}  {sum(counts['val'].values()):5d}   -> "
          f"{args.target}/train, {args.target}/val"
          + (f"; left out {len(skipped)} {SKIPPED}, e.g. {skipped[0]}" if skipped else ""))


if __name__ == "__main__":
    run_main(main, parse_args())
