"""scripts/bench_gpu.py: `prepare` fills its folder from a shared tree (built here from the real fixture images, laid
out as ../shared lays out its archives) or refuses in one line; `run --smoke --device cpu` goes through every stage
and writes bench-gpu.md and bench-gpu.json, a row per stage, also when the time is gone before a stage."""

import json
import re
import shutil
import sys
import tarfile
import zipfile

import pytest
from PIL import Image

from conftest import FIXTURES, REPO, all_gone, assert_timed_runs, load_script, refused, script

SHARED = REPO.parent / "shared"  # the real peers' scripts live beside the repository, never in it
PEERS = ("resnet18_reference.py", "timm_train.py", "cv_example.py")
STAGES = ["setup", "reference", "ours_cold", "ours_warm", "ours_variant", "seedlings"]


def make_shared(root, *, real_peers=False):
    """datasets/cifar10-train-jpeg.tar.gz (cifar10/train/<class>/<n>.jpg: the 151 fixture JPEGs),
    datasets/plant-seedlings-train-150px.tar (plant-seedlings/<class>/<id>.png: the 85 fixture PNGs), and peers/:
    the real scripts of ../shared/peers, or stand-ins (marked patched, as the real cv_example.py is)."""
    (root / "datasets").mkdir(parents=True)
    with tarfile.open(root / "datasets" / "cifar10-train-jpeg.tar.gz", "w:gz") as archive:
        archive.add(FIXTURES / "cifar10" / "train", arcname="cifar10/train")
    with tarfile.open(root / "datasets" / "plant-seedlings-train-150px.tar", "w") as archive:
        archive.add(FIXTURES / "seedlings", arcname="plant-seedlings")
    (root / "peers").mkdir()
    for name in PEERS:
        if real_peers:
            shutil.copy(SHARED / "peers" / name, root / "peers" / name)
        else:
            (root / "peers" / name).write_text("# PATCH: a stand-in\n")
    return root


def test_prepare_fills_the_folder_and_says_the_device_command(tmp_path):
    shared, bench = make_shared(tmp_path / "shared"), tmp_path / "bench"
    result = script("bench_gpu.py", "prepare", "--shared", shared, "--smoke", "--bench_dir", bench)
    assert result.returncode == 0, result.output
    manifest = json.loads((bench / "manifest.json").read_text())
    assert manifest["smoke"] and manifest["seedlings_unreadable"] == []
    assert manifest["seedlings_images"] == 85  # at most 8 per class: all of the fixture's
    with tarfile.open(bench / "cifar10-train-jpeg.tar.gz") as archive:  # at most 30 per class: all 151
        assert len([m for m in archive.getmembers() if m.isfile()]) == 151
    with zipfile.ZipFile(bench / "plant-seedlings-jpeg90.zip") as archive:
        names = archive.namelist()
        assert all(re.fullmatch(r"plant-seedlings/[^/]+/\w+\.jpg", name) for name in names), names[:3]
        with archive.open(names[0]) as file, Image.open(file) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size == (48, 48)  # the PNGs' size
    assert sorted(p.name for p in (bench / "peers").iterdir()) == sorted(PEERS)
    assert f"run --bench_dir {bench} --out \"$OUT\"' carry [\"{bench}\"]" in result.stdout


