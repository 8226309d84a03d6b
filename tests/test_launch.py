"""Real `accelerate launch` runs on CPU: two processes share the work, evaluation counts each sample once."""

import json
import os
import re
import shutil
import statistics
import sys
import textwrap
import time

import pytest
import torch

from conftest import (FASHION_MNIST, REPO, assert_each_test_sample_counted_once, assert_timed_runs,
                      assert_two_processes_shared_the_data, launch, launch_warm, load_script, read_run, require,
                      run_command, script)

pytestmark = pytest.mark.slow


def test_mnist_two_processes_share_batches_and_count_1001_test_images_once(tmp_path, fashion_subset):
    from common.mnist import build_mnist

    output_dir, launched = tmp_path / "run", time.time()
    result = launch(REPO / "scripts" / "train_mnist.py", "--dataset", "fashion_mnist", "--data_dir", fashion_subset,
                    "--output_dir", output_dir, "--epochs", 2, "--batch_size", 64)
    assert result.returncode == 0, result.output
    assert "2 process(es), MULTI_CPU" in result.output and "global batch 128" in result.output
    # the start-up's cost, once, counted from the launcher's start (not the worker's, not an earlier process's)
    start_up = re.findall(r"first optimizer step done ([\d.]+) s after the launch \(start and imports ([\d.]+) s, data "
                          r"([\d.]+) s, model and device ([\d.]+) s, the first batch ([\d.]+) s\)", result.output)
    assert len(start_up) == 1 and 0 < float(start_up[0][0]) < time.time() - launched, result.output
    total, *parts = map(float, start_up[0])
    assert abs(sum(parts) - total) <= 0.3 and all(part >= 0 for part in parts) and parts[0] > 0.5  # torch's import
    # and the wind-down's, once, after the last report: the label pass over the 2,001 training images, the reports
    wind_down = re.findall(r"run done ([\d.]+) s after the launch, ([\d.]+) s after the last epoch \(scoring after "
                           r"training ([\d.]+) s, the last checkpoint's writes ([\d.]+) s, the reports ([\d.]+) s\)\n",
                           result.output)
    assert len(wind_down) == 1 and result.output.index("outputs written to") < result.output.index("run done")
    (done, after, *parts) = map(float, wind_down[0])
    assert float(start_up[0][0]) < done < time.time() - launched and after < done - float(start_up[0][0])
    assert abs(sum(parts) - after) <= 0.3 and all(part >= 0 for part in parts), result.output  # 0.0: under 0.05 s
    assert "suspected wrong labels among the 2001 training images" in result.output  # what the scoring was
    # the recipe's AdamW LR (1e-2 at a global batch of 64) follows the global batch of 128 by its square root
    assert "lr 0.01414 = 0.01 x sqrt(128 / 64)" in result.output
    optimizer = torch.load(output_dir / "checkpoints" / "epoch_002_end" / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["initial_lr"] == pytest.approx(0.01 * 2 ** 0.5)
    assert optimizer["param_groups"][0]["fused"] is True  # PyTorch's fused AdamW on a CPU: one pass over the weights
    metrics, report = read_run(output_dir)
    assert [r["epoch"] for r in metrics] == [1, 2]
    assert_two_processes_shared_the_data(metrics, train_size=2001, batch_size=64)
    _, test = build_mnist(fashion_subset, name="fashion_mnist")
    assert_each_test_sample_counted_once(metrics, report, test.labels, test.classes)
    assert metrics[1]["train_loss"] < metrics[0]["train_loss"]
    # the printed report says which model it scores, and which one best/ holds
    best = max(metrics, key=lambda record: record["val_accuracy"])
    assert (f"classification report of the model after epoch 2 (1001 images; best/ holds epoch {best['epoch']}, "
            f"{best['val_accuracy']:.2%}):") in result.output
    for name in ("classification_report.txt", "confusion_matrix.png", "curves.png"):
        assert (output_dir / name).stat().st_size > 0
    page = (output_dir / "report.html").read_text()  # written once the other process had drawn the plots
    assert 'alt="curves.png"' in page and 'alt="confusion_matrix.png"' in page


def test_cifar_image_folder_two_processes(tmp_path, cifar_jpegs):
    from common.cifar import build_cifar10

    output_dir = tmp_path / "run"
    result = launch_warm(REPO / "scripts" / "train_cifar.py", "--data_dir", cifar_jpegs, "--output_dir", output_dir,
                         "--model", "test_resnet", "--epochs", 1, "--batch_size", 32)
    assert result.returncode == 0, result.output
    metrics, report = read_run(output_dir)
    assert_two_processes_shared_the_data(metrics, train_size=151, batch_size=32)
    _, test = build_cifar10(cifar_jpegs)
    assert_each_test_sample_counted_once(metrics, report, test.labels, test.classes)
    assert "airplane" in (output_dir / "classification_report.txt").read_text()
    optimizer = torch.load(output_dir / "checkpoints" / "epoch_001_end" / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["fused"] is True and "momentum_buffer" in optimizer["state"][0]  # fused SGD


def test_cifar_official_batches_path(tmp_path, cifar_jpegs):
    from common.cifar import build_cifar10
    from test_builders import write_cifar_batches

    train, test = build_cifar10(cifar_jpegs)
    write_cifar_batches(tmp_path / "data" / "cifar-10-batches-py", train, test)
    output_dir = tmp_path / "run"
    result = launch_warm(REPO / "scripts" / "train_cifar.py", "--data_dir", tmp_path / "data", "--output_dir",
                         output_dir, "--model", "test_resnet", "--epochs", 1, "--batch_size", 32)
    assert result.returncode == 0, result.output
    metrics, report = read_run(output_dir)
    assert_two_processes_shared_the_data(metrics, train_size=151, batch_size=32)
    assert_each_test_sample_counted_once(metrics, report, test.labels, test.classes)


def test_fashion_mnist_defaults_reach_88_percent_in_two_epochs(tmp_path):
    require(FASHION_MNIST / "train-images-idx3-ubyte.gz", "apt-get install -y dataset-fashion-mnist")
    output_dir = tmp_path / "run"
    # the defaults but the suspected-label pass after training, which does not touch the model (a forward pass over
    # the 60,000 training images: 3 s of this test's 45 on a 2-core CPU; tests/test_report.py checks the pass)
    result = launch_warm(REPO / "scripts" / "train_mnist.py", "--dataset", "fashion_mnist", "--data_dir", FASHION_MNIST,
                         "--output_dir", output_dir, "--no-find_label_issues")
    assert result.returncode == 0, result.output
    metrics, report = read_run(output_dir)
    assert len(metrics) == 2 and metrics[-1]["val_samples"] == 10000
    assert metrics[-1]["train_unique_samples"] == metrics[-1]["train_samples"] == 468 * 128  # 60,000 // (64 x 2)
    assert report["accuracy"] >= 0.88, f"test accuracy {report['accuracy']:.4f} after 2 epochs"


def test_copied_scripts_run_from_another_directory(tmp_path):
    project = tmp_path / "my_project"
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "train_mnist.py", project / "scripts")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_command([sys.executable, str(project / "scripts" / "train_mnist.py"), "--dataset", "digits",
                          "--epochs", 1, "--output_dir", "out"], cwd=elsewhere)
    assert result.returncode == 0, result.output
    assert (elsewhere / "out" / "classification_report.json").exists()
    assert json.loads((elsewhere / "out" / "classification_report.json").read_text())["macro avg"]["support"] == 450


def test_cpu_flag_or_no_config_with_two_processes_is_refused(tmp_path):
    """Accelerate's `--cpu --num_processes 2`, `--num_processes 2` without a config where no 2 GPUs are, and a config
    of distributed_type MULTI_CPU (`accelerate config`'s "multi-CPU": named, or its default config) quietly start one
    process: we stop it instead, naming the cause."""
    multi_cpu = (REPO / "accelerate_configs" / "cpu.yaml").read_text().replace("distributed_type: MULTI_GPU",
                                                                              "distributed_type: MULTI_CPU")
    (tmp_path / "multi_cpu.yaml").write_text(multi_cpu)
    default = tmp_path / "hf_default" / "accelerate" / "default_config.yaml"  # where `accelerate config` saves it
    default.parent.mkdir(parents=True)
    default.write_text(multi_cpu)
    multi_cpu_said = ("error: `accelerate launch` started a single process where more were asked: its config {} "
                      "(distributed_type: MULTI_CPU) makes Accelerate start one on a single machine")
    for flags, hf_home, said in (
            (["--cpu", "--num_processes", "2"], "hf", "error: `accelerate launch --cpu --num_processes N` starts a "
                                                      "single process"),
            (["--num_processes", "2"], "hf", "error: `accelerate launch --num_processes N` without a --config_file "
                                             "started a single process: Accelerate's defaults start one where fewer "
                                             "than 2 GPUs are visible"),
            (["--config_file", "multi_cpu.yaml"], "hf", multi_cpu_said.format(tmp_path / "multi_cpu.yaml")),
            ([], "hf_default", multi_cpu_said.format(default))):
        command = [sys.executable, "-m", "accelerate.commands.launch", *flags,
                   str(REPO / "scripts" / "train_mnist.py"), "--dataset", "digits", "--output_dir", tmp_path / "run"]
        result = run_command(command, cwd=tmp_path,
                             env={"CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / hf_home)})
        assert result.returncode != 0 and said in result.output, result.output
        assert "accelerate_configs/cpu.yaml" in result.output
        assert "UserError" not in result.output  # our message, not our traceback (the launcher prints its own)
        assert not (tmp_path / "run").exists()


def test_process_count_mismatch_is_refused(tmp_path):
    # the classic trap: torchrun starts 2 processes, a plain Accelerator() on a CPU machine joins none of them
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from accelerate import Accelerator
        from common.errors import run_main
        from common.distributed import check_process_count
        run_main(lambda accelerator: (check_process_count(accelerator), print("trained")), Accelerator())
    """))
    result = launch(probe)
    assert result.returncode != 0
    assert "error: the launcher started 2 processes (WORLD_SIZE=2) but Accelerate joined 1" in result.output
    assert "trained" not in result.output.splitlines()  # (the other process's traceback may quote the line's source)


def test_earlier_run_is_kept_unless_overwrite_and_tensorboard_works_offline(tmp_path):
    train = ["--dataset", "digits", "--epochs", 1, "--output_dir", tmp_path / "run", "--report_to", "tensorboard"]
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the session's (conftest): offline
    first = script("train_mnist.py", *train)
    assert first.returncode == 0, first.output
    assert list((tmp_path / "run").glob("logs/train_mnist/events.out.tfevents.*"))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()

    again = script("train_mnist.py", *train)
    assert again.returncode == 2
    assert "already holds a run" in again.output and "--resume latest" in again.output
    assert "--overwrite" in again.output and "Traceback" not in again.output
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert (tmp_path / "run" / "checkpoints" / "epoch_001_end" / "model.safetensors").exists()
    assert (tmp_path / "run" / "best" / "model.safetensors").exists()

    overwritten = script("train_mnist.py", *train, "--overwrite")
    assert overwritten.returncode == 0, overwritten.output
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    # the old run's tracker logs went aside with it, and were removed at the new run's first checkpoint
    assert len(list((tmp_path / "run").glob("logs/train_mnist/events.out.tfevents.*"))) == 1
    assert not (tmp_path / "run" / "previous_run").exists()


def test_benchmark_prints_the_table_and_json(tmp_path, cifar_jpegs):
    result = script("benchmark.py", "--data_dir", cifar_jpegs / "train", "--images", 40, "--batch_size", 8,
                    "--train_steps", 1, "--repeats", 2, "--train_images", 16, "--output", tmp_path / "bench.json")
    assert result.returncode == 0, result.output
    assert "data path speed-up, ours / seed style:" in result.output and "training step, ours / plain:" in result.output
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["images"] == 40 and bench["batch_size"] == 8
    for key in ("data_ours", "data_seed", "train_ours", "train_plain", "train_ours_with_data", "train_seed_script"):
        assert len(bench[key]) == 2 and all(rate > 0 for rate in bench[key])
    assert "training with data, ours / seed script:" in result.output and "16 images a pass" in result.output
    # the speed claims are measured and recorded in BENCHMARKS.md; a test only checks the arithmetic
    assert bench["data_speedup_median"] == pytest.approx(statistics.median(bench["data_ours"])
                                                         / statistics.median(bench["data_seed"]))


def test_folder_benchmark_measures_start_up_and_memory_of_each_process(tmp_path, warm_children):
    """Of a folder and (--hf) of the same images as a Hugging Face dataset, on one process (started as `python`,
    cold and warm, files and cache: each table row); then one probe launched on 2 processes (`accelerate launch`),
    whose every process reports, each reading the same decoded images (the default, 1 and 2, runs both)."""
    benchmark = load_script("benchmark_folders.py")
    assert benchmark.parse_args([]).processes == [1, 2]
    result = script("benchmark_folders.py", "--sizes", 120, "--batches", 2, "--processes", 1, "--work_dir", tmp_path,
                    "--hf")
    assert result.returncode == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [(row["source"], row.get("processes")) for row in rows] == [
        ("folder", 1), ("folder", None), ("hf", 1), ("hf", None)]
    for row in rows[0], rows[2]:  # start-ups of both paths, CPU time, RSS and PSS for every process, from /proc
        for path in ("files", "cache"):
            assert row[f"{path}_cold_startup_s"] > 0 and row[f"{path}_warm_startup_s"] > 0
            assert len(row[f"{path}_cold_cpu_s_per_process"]) == row["processes"]
        assert len(row["pss_mb_per_process"]) == row["processes"] and min(row["pss_mb_per_process"]) > 0
    for row in rows[1], rows[3]:
        assert set(row["images_per_s_per_core"]) == {"files_pil_worker", "cache_device", "cache_cpu_share",
                                                     "seed_pipeline"}
    assert len(list((tmp_path / "images_120").rglob("*.jpg"))) == 120
    assert (tmp_path / "hf_120" / "state.json").exists() and (tmp_path / "hf_120" / ".checked-train.json").exists()
    assert "| 120 | folder | 1 |" in result.output and "| 120 | hf | 1 |" in result.output
    # 2 processes: the launcher starts both, each reports (gathered to the main one), both read the same pixels
    args = benchmark.parse_args(["--work_dir", str(tmp_path)])
    reports = benchmark.launch_probes(tmp_path / "images_120", 2, True, args)
    assert sorted(report["rank"] for report in reports) == [0, 1]
    assert {report["images"] for report in reports} == {84} and len({report["checksum"] for report in reports}) == 1
    assert min(report["startup_s"] for report in reports) > 0 and min(report["pss_mb"] for report in reports) > 0


def test_the_hf_benchmark_trains_a_folder_and_its_dataset_to_the_same_accuracy(tmp_path, seedlings, warm_children):
    result = script("benchmark_hf.py", "--data_dir", seedlings, "--work_dir", tmp_path, "--repeats", 1, "--", "--model",
                    "test_resnet", "--image_size", 32, "--epochs", 1, "--batch_size", 8)
    assert result.returncode == 0, result.output
    runs = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [(run["path"], run["source"]) for run in runs] == [("decode cache", "folder"), ("decode cache", "hf"),
                                                              ("files, workers", "folder"), ("files, workers", "hf"),
                                                              ("streamed", "hf")]
    for folder, hf in (runs[:2], runs[2:4]):  # the same batches: the same accuracy
        assert folder["val_accuracy"] == hf["val_accuracy"] and hf["images_per_s"] > 0 and hf["startup_s"] > 0
    assert runs[4]["images_per_s"] > 0 and 0 <= runs[4]["val_accuracy"] <= 1
    for path in ("files, workers", "streamed"):
        assert re.search(rf"\| {path} \| hf \| [\d.]+ \([\d.]+\) \| [\d.]+ \|", result.output)
    assert (tmp_path / "source.txt").read_text() == str(seedlings.resolve())
    # a user's mistake after -- is train_seedlings.py's own message; another --data_dir is split again, not the last
    other = shutil.copytree(seedlings, tmp_path / "other_data", ignore=shutil.ignore_patterns(".checked*", "Maize"))
    failed = script("benchmark_hf.py", "--data_dir", other, "--work_dir", tmp_path, "--", "--model", "resnet19")
    assert failed.returncode == 2 and "Traceback" not in failed.output, failed.output
    assert f"error: train_seedlings.py --data_dir {tmp_path / 'split'} --model resnet19" in failed.output
    assert "error: unknown model 'resnet19'" in failed.output
    assert (tmp_path / "source.txt").read_text() == str(other.resolve())
    assert not (tmp_path / "split" / "train" / "Maize").exists()
    missing = script("benchmark_hf.py", "--data_dir", tmp_path / "typo", "--work_dir", tmp_path / "w2")
    assert missing.returncode == 2 and "Traceback" not in missing.output, missing.output
    assert f"error: could not split {tmp_path / 'typo'}: error: {tmp_path / 'typo'} not found" in missing.output
    (tmp_path / "mine" / "split").mkdir(parents=True)  # a split of the user's in the --work_dir named: kept
    (tmp_path / "mine" / "split" / "notes.txt").write_text("mine")
    theirs = script("benchmark_hf.py", "--data_dir", seedlings, "--work_dir", tmp_path / "mine")
    assert theirs.returncode == 2 and (tmp_path / "mine" / "split" / "notes.txt").read_text() == "mine"
    assert (f"error: --work_dir {tmp_path / 'mine'} holds split/, which this tool did not make (no source.txt beside "
            "it) and would replace: choose another --work_dir") in theirs.output


SHARED = REPO.parent / "shared"  # the peers' scripts live beside the repository, never in it


@pytest.mark.parametrize("task", ["seedlings", "fashion_mnist"])
def test_the_peer_benchmark_times_each_script_to_its_targets_on_a_tiny_budget(tmp_path, seedlings, task,
                                                                               warm_children):
    """Ours on two seeds (seedlings: a run per seed, read back per seed); on Fashion-MNIST, one seed, ours and the
    seed post's script where ../shared holds it. timm's train.py and cv_example.py are timed the same way by the GPU
    benchmark's smoke run (tests/test_bench_gpu.py) on one seed."""
    if task == "seedlings":
        data, args, scripts, seeds = seedlings, ["--image_size", 32, "--batch_size", 16], ["ours"], [42, 1]
    else:
        require(FASHION_MNIST / "train-images-idx3-ubyte.gz", "apt-get install -y dataset-fashion-mnist")
        from common.mnist import read_idx

        from conftest import write_idx

        data, seed_script = tmp_path / "fashion", SHARED / "refs" / "seed_mnist_ref.py"
        data.mkdir()
        for split, count in (("train", 512), ("t10k", 256)):  # the seed script reads .gz files only
            for kind in ("images-idx3", "labels-idx1"):
                images = read_idx(FASHION_MNIST / f"{split}-{kind}-ubyte.gz")[:count]
                write_idx(data / f"{split}-{kind}-ubyte.gz", images)
        args = ["--seed_script", seed_script] if seed_script.is_file() else []
        scripts, seeds = ["ours", "seed"] if seed_script.is_file() else ["ours"], [1]
    result = script("benchmark_peers.py", task, "--data_dir", data, "--seeds", *seeds, "--epochs", 1, "--work_dir",
                    tmp_path / "work", "--output", tmp_path / "peers.json", "--target", 0.05, *args)
    assert result.returncode == 0, result.output
    out = json.loads((tmp_path / "peers.json").read_text())
    assert out["seeds"] == seeds and out["cores"] >= 1 and "cpu" in out
    assert_timed_runs(out, scripts, target=0.05)
    wall = r"[\d.]+ \+- [\d.]+" if len(seeds) > 1 else r"[\d.]+"  # over seeds, mean +- standard deviation
    for name in scripts:
        assert re.search(rf"\n\| {name} \| {wall} \| ", result.output), result.output
    logs = sorted(path.name for path in (tmp_path / "work" / "runs" / "seed1").glob("*.log"))
    assert logs == sorted(f"{name}.log" for name in scripts)
    if task == "seedlings":  # ours ran cold: each run checked the images again
        assert "checked 59 images" in (tmp_path / "work" / "runs" / "seed1" / "ours.log").read_text()
        assert len(list((tmp_path / "work" / "flat" / "train").glob("*.jpg"))) == 59  # cv_example.py's layout


def test_a_peer_that_fails_after_its_final_accuracy_is_kept_with_a_warning_and_ours_never_is(tmp_path, capsys):
    """The seed script's plain DDP sometimes aborts in its teardown, after its result (seen in CI: SIGABRT on one
    process); a script that fails before printing all its results, or ours failing at all, stops the benchmark."""
    from common.errors import UserError

    run_timed = load_script("benchmark_peers.py").run_timed
    result = "print('ref world=2 epochs=1 train_s=0.1 img_per_s=3566 test_acc=0.1445', flush=True)"
    abort = [sys.executable, "-c", f"{result}; import os; os.abort()"]
    run = run_timed("seed", abort, env={}, log=tmp_path / "seed.log", processes=2, results=1)
    assert run["exit_code"] == -6 and run["final_accuracy"] == 0.1445 and run["images_per_s"] == 3566
    assert "warning: seed failed (exit code -6) after printing its final accuracy" in capsys.readouterr().out
    ours = "print('epoch 1/1 val_accuracy 50.00%  lr 1e-3  1,000 img/s  1.0s', flush=True); import sys; sys.exit(3)"
    for name, command in (("seed", [sys.executable, "-c", "import os; os.abort()"]),
                          ("ours", [sys.executable, "-c", ours])):
        with pytest.raises(UserError, match=f"{name} failed \\(exit code (-6|3)\\); the end of "):
            run_timed(name, command, env={}, log=tmp_path / f"{name}.log", processes=1, results=1)
