"""The accuracy guard: every recipe trained on a short real budget at several seeds, against its recorded mean and spread.

    python scripts/benchmark_accuracy.py --cifar_dir data/cifar10 --seedlings_dir data/plant-seedlings
    python scripts/benchmark_accuracy.py cifar10 --cifar_dir data/cifar10 --seeds 42 1 2 3 4
    python scripts/benchmark_accuracy.py digits fashion_mnist --record      # the measured figures become the record

Run it before a change to how a run trains (order, seeding, precision, recipe, model) lands. Each recipe is the
script's own defaults on 2 CPU processes (accelerate_configs/cpu.yaml) with only the budget shortened:

  cifar10        train_cifar.py, 1 epoch of a stratified 10,000 / 2,000 subset of the CIFAR-10 training JPEGs (39
                 optimizer steps of 2 x 128, the warm-up included): what a warm-up that blows up shows first
  fashion_mnist  train_mnist.py --dataset fashion_mnist, 1 epoch of the 60,000 (Debian's dataset-fashion-mnist)
  digits         train_mnist.py --dataset digits --epochs 20 (the offline demo, `make demo`)
  seedlings      train_seedlings.py --model resnet18 --image_size 64 --lr 1e-3 --epochs 4, no pretrained weights
                 (none offline), on the 70/30 split it makes of the Plant Seedlings folder, the decode cache on

The record (scripts/accuracy_record.json, or --record_file) holds each recipe's accuracies per precision (fp32, or
bf16 where the CPU has bf16 instructions and the CPU config trains in it). A recipe passes when its mean is within
the tolerance (2 points, or twice the recorded standard deviation if larger) of the recorded mean and no seed falls
further below the recorded lowest: a point of spread is the draw; a recipe that blows up on one seed, or whose mean
moved, fails, and the command exits with code 2. With --record the verdict against the record replaced is still
printed. The table it prints is BENCHMARKS.md's.
"""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # find common/ from any working directory
from common.distributed import cpu_computes_bf16  # noqa: E402
from common.errors import UserError, run_main  # noqa: E402
from common.flags import ArgumentParser, path, seed  # noqa: E402
from common.images import folder_entries  # noqa: E402
from common.outputs import make_folder, write_atomically  # noqa: E402
from common.tools import describe_cpu, link_or_copy  # noqa: E402

RECORD = REPO / "scripts" / "accuracy_record.json"
TOLERANCE = 0.02  # or twice the recorded standard deviation, whichever is larger
CIFAR_SUBSET = (1000, 200)  # training and test images per class
RECIPES = {
    "cifar10": ("train_cifar.py", "--epochs 1"),
    "fashion_mnist": ("train_mnist.py", "--dataset fashion_mnist --epochs 1"),
    "digits": ("train_mnist.py", "--dataset digits --epochs 20"),
    "seedlings": ("train_seedlings.py", "--model resnet18 --image_size 64 --lr 1e-3 --epochs 4 --cache_images "
                                        "--num_workers 1"),
}


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="*", default=[], metavar="RECIPE",
                        help=f"{', '.join(RECIPES)} (default: all of them)")
    parser.add_argument("--cifar_dir", type=path, default="data/cifar10",
                        help="the CIFAR-10 JPEGs as <class>/*.jpg or train/<class>/*.jpg (default: %(default)s)")
    parser.add_argument("--fashion_dir", type=path, default="/usr/share/datasets/fashion-mnist",
                        help="Fashion-MNIST's four IDX files (default: %(default)s)")
    parser.add_argument("--seedlings_dir", type=path, default="data/plant-seedlings",
                        help="Plant Seedlings, a folder of class folders (default: %(default)s)")
    parser.add_argument("--seeds", type=seed, nargs="+", default=[42, 1, 2], help="default: %(default)s")
    parser.add_argument("--work_dir", type=path, default="outputs/benchmark_accuracy",
                        help="the runs and the CIFAR-10 subset go here (default: %(default)s)")
    parser.add_argument("--record", action="store_true",
                        help="write the measured accuracies into --record_file instead of comparing with it")
    parser.add_argument("--record_file", type=path, default=None,
                        help="the recorded accuracies (default: scripts/accuracy_record.json)")
    args = parser.parse_args(argv)
    unknown = [recipe for recipe in args.recipes if recipe not in RECIPES]
    if unknown:  # checked here: argparse checks a '*' positional's default [] against its choices too
        parser.error(f"argument RECIPE: invalid choice: {unknown[0]!r} (choose from {', '.join(RECIPES)})")
    return args


def cifar_subset(cifar_dir, work_dir):
    """train/ and test/ of CIFAR_SUBSET images per class, hard links into the JPEGs (the same files every time)."""
    source = Path(cifar_dir) / "train" if (Path(cifar_dir) / "train").is_dir() else Path(cifar_dir)
    target = work_dir / f"cifar10-{CIFAR_SUBSET[0]}-{CIFAR_SUBSET[1]}"
    if target.is_dir():
        return target

    def write(tmp):
        classes = sorted(name for name, kind in folder_entries(source) if kind == "dir")
        if len(classes) != 10:
            raise UserError(f"--cifar_dir {cifar_dir}: expected CIFAR-10's 10 class folders, found {len(classes)}")
        for label in classes:
            files = sorted(name for name, kind in folder_entries(source / label) if kind == "file")
            if len(files) < sum(CIFAR_SUBSET):
                raise UserError(f"--cifar_dir {cifar_dir}: {label} has {len(files)} images, the guard needs "
                                f"{sum(CIFAR_SUBSET)}")
            for part, names in (("train", files[:CIFAR_SUBSET[0]]), ("test", files[-CIFAR_SUBSET[1]:])):
                (tmp / part / label).mkdir(parents=True)
                for name in names:
                    link_or_copy(source / label / name, tmp / part / label / name)

    write_atomically(target, write)
    return target