def test_prepare_refuses_a_folder_too_large_to_carry_and_a_missing_or_unpatched_peer(tmp_path):
    shared, bench = make_shared(tmp_path / "shared"), tmp_path / "bench"
    prepare = ["prepare", "--shared", shared, "--smoke", "--bench_dir", bench]
    assert script("bench_gpu.py", *prepare).returncode == 0
    before = (bench / "manifest.json").read_text()
    error = refused("bench_gpu.py", *prepare, "--max_mib", "0.01")
    assert re.search(rf"{bench} would hold [\d.]+ MiB, with the repository's [\d.]+ over the 0.01 MiB a device call "
                     r"carries \(largest", error)
    assert len(error.strip().splitlines()) == 1 and (bench / "manifest.json").read_text() == before  # kept whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder beside it
    # a folder of the user's given as --bench_dir (prepare replaces its own whole): refused, kept
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    for given, message in ((tmp_path / "mine", "holds files this tool did not write (no manifest.json), which it "
                                               "would replace: choose a new folder"),
                           (tmp_path / "mine" / "notes.txt", "is a file: choose a folder")):
        error = refused("bench_gpu.py", "prepare", "--shared", shared, "--smoke", "--bench_dir", given)
        assert f"error: --bench_dir {given} {message}" in error
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    (shared / "peers" / "cv_example.py").write_text("# the example as published\n")
    assert "cv_example.py has no PATCH lines: apply peers/cv_example.patch" in refused("bench_gpu.py", *prepare)
    (shared / "peers" / "timm_train.py").unlink()
    error = refused("bench_gpu.py", *prepare)
    assert f"{shared / 'peers' / 'timm_train.py'} not found: --shared must be the project's shared folder" in error
    assert "prepare needs --shared" in refused("bench_gpu.py", "prepare", "--bench_dir", bench)


def test_run_refuses_a_folder_not_prepared_or_prepared_for_a_smoke_run(tmp_path):
    make_shared(tmp_path / "shared")
    out = ["--out", tmp_path / "out", "--work_dir", tmp_path / "work"]
    error = refused("bench_gpu.py", "run", "--bench_dir", tmp_path / "bench", *out)
    assert "manifest.json not found: run `python scripts/bench_gpu.py prepare --shared ../shared`" in error
    assert script("bench_gpu.py", "prepare", "--shared", tmp_path / "shared", "--smoke", "--bench_dir",
                  tmp_path / "bench").returncode == 0
    error = refused("bench_gpu.py", "run", "--bench_dir", tmp_path / "bench", "--device", "cpu", *out)
    assert "was prepared with --smoke (a few images): prepare again without it" in error
    error = refused("bench_gpu.py", "run", "--bench_dir", tmp_path / "bench", "--smoke", "--device", "cpu",
                    "--out", tmp_path / "out", "--work_dir", tmp_path / "bench" / "work")
    assert "--work_dir" in error and "is inside the input" in error  # it would travel to the device
    (tmp_path / "mine").mkdir()  # a folder of the user's as --work_dir, which a run empties first: refused, kept
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    error = refused("bench_gpu.py", "run", "--bench_dir", tmp_path / "bench", "--smoke", "--device", "cpu",
                    "--out", tmp_path / "out", "--work_dir", tmp_path / "mine")
    assert f"--work_dir {tmp_path / 'mine'} holds files this tool did not write (no .bench-gpu-work)" in error
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    error = refused("bench_gpu.py", "run", "--bench_dir", tmp_path / "bench", "--smoke", "--device", "cpu",
                    "--out", tmp_path / "mine" / "notes.txt", "--work_dir", tmp_path / "work")
    assert f"--out {tmp_path / 'mine' / 'notes.txt'} is a file: choose a folder" in error  # was a traceback


