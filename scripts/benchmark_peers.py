"""Time to accuracy against the scripts users would pick instead, on this machine, same data and recipe.

    python scripts/benchmark_peers.py seedlings --data_dir data/plant-seedlings --peers_dir ../shared/peers
    python scripts/benchmark_peers.py fashion_mnist --data_dir /usr/share/datasets/fashion-mnist \\
        --seed_script ../shared/refs/seed_mnist_ref.py
    python scripts/benchmark_peers.py seedlings ... --device cuda --mixed_precision bf16     # on one GPU

The peers are not part of this repository: pass the folder holding timm's `train.py` (as `timm_train.py`) and
Accelerate's `examples/cv_example.py` with its patch applied (`--peers_dir`), or the seed post's script
(`--seed_script`). A peer that is not given is left out of the table.

Tasks (the recipes used so far, as near to each other as each script allows):
  seedlings      a class-folder dataset split 70/30 (stratified, seed 42; scripts/split_dataset.py), timm
                 resnet18 from scratch, --image_size px, batch 64, 5 epochs, Adam(W) 1e-3, cosine per step,
                 label smoothing 0.1, random resized crop (scale 0.35-1) + flips, no rotation (ours: --rotation 0;
                 timm's and cv_example.py's have none), no Mixup: train_seedlings.py
                 against timm's train.py and cv_example.py (which reads flat `<label>_<n>.jpg` folders: the
                 split is converted once, JPEG quality 95). Fixed target: 60% validation accuracy, which every
                 script reached at the 5-epoch budget on the Plant Seedlings images (63-70%). With --processes 2
                 ours and cv_example.py run under accelerate launch, the global batch shared out; timm's train.py
                 is left out (under torchrun it cannot train on a CPU: DistributedDataParallel's device_ids).
  fashion_mnist  the four IDX files, the seed's convnet, batch 64 per process, 2 epochs, 2 processes:
                 train_mnist.py's defaults against the seed post's script (plain DDP, Adam 1e-3, no shuffling,
                 evaluated once at the end). Fixed target: 84%, the seed script's final accuracy (84.3-84.4%).

For every seed (alternating the scripts, so a slower moment of the machine hits all alike) and every script:
the wall time of the whole command; the time from its start to the first validation accuracy at or above each
target (the fixed one, and each script's own final accuracy of the same repeat); the training rate it reports
per epoch (images/s, all processes); the accuracy at the budget. The table gives mean +- standard deviation.
Ours runs cold: its image check and decode cache beside the data are removed before each of its runs.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # find common/ from any working directory
from common.errors import UserError, run_main  # noqa: E402
from common.flags import ArgumentParser, number, path, positive_int, seed  # noqa: E402
from common.images import folder_entries, read_image  # noqa: E402
from common.outputs import make_folder, remove, write_atomically  # noqa: E402
from common.tools import check_output_file, describe_cpu, split_once  # noqa: E402

TASKS = {"seedlings": {"epochs": 5, "processes": 1, "target": 0.60},
         "fashion_mnist": {"epochs": 2, "processes": 2, "target": 0.84}}
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(REPO / "accelerate_configs" / "cpu.yaml")]

# what each script prints: a validation accuracy (percent, or a fraction for the seed script) and its training rate
# (of all processes, or of process 0: "rate_per_process")
PARSERS = {
    "ours": [("accuracy", r"^epoch \d+/\d+ .*val_accuracy ([\d.]+)%", 0.01), ("rate", r" ([\d,]+) img/s ", 1)],
    "timm": [("accuracy", r"Test: \[\s*(\d+)/\1\].*Acc@1:\s*[\d.]+ \(\s*([\d.]+)\)", 0.01),
             ("rate", r"Train: \d+ \[.*\(100%\)\].*\(\s*[\d.]+s,\s*([\d.]+)/s\)", 1)],
    "cv_example": [("accuracy", r"^epoch \d+: ([\d.]+)$", 0.01),
                   ("rate_per_process", r"PATCH-INFO process 0: epoch .*\(([\d.]+) img/s on this process\)", 1)],
    "seed": [("accuracy", r"test_acc=([\d.]+)", 1), ("rate", r"img_per_s=(\d+)", 1)],
}


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=list(TASKS))
    parser.add_argument("--data_dir", type=path, required=True,
                        help="seedlings: a folder of class folders; fashion_mnist: the four IDX .gz files")
    parser.add_argument("--peers_dir", type=path, default=None,
                        help="folder with timm_train.py and the patched cv_example.py (seedlings)")
    parser.add_argument("--seed_script", type=path, default=None, help="the seed post's script (fashion_mnist)")
    parser.add_argument("--seeds", type=seed, nargs="+", default=[42, 1, 2], help="default: %(default)s")
    parser.add_argument("--epochs", type=positive_int, default=None, help="default: the task's budget (5 or 2)")
    parser.add_argument("--processes", type=positive_int, default=None, help="default: the task's (1 or 2)")
    parser.add_argument("--batch_size", type=positive_int, default=64,
                        help="the global batch, shared among the processes (default: %(default)s)")
    parser.add_argument("--image_size", type=number(int, min=16, max=512), default=64, help="seedlings (default: 64)")
    parser.add_argument("--target", type=number(float, min=0, max=1, min_open=True), default=None,
                        help="the fixed target accuracy, a fraction (default: the task's, 0.60 or 0.84)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                        help="for every script (timm: --amp --amp-dtype bfloat16; default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every script trains (default: %(default)s; cuda: one GPU, one process)")
    parser.add_argument("--ours_args", default="", help="extra flags for our script, e.g. '--no-cache_images'")
    parser.add_argument("--work_dir", type=path, default="outputs/benchmark_peers",
                        help="the converted data, each run's output folder and log (default: %(default)s)")
    parser.add_argument("--output", default=None, help="also write the results as JSON here")
    return parser.parse_args(argv)


def prepare_seedlings(data_dir, work_dir):
    """(the train/val split as class folders, the same split as cv_example.py's flat JPEG folders), made once in
    `work_dir` from a folder of class folders (split 70/30 as train_seedlings.py does) or a train/ + val/ tree."""
    split, made = split_once(data_dir, work_dir, derived=["flat"])
    flat = work_dir / "flat"
    if made or not flat.is_dir():

        def write(tmp):
            for part in ("train", "val"):
                (tmp / part).mkdir(parents=True)
                for label, _ in sorted(folder_entries(split / part)):
                    for n, (name, _) in enumerate(sorted(folder_entries(split / part / label))):
                        # cv_example.py reads `<label>_<n>.jpg`: a label without "_"
                        read_image(split / part / label / name).save(
                            tmp / part / f"{label.replace('_', '-')}_{n}.jpg", quality=95)

        write_atomically(flat, write)
    return split, flat


def commands(args, *, epochs, processes, run_seed, run_dir, data):
    """{script: (command, environment)} for one seed."""
    bf16 = args.mixed_precision == "bf16"
    # one process: plain python for every script, as a user would run it (the launcher costs seconds to start)
    launch = [*LAUNCH, "--num_processes", str(processes)] if processes > 1 else [sys.executable]
    found = {}
    if args.task == "fashion_mnist":
        found["ours"] = ([*launch, REPO / "scripts" / "train_mnist.py", "--dataset", "fashion_mnist", "--data_dir",
                          data, "--epochs", epochs, "--seed", run_seed, "--mixed_precision", args.mixed_precision,
                          "--output_dir", run_dir / "ours", "--overwrite", *args.ours_args.split()], {})
        if args.seed_script:
            found["seed"] = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", processes,
                              args.seed_script, data, epochs], {})
        return found
    split, flat = data
    classes = sum(kind == "dir" for _, kind in folder_entries(split / "train"))
    found["ours"] = ([*launch, REPO / "scripts" / "train_seedlings.py", "--data_dir", split, "--model", "resnet18",
                      "--image_size", args.image_size, "--epochs", epochs, "--seed", run_seed, "--lr", "1e-3",
                      "--weight_decay", 0, "--mixup_alpha", 0, "--cutmix_alpha", 0, "--label_smoothing", 0.1,
                      "--schedule", "cosine", "--max_grad_norm", "1e9", "--rotation", 0,
                      "--batch_size", args.batch_size // processes, "--mixed_precision", args.mixed_precision,
                      "--output_dir", run_dir / "ours", "--overwrite", *args.ours_args.split()], {})
    if args.peers_dir and processes == 1:  # timm's train.py under torchrun cannot train on a CPU (DDP device_ids)
        found["timm"] = ([sys.executable, Path(args.peers_dir) / "timm_train.py", "--data-dir", split,
                          "--train-split", "train", "--val-split", "val", "--model", "resnet18", "--num-classes",
                          classes, "--img-size", args.image_size, "--epochs", epochs, "--seed", run_seed, "--device",
                          args.device, "--opt", "adamw", "--lr", "1e-3", "--weight-decay", 0.05, "--sched", "cosine",
                          "--sched-on-updates", "--warmup-epochs", 0, "--smoothing", 0.1, "--scale", 0.35, 1.0,
                          "--vflip", 0.5, "--color-jitter", 0, "--batch-size", args.batch_size, "--output",
                          run_dir / "timm", *(["--amp", "--amp-dtype", "bfloat16"] if bf16 else [])], {})
    if args.peers_dir:  # its seed is fixed at 42 in the example: its repeats differ in timing only
        found["cv_example"] = ([*launch, Path(args.peers_dir) / "cv_example.py", "--data_dir", flat / "train",
                                "--val_dir", flat / "val", *(["--cpu"] if args.device == "cpu" else []), "--recipe",
                                "same", "--mixed_precision", args.mixed_precision],
                               {"CV_BATCH_SIZE": str(args.batch_size // processes), "CV_EPOCHS": str(epochs),
                                "CV_IMAGE_SIZE": str(args.image_size)})
    return found


def check_inputs(args):
    """Each given file where it should be, and only the flags of the task: a peer left out must be a choice."""
    wrong = {"seedlings": ("--seed_script", args.seed_script), "fashion_mnist": ("--peers_dir", args.peers_dir)}
    flag, given = wrong[args.task]
    if given:
        raise UserError(f"{flag} is not used by the {args.task} task: the seedlings task runs the peers of "
                        "--peers_dir, the fashion_mnist task the script of --seed_script")
    needed = {Path(args.data_dir): "--data_dir"}
    if args.task == "fashion_mnist":
        needed[Path(args.data_dir) / "train-images-idx3-ubyte.gz"] = "--data_dir: the seed script reads the .gz files"
    for name in ("timm_train.py", "cv_example.py") if args.peers_dir else ():
        needed[Path(args.peers_dir) / name] = "--peers_dir: timm's train.py as timm_train.py, the patched cv_example.py"
    if args.seed_script:
        needed[Path(args.seed_script)] = "--seed_script"
    for file, why in needed.items():  # all files but --data_dir, a folder
        folder = file == Path(args.data_dir)
        if not (file.is_dir() if folder else file.is_file()):
            found = "not found" if not file.exists() else "is a file, not a folder" if folder else "is a folder"
            raise UserError(f"{file} {found} ({why})")


def run_timed(name, command, *, env, log, processes, results):
    """Run `command`; every line it prints is timed from its start. -> wall time, [(time, accuracy)], [rate].
    `results`: how many accuracies the script prints when it ends well. A peer that printed them all and then
    failed (the seed script's plain DDP at times aborts in its teardown) is kept, with a warning and its exit code;
    ours failing is an error wherever it fails."""
    start, accuracies, rates, pending = time.perf_counter(), [], [], b""
    with subprocess.Popen(list(map(str, command)), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env}) as process, open(log, "w") as out:
        while chunk := os.read(process.stdout.fileno(), 1 << 16):
            now = time.perf_counter() - start
            *lines, pending = re.split(rb"[\r\n]", pending + chunk)
            for line in (raw.decode(errors="replace").strip() for raw in lines):
                out.write(f"{now:8.1f} {line}\n")
                for kind, pattern, scale in PARSERS[name]:
                    found = re.search(pattern, line)
                    if found:
                        value = float(found.groups()[-1].replace(",", "")) * scale
                        if kind == "accuracy":
                            accuracies.append((now, value))
                        else:
                            rates.append(value * (processes if kind == "rate_per_process" else 1))
    finished = len(accuracies) >= results and name != "ours"
    if process.returncode or not accuracies:
        tail = "\n".join(Path(log).read_text().splitlines()[-15:])
        if not finished:
            raise UserError(f"{name} failed (exit code {process.returncode}); the end of {log}:\n{tail}")
        print(f"warning: {name} failed (exit code {process.returncode}) after printing its final accuracy; its "
              f"times are kept. The end of {log}:\n{tail}", flush=True)
    return {"wall_s": time.perf_counter() - start, "accuracies": accuracies, "images_per_s": statistics.mean(rates),
            "final_accuracy": accuracies[-1][1], "exit_code": process.returncode}


def time_to(run, target):
    """Seconds from the start to the first accuracy at or above `target`, or None."""
    return next((when for when, accuracy in run["accuracies"] if accuracy >= target - 1e-9), None)


def spread(values, scale=1.0):
    """'mean +- standard deviation' of the values that are not None."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "not reached"
    return f"{statistics.mean(values):.1f}" + (f" +- {statistics.stdev(values):.1f}" if len(values) > 1 else "")


def main(args):
    if args.output:
        check_output_file(args.output, suffix=".json", what="a JSON written by benchmark_peers.py",
                          is_ours=lambda p: "time_to_target" in p.read_text(errors="replace"))
    task = TASKS[args.task]
    epochs, processes = args.epochs or task["epochs"], args.processes or task["processes"]
    target = args.target or task["target"]
    check_inputs(args)
    if args.device == "cuda" and (processes > 1 or not torch.cuda.is_available()):
        raise UserError("--device cuda runs every script on one GPU, one process: "
                        + ("--processes 1" if torch.cuda.is_available() else "this machine has no GPU that torch sees"))
    work_dir = make_folder(args.work_dir, inputs=[args.data_dir])
    data = prepare_seedlings(args.data_dir, work_dir) if args.task == "seedlings" else args.data_dir
    cpu = describe_cpu(args.device)
    print(f"{cpu['gpu'] + ' with ' if cpu['gpu'] else ''}{cpu['cpu']}, {cpu['cores']} cores, {' '.join(cpu['instruction_sets'])}; bf16 native: "
          f"{'yes' if cpu['bf16_native'] else 'no'}; torch {cpu['torch']}; {args.task}, {epochs} epochs, "
          f"{processes} process(es), mixed precision {args.mixed_precision}", flush=True)

    runs = {}
    for run_seed in args.seeds:
        run_dir = work_dir / "runs" / f"seed{run_seed}"
        for name, (command, env) in commands(args, epochs=epochs, processes=processes, run_seed=run_seed,
                                                 run_dir=run_dir, data=data).items():
            if name == "ours" and args.task == "seedlings":  # cold: no check record, no decode cache
                for leftover in data[0].glob(".checked-*"):
                    remove(leftover)
            run_dir.mkdir(parents=True, exist_ok=True)
            run = run_timed(name, command, env=env, log=run_dir / f"{name}.log", processes=processes,
                            results=1 if name == "seed" else epochs)  # the seed script evaluates once, at its end
            runs.setdefault(name, []).append(run)
            print(f"seed {run_seed} {name}: {run['wall_s']:.1f} s, accuracy {run['final_accuracy']:.2%}, "
                  f"{run['images_per_s']:.1f} images/s, accuracy by time: "
                  + ", ".join(f"{when:.0f} s {accuracy:.1%}" for when, accuracy in run["accuracies"]), flush=True)

    # each target: the fixed one, and every script's final accuracy in the same repeat
    targets = {f"{target:.0%}": [target] * len(args.seeds)}
    targets.update({f"{name} final": [run["final_accuracy"] for run in name_runs] for name, name_runs in runs.items()})
    results = {**cpu, "date": time.strftime("%Y-%m-%d"), "task": args.task, "epochs": epochs,
               "processes": processes, "mixed_precision": args.mixed_precision, "seeds": args.seeds,
               "runs": runs, "time_to_target": {
                   name: {label: [time_to(run, goal) for run, goal in zip(name_runs, goals)]
                          for label, goals in targets.items()} for name, name_runs in runs.items()}}
    print(f"\n| script | wall time (s) | images/s | accuracy at {epochs} epochs (%) | "
          + " | ".join(f"time to {label} (s)" for label in targets) + " |")
    print("|---" * (4 + len(targets)) + "|")
    for name, name_runs in runs.items():
        reached = results["time_to_target"][name]
        cells = [f"{spread(times)}" + (f" ({sum(t is not None for t in times)}/{len(times)} reached)"
                                       if None in times else "") for times in reached.values()]
        print(f"| {name} | {spread([r['wall_s'] for r in name_runs])} | "
              f"{spread([r['images_per_s'] for r in name_runs])} | "
              f"{spread([r['final_accuracy'] for r in name_runs], scale=100)} | " + " | ".join(cells) + " |")
    if args.output:
        write_atomically(args.output, lambda tmp: tmp.write_text(json.dumps(results, indent=1) + "\n"))
    return results


if __name__ == "__main__":
    run_main(main, parse_args())