def train(recipe, data_dir, run_seed, output_dir):
    """One launch of the recipe on 2 processes -> its final validation accuracy."""
    script, flags = RECIPES[recipe]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               REPO / "accelerate_configs" / "cpu.yaml", REPO / "scripts" / script, *flags.split(),
               *(["--data_dir", data_dir] if data_dir else []), "--seed", run_seed, "--output_dir", output_dir,
               "--overwrite", "--no-find_label_issues"]  # the final pass is for the report, not the accuracy
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True)  # relative paths: the caller's
    if done.returncode:
        raise UserError(f"{recipe} seed {run_seed} failed (exit code {done.returncode}):\n"
                        + "\n".join((done.stdout + done.stderr).splitlines()[-15:]))
    return json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[-1])["val_accuracy"]


def verdict(accuracies, recorded):
    """(passed, why) of this run's accuracies against the recorded ones."""
    if not recorded:
        return True, "no record for this precision: run with --record"
    tolerance = max(TOLERANCE, 2 * statistics.stdev(recorded) if len(recorded) > 1 else 0)
    fell = statistics.mean(recorded) - statistics.mean(accuracies)
    below = min(recorded) - min(accuracies)
    failures = [f"{what} fell {by:.2%}" for what, by in (("the mean", fell), ("the lowest seed", below))
                if by > tolerance]
    return not failures, f"{'FAIL: ' + ' and '.join(failures) if failures else 'pass'} (tolerance {tolerance:.2%})"


def main(args):
    recipes = args.recipes or list(RECIPES)
    work_dir = Path(args.work_dir)
    data = {"cifar10": args.cifar_dir, "fashion_mnist": args.fashion_dir, "digits": None,
            "seedlings": args.seedlings_dir}
    where = {"cifar10": "--cifar_dir: the shared archive's JPEGs, extracted", "seedlings": "--seedlings_dir",
             "fashion_mnist": "--fashion_dir; `apt-get install dataset-fashion-mnist` puts it at the default"}
    for recipe in recipes:
        if data[recipe] and not Path(data[recipe]).is_dir():
            raise UserError(f"{data[recipe]} not found: the {recipe} recipe's data ({where[recipe]}), or leave the "
                            "recipe out by naming the others")
    record_file = Path(args.record_file or RECORD)
    try:
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise UserError(f"{record_file} is not a record of this benchmark ({error}): pass another --record_file, "
                        "or remove it and run with --record") from None
    if record_file.is_dir() or (args.record and not record_file.parent.is_dir()):  # now, not after the runs
        raise UserError(f"--record_file {record_file}: " + ("a folder: give a file name" if record_file.is_dir() else
                                                             f"the folder {record_file.parent} does not exist"))
    make_folder(work_dir, inputs=[args.cifar_dir, args.seedlings_dir])
    if "cifar10" in recipes:
        data["cifar10"] = cifar_subset(args.cifar_dir, work_dir)
    precision = "bf16" if cpu_computes_bf16() else "fp32"
    cpu = describe_cpu("cpu")
    print(f"{cpu['cpu']}, {cpu['cores']} cores, {' '.join(cpu['instruction_sets'])}: 2 processes in {precision}; "
          f"torch {cpu['torch']}; seeds {' '.join(map(str, args.seeds))}", flush=True)
    rows, failed = [], []
    for recipe in recipes:
        accuracies, seconds = [], []
        for run_seed in args.seeds:
            start = time.perf_counter()
            accuracy = train(recipe, data[recipe], run_seed, work_dir / "runs" / recipe / f"seed{run_seed}")
            accuracies.append(accuracy)
            seconds.append(time.perf_counter() - start)
            print(f"{recipe} seed {run_seed}: {accuracy:.2%} in {seconds[-1]:.0f} s", flush=True)
        recorded = record.get(recipe, {}).get(precision, {}).get("accuracies")
        passed, why = verdict(accuracies, recorded)
        if args.record:  # what it replaces is still said: a fall recorded by mistake is seen
            passed, why = True, "recorded" + (f" (against the record it replaces: {why})" if recorded else "")
        if not passed:
            failed.append(recipe)
        spread = f" +- {statistics.stdev(accuracies):.2%}" if len(accuracies) > 1 else ""
        rows.append(f"| {recipe} | {precision} | {', '.join(f'{a:.2%}' for a in accuracies)} | "
                    f"{statistics.mean(accuracies):.2%}{spread} | "
                    + (f"{statistics.mean(recorded):.2%} ({min(recorded):.2%}-{max(recorded):.2%})" if recorded
                       else "-") + f" | {statistics.mean(seconds):.0f} | {why} |")
        if args.record:
            record.setdefault(recipe, {})[precision] = {
                "accuracies": accuracies, "seeds": args.seeds, "cpu": cpu["cpu"], "date": time.strftime("%Y-%m-%d")}
            write_atomically(record_file, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))
    print(f"\n| recipe | precision | accuracy, seeds {' / '.join(map(str, args.seeds))} | mean +- sd | recorded mean "
          "(range) | s per run | verdict |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    if failed:
        raise UserError(f"accuracy guard failed for {', '.join(failed)}: a change moved what these recipes reach "
                        "(compare with the code before it; if the new figures are right, --record them)")


if __name__ == "__main__":
    run_main(main, parse_args())