def test_a_run_out_of_time_skips_every_stage_and_still_writes_its_table(tmp_path):
    make_shared(tmp_path / "shared")
    assert script("bench_gpu.py", "prepare", "--shared", tmp_path / "shared", "--smoke", "--bench_dir",
                  tmp_path / "bench").returncode == 0
    result = script("bench_gpu.py", "run", "--smoke", "--device", "cpu", "--bench_dir", tmp_path / "bench", "--out",
                    tmp_path / "out", "--work_dir", tmp_path / "work", "--budget_s", "1", "--skip", "seedlings",
                    "--skip", "ours_variant")  # given twice: both
    assert result.returncode == 0, result.output
    report = json.loads((tmp_path / "out" / "bench-gpu.json").read_text())
    assert [stage["stage"] for stage in report["stages"]] == STAGES
    assert report["stages"][0]["status"].startswith("skipped: ") and "s left of --budget_s" in report["stages"][0][
        "status"]
    assert [s["status"] for s in report["stages"][1:]] == ["skipped: no data: the setup did not finish"] * 3 + [
        "skipped: --skip"] * 2
    markdown = (tmp_path / "out" / "bench-gpu.md").read_text()
    assert all(f"| {name} | skipped: " in markdown for name in STAGES)
    # setup makes the data every stage reads; an empty name (a trailing comma) is named too
    for skip, named in (("setup", "'setup'"), ("reference,ours", "'ours'"), ("seedling", "'seedling'"),
                        ("", "''"), ("reference,", "''")):
        error = refused("bench_gpu.py", "run", "--smoke", "--device", "cpu", "--bench_dir", tmp_path / "bench",
                        "--out", tmp_path / "out2", "--skip", skip)
        assert error.startswith(f"error: --skip {named}: not a stage that can be skipped; choose among "
                                "reference,ours_cold,ours_warm,ours_variant,seedlings"), error
    assert not (tmp_path / "out2").exists()


def test_every_recipe_is_a_command_train_cifar_accepts_with_its_settings_in_the_environment():
    module, train_cifar = load_script("bench_gpu.py"), load_script("train_cifar.py")
    ctx = {"smoke": False, "device": "cuda", "split": REPO / "data" / "cifar10-split"}
    for name, recipe in module.PRESETS.items():
        command = [str(word) for word in module.ours_command(ctx, REPO / "outputs" / name, preset=name)]
        args = train_cifar.parse_args(command[command.index("scripts/train_cifar.py") + 1:])  # exits on a wrong flag
        assert str(args.output_dir) == str(REPO / "outputs" / name), name
        settings = [word for word in recipe.split() if "=" in word]
        assert command[:command.index(sys.executable)] == (["env", *settings] if settings else []), name
    graphs = module.PRESETS["reference_recipe_plain_start_cuda_graphs"]
    assert graphs.startswith("ACCELERATE_DYNAMO_MODE=reduce-overhead") and graphs.endswith(" --compile")


def test_a_stage_past_its_timeout_is_killed_with_its_children(tmp_path):
    """The launcher and the training process it started: the whole process group goes."""
    module = load_script("bench_gpu.py")
    child = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    command = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"]
    done = module.run_logged(command, log=tmp_path / "stage.log", timeout=3, env={})
    assert done["exit_code"] is None and 3 <= done["wall_s"] < 30
    pid = int((tmp_path / "stage.log").read_text().splitlines()[-1])
    assert all_gone([pid])


@pytest.mark.slow
def test_the_smoke_run_goes_through_every_stage_on_a_cpu(tmp_path, warm_children):
    """prepare --smoke, then run --smoke --device cpu: the reference, ours cold and warm, ours warm with the variant
    recipe, the seedlings peers, each a few steps on the fixture images; what comes back is at most 8 files. The
    peers' scripts are never in the repository: where no ../shared holds them (a clone elsewhere, as CI's may be),
    there is nothing to run."""
    if not (SHARED / "peers" / "resnet18_reference.py").is_file():
        pytest.skip(f"{SHARED / 'peers'} holds no peers' scripts (they live beside the checkout, never in it)")
    shared, bench, out = make_shared(tmp_path / "shared", real_peers=True), tmp_path / "bench", tmp_path / "out"
    assert script("bench_gpu.py", "prepare", "--shared", shared, "--smoke", "--bench_dir", bench).returncode == 0
    result = script("bench_gpu.py", "run", "--smoke", "--device", "cpu", "--bench_dir", bench, "--out", out,
                    "--work_dir", tmp_path / "work")
    assert result.returncode == 0, result.output
    report = json.loads((out / "bench-gpu.json").read_text())
    stages = {stage["stage"]: stage for stage in report["stages"]}
    assert list(stages) == STAGES and all(s["status"] == "ok" for s in stages.values()), report["stages"]
    assert stages["setup"]["results"]["cifar10_images"] == {"train": 135, "val": 16}  # 10% of each class
    reference = stages["reference"]["results"]
    assert reference["steps"] == 2 and 0 <= reference["accuracy_flip_translate_tta"] <= 1
    for name in ("ours_cold", "ours_warm", "ours_variant"):
        ours = stages[name]["results"]
        tta = "flip" if name == "ours_variant" else "flip_translate"  # the variant: the preset with flip TTA
        assert ours["epochs"] == 1 and ours["tta"] == tta and 0 <= ours["accuracy"] <= 1
        steps = ["none", "flip", "flip_translate"][:2 if tta == "flip" else 3]  # the table's plain (and flip)
        assert list(ours["accuracy_by_tta"]) == steps and ours["accuracy_by_tta"][tta] == ours["accuracy"]
        assert 0 < ours["first_step_s"] < stages[name]["wall_s"] and ours["images_per_s"] > 0
        assert ours["train_s"] > 0 and ours["eval_s"] >= 0 and ours["between_epochs_s"] == 0  # one epoch: no gap
        assert ours["first_step_s"] <= ours["last_epoch_at_s"] < stages[name]["wall_s"]  # the same clock
        assert re.fullmatch(r"start and imports [\d.]+ s, data [\d.]+ s, model and device [\d.]+ s, the first "
                            r"batch [\d.]+ s",
                            ours["startup"]), ours["startup"]
        assert re.fullmatch(r"scoring after training [\d.]+ s, the last checkpoint's writes [\d.]+ s, the reports "
                            r"[\d.]+ s", ours["wind_down"]), ours["wind_down"]
        assert 0 < ours["wind_down_s"] < stages[name]["wall_s"] - ours["last_epoch_at_s"]
    warm, variant = (json.loads((tmp_path / "work" / name / "best" / "meta.json").read_text())["args"]
                     for name in ("ours-warm", "ours-variant"))
    assert warm["identity_start"] is False and (warm["seed"], variant["seed"]) == (42, 42)
    assert variant["identity_start"] is False and (warm["tta"], variant["tta"]) == ("flip_translate", "flip")
    assert {key: value for key, value in warm.items() if key not in ("tta", "output_dir")} == {
        key: value for key, value in variant.items() if key not in ("tta", "output_dir")}  # all else the same
    assert stages["ours_variant"]["preset"] == "reference_recipe_plain_start_flip_tta"
    assert "checked 135 images" in (out / "ours-cold.log").read_text()  # cold: decoded in the run
    assert "image check of 135 images read from" in (out / "ours-warm.log").read_text()  # warm: the cold one's
    peers = stages["seedlings"]["results"]  # benchmark_peers.py's JSON: each peer's lines read as ours are
    assert_timed_runs(peers, ["ours", "timm", "cv_example"], target=0.60)
    assert peers["seeds"] == [42] and peers["ours_first_step_s"] > 0
    markdown = (out / "bench-gpu.md").read_text()
    for row in ("| ours, cold", "| ours, warm (", "| ours, warm, `--variant reference_recipe_plain_start_flip_tta`",
                " plain, ", " flip, **", "** flip + translate TTA (epoch 1; best ",
                "| reference", "| ours |", "| timm |", "| cv_example |", "- ours cold, ", "- ours variant, ",
                "s to our last line (scoring after training",
                *(f"| {name} | ok |" for name in STAGES)):
        assert row in markdown, row
    assert "resnet18_reference.py SPLIT --device cpu" in markdown and str(tmp_path) not in markdown
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench-gpu.json", "bench-gpu.md", "ours-cold.log", "ours-variant.log", "ours-warm.log",
                     "reference.log", "seedlings.log", "setup.log"]  # 8: what a device call brings back
    assert "---- runs/seed42/cv_example.log ----" in (out / "seedlings.log").read_text()
