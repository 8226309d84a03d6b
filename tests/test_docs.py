"""The doc-test: every command in README.md and docs/*.md is checked against the code, so the docs cannot drift.

What counts as a command: each line of a fenced block (``` with no language, or bash, sh, shell; in a console
block, the lines after a `$ ` prompt), its backslash continuations joined, its comments and `$ ` prompt dropped,
split at `&&`, `||` and `;`; and each inline code span of the prose that is a whole command of ours (a launcher or
python, then `scripts/NAME.py` or the Slurm batch file, or `make TARGET`). A span holding `...` is an excerpt and
is left out; a ```text block is output, not commands. Every fenced command must be one this test knows how to
check: an unknown program fails it.

The rules, for every command:
- one of our scripts (`python scripts/X.py ...`, `accelerate launch ... scripts/X.py ...`, `torchrun ...
  scripts/X.py ...`, `srun ...`, `sbatch scripts/slurm/train_multinode.sbatch ...`): the script exists and its own
  `parse_args` accepts the arguments that follow its path (the module is imported in this process). Placeholders
  (DATA, NODE0, my-org/weeds, RUN) are strings to it: the parsers' `path` type refuses only an empty path, and no
  parser here looks at the disk. The launcher's own arguments go through its own parser (Accelerate's
  `launch_command_parser`, torch's torchrun parser), and every `--config_file` exists in the repository. For
  `sbatch`, the batch file exists and the script it runs (`SCRIPT`, else the file's default) takes the file's own
  arguments (`--output_dir`, `--dist_timeout`, `--resume auto`) followed by the command's, as the file passes them;
  its default `CONFIG` exists. A flag renamed in the code fails here.
- `make TARGET [VAR=value]`: TARGET is a target of the Makefile and VAR one of its variables.
- `python -m pytest FILES`: the files exist. `pip install -r FILE`: the file exists.
- other programs are listed in EXTERNAL with the reason they are not run (a browser, the network).

Parse-checked only, never run: a command that needs a GPU (a config other than cpu.yaml, `--compile`), several
nodes (`sbatch`, `srun`, `torchrun`, `--machine_rank`), the network or the Hub (`hf:` names on the Hub, `--download`,
`--pretrained hub`, `hf upload`, `pip`), a dataset that is not in the repository (CIFAR-10, Fashion-MNIST, Plant
Seedlings: `data/...`), or a 2-process launch (seconds of start-up each; tests/test_distributed.py,
test_checkpoint.py, test_seedlings.py and the others launch the scripts for real on their fixtures). `make demo` and
`make test` are the suite's own entry points: they are not run from inside it.

Run for real (REAL, in this order, each an exact command of the docs): in a folder of tiny data, where the seedling
fixture is data/my-photos, six of its photos are my_images/, and the session's trained digits run (`digits_run` of
conftest.py, one process, 4 epochs) stands in for `make demo`'s outputs/digits. Scripts run in this process as
`python scripts/NAME` would run them (conftest.py's `script`); mkdir, ls and tail as programs. Each is checked for
what it writes. `--help` is run for real by the parse check itself (it prints and exits 0).

The python blocks: the `notebook_launcher` block runs with `notebook_launcher` replaced by a stand-in that checks
what it is given (tests/test_distributed.py launches it for real with 2 processes); the epoch loop of recipes.md is
the loop of scripts/train_cifar.py, line for line (a call there may take more arguments: the EMA's), and every
`run.` method it calls is one of TrainingRun; the timm block runs for real on a timm `best/` made here; the two
blocks for our own architectures are run by tests/test_model_folder.py, which this test checks can find them.

The pages themselves: README.md has at most 300 lines and links every docs page and BENCHMARKS.md; every relative
link of README.md and docs/ names a file that exists, and its #anchor a heading of that file; each docs page
opens with a block of commands.
"""

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO, load_script, script

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_BLOCKS = {"", "bash", "sh", "shell", "console"}
README_MAX_LINES = 300
# programs that are not run, and why (a fenced command of any other program fails the test)
EXTERNAL = {
    "hf": "uploads to the Hugging Face Hub: needs the network and `hf auth login`",
    "firefox": "a browser; tests/test_report.py opens report.html in headless Chromium",
    "pip": "installs from the network (the -r files are checked to exist)",
    "mkdir": "a shell command, run for real where REAL holds it",
    "ls": "a shell command, run for real where REAL holds it",
    "tail": "a shell command, run for real where REAL holds it",
    "cut": "a shell command, reading a pipe",
}
PYTHONS = {"python", "python3", ".venv/bin/python"}
LAUNCHERS = ("accelerate launch", ".venv/bin/accelerate launch", "torchrun", "srun", "sbatch", "python", "python3",
             ".venv/bin/python")


def relative(path):
    return str(Path(path).relative_to(REPO))


def strip_fences(text):
    """The text with its fenced blocks blanked (line numbers kept), for headings and prose."""
    return re.sub(r"^```.*?^```", lambda block: "\n" * block.group(0).count("\n"), text, flags=re.S | re.M)


def fenced_blocks(path):
    """(language, first line number of the code, code) of each fenced block of a markdown file."""
    text = path.read_text()
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield block.group(1), text.count("\n", 0, block.start(2)) + 1, block.group(2)


def split_commands(line):
    """A shell line as its commands: comments and a `$ ` prompt dropped, split at && || ; and a pipe's |."""
    line = re.sub(r"(^|\s)#.*$", "", line).strip()
    line = re.sub(r"^\$\s+", "", line)
    if not line:
        return []
    commands, current = [], []
    for token in shlex.split(line):
        if token in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [command for command in [*commands, current] if command]


def block_commands(path):
    """(where, the command as written, its tokens) of every command of the fenced command blocks of `path`."""
    for language, first, code in fenced_blocks(path):
        if language not in COMMAND_BLOCKS:
            continue
        lines = code.split("\n")
        number = 0
        while number < len(lines):
            start, line = number, lines[number]
            if language == "console" and not line.startswith("$ "):  # output
                number += 1
                continue
            while line.rstrip().endswith("\\") and number + 1 < len(lines):
                number += 1
                line = line.rstrip()[:-1] + " " + lines[number].strip()
            for tokens in split_commands(line):
                yield f"{relative(path)}:{first + start}", shlex.join(tokens), tokens
            number += 1


def inline_commands(path):
    """(where, span, tokens) of the inline code spans of the prose that are a whole command of ours; a span that
    starts with `scripts/NAME.py` is that script run by python."""
    text = strip_fences(path.read_text())
    text = re.sub(r"``.*?``", lambda span: re.sub(r"[^\n]", " ", span.group(0)), text, flags=re.S)  # `` a `b` ``
    for span in re.finditer(r"`([^`]+)`", text):
        code = " ".join(span.group(1).split())
        if re.match(r"scripts/\S+ ", code):
            code = "python " + code
        if "..." in code or not re.match(r"(\w+=\S+ )*(" + "|".join(map(re.escape, LAUNCHERS)) + r"|make) ", code):
            continue
        if code.startswith("make ") or re.search(r"scripts/\w+\.py|\.sbatch\b", code):
            yield f"{relative(path)}:{text.count(chr(10), 0, span.start()) + 1}", code, shlex.split(code)


ALL_COMMANDS = [command for path in PAGES for source in (block_commands, inline_commands) for command in source(path)]


@functools.cache
def parser_module(name):
    return load_script(name)


def parse_script(script_path, args, where):
    """Our script's own parse_args on `args`; the parsed arguments (or None for --help, which it printed)."""
    from common.errors import UserError
    from common.flags import ArgumentParser

    path = REPO / script_path
    assert path.is_file() and path.parent == REPO / "scripts", f"{where}: {script_path} is not one of our scripts"
    module = parser_module(path.name)
    saved, argv = ArgumentParser.raise_errors, sys.argv
    ArgumentParser.raise_errors, sys.argv = True, [str(path)]  # the parser's name in its messages
    try:
        return module.parse_args(args)
    except UserError as error:
        pytest.fail(f"{where}: {path.name} refuses {shlex.join(args)!r}: {error}")
    except SystemExit as stop:
        assert "--help" in args and stop.code == 0, f"{where}: {path.name} exited {stop.code} on {args}"
        return None
    finally:
        ArgumentParser.raise_errors, sys.argv = saved, argv


def parse_with(parser, args, where, what):
    """A launcher's own argparse parser on `args` (it exits on an error: said here as a failure)."""
    try:
        return parser.parse_args(args)
    except SystemExit as stop:
        pytest.fail(f"{where}: {what} refuses {shlex.join(args)!r} (exit {stop.code}; its message is above)")


def sbatch_defaults(batch_file):
    """The batch file's `export NAME="${NAME:-default}"` defaults, and the arguments it gives the script."""
    text = batch_file.read_text()
    defaults = dict(re.findall(r'^export (\w+)="\$\{\1:-(.*?)\}"$', text, re.M))
    fixed = re.search(r'"\$SCRIPT" (.*?) "\$@"', text).group(1)
    return defaults, [re.sub(r"^\$(\w+)$", lambda name: defaults.get(name.group(1), "X"), token)
                      for token in shlex.split(fixed)]


def makefile():
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):", text, re.M)), set(re.findall(r"^(\w+)\s*[?:]?=", text, re.M))


def check_command(tokens, where):
    """Check one command by the rules of the module docstring; what was done, in a word."""
    env = {}
    while tokens and re.match(r"^\w+=", tokens[0]):
        name, value = tokens[0].split("=", 1)
        env[name], tokens = value, tokens[1:]
    program, args = tokens[0], tokens[1:]
    if program in PYTHONS and args[:2] == ["-m", "accelerate.commands.launch"]:  # the launcher without the CLI
        program, args = "accelerate", ["launch", *args[2:]]
    if program.endswith("accelerate") and args[:1] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser

        launch = parse_with(launch_command_parser(), args[1:], where, "accelerate launch")
        if launch.config_file:
            assert (REPO / launch.config_file).is_file(), f"{where}: no config file {launch.config_file}"
        parse_script(launch.training_script, launch.training_script_args, where)
        return "parsed"
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        run = parse_with(get_args_parser(), args, where, "torchrun")
        parse_script(run.training_script, run.training_script_args, where)
        return "parsed"
    if program == "srun":  # srun --opt=value ... COMMAND
        while args and args[0].startswith("-"):
            args = args[1:]
        return check_command(args, where)
    if program == "sbatch":
        position = next(index for index, arg in enumerate(args) if arg.endswith(".sbatch"))
        batch_file = REPO / args[position]
        assert batch_file.is_file(), f"{where}: no batch file {args[position]}"
        defaults, fixed = sbatch_defaults(batch_file)
        assert (REPO / defaults["CONFIG"]).is_file(), f"{where}: no config file {defaults['CONFIG']} (the batch file's)"
        parse_script(env.get("SCRIPT", defaults["SCRIPT"]), fixed + args[position + 1:], where)
        return "parsed"
    if program in PYTHONS:
        if args[:2] == ["-m", "pytest"]:
            for arg in args[2:]:
                if not arg.startswith("-") and not re.match(r"^\d+$", arg):
                    assert (REPO / arg.split("::")[0]).exists(), f"{where}: no test file {arg}"
            return "parsed"
        if args[:2] == ["-m", "venv"]:
            return "external"
        parsed = parse_script(args[0], args[1:], where)
        return "run" if parsed is None else "parsed"
    if program == "make":
        targets, variables = makefile()
        for arg in args:
            if "=" in arg:
                assert arg.split("=")[0] in variables, f"{where}: the Makefile has no variable {arg.split('=')[0]}"
            else:
                assert arg in targets, f"{where}: the Makefile has no target {arg!r}"
        return "parsed"
    if program.endswith("pip") and "-r" in args:
        assert (REPO / args[args.index("-r") + 1]).is_file(), f"{where}: no requirements file after -r in {args}"
        return "external"
    assert program.split("/")[-1] in EXTERNAL, (
        f"{where}: {shlex.join(tokens)!r}: this test does not know how to check {program!r}; add a rule (or a reason "
        "in EXTERNAL)")
    return "external"


@pytest.mark.parametrize("where, command, tokens", ALL_COMMANDS, ids=[f"{w} {c[:60]}" for w, c, _ in ALL_COMMANDS])
def test_every_command_of_the_docs_parses(where, command, tokens):
    check_command(list(tokens), where)


def test_the_docs_hold_commands_of_our_scripts():
    """The extraction itself: if it found nothing, the checks above would pass on nothing."""
    ours = [command for _, command, _ in ALL_COMMANDS if re.search(r"scripts/\w+\.py|\.sbatch", command)]
    assert len(ours) >= 60, len(ours)
    for script_name in ("train_cifar.py", "train_mnist.py", "train_seedlings.py", "evaluate.py", "predict.py",
                        "export.py", "split_dataset.py", "compute_mean_std.py", "benchmark_accuracy.py"):
        assert any(f"scripts/{script_name}" in command for command in ours), script_name


# ---- run for real, on tiny data ----

REAL = [
    "python scripts/evaluate.py --model_dir outputs/digits",
    "python scripts/predict.py --model_dir outputs/digits --output predictions.csv my_images/",
    ("mkdir -p deploy && python scripts/export.py --model_dir outputs/digits/best --output deploy/digits.onnx "
     "--check_images my_images/"),
    "ls outputs/digits outputs/digits/best",
    "tail -n 1 outputs/digits/metrics.jsonl",
    "python scripts/split_dataset.py data/my-photos data/my-photos-split",
    "python scripts/compute_mean_std.py data/my-photos --output mean_std.json",
]


def documented(command):
    """The docs' command lines, each as one line (continuations joined)."""
    lines = set()
    for path in PAGES:
        for language, _, code in fenced_blocks(path):
            if language in COMMAND_BLOCKS:
                for line in re.sub(r"\\\n\s*", " ", code).split("\n"):
                    lines.add(" ".join(re.sub(r"(^|\s)#.*$", "", line).split()))
    return command in lines


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, digits_run):
    """A folder holding what the REAL commands name: the seedling fixture as data/my-photos, six of its photos as
    my_images/, the session's digits run as outputs/digits (standing in for `make demo`'s)."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(FIXTURES / "seedlings", root / "data" / "my-photos")
    (root / "my_images").mkdir()
    for photo in sorted((FIXTURES / "seedlings").rglob("*.png"))[::15]:
        shutil.copy(photo, root / "my_images" / photo.name)
    shutil.copytree(digits_run, root / "outputs" / "digits")
    return root


def run_for_real(tokens, cwd):
    """A script in this process as `python scripts/NAME` would run it; another program as a process."""
    if tokens[0] in PYTHONS:
        assert tokens[1].startswith("scripts/"), tokens
        return script(Path(tokens[1]).name, *tokens[2:])
    result = subprocess.run(tokens, cwd=cwd, capture_output=True, text=True, timeout=60)
    result.output = result.stdout + result.stderr
    return result


@pytest.mark.parametrize("command", REAL, ids=[command.split(" && ")[-1][:70] for command in REAL])
def test_documented_commands_run_on_tiny_data(command, workdir, monkeypatch):
    assert documented(command), f"{command!r} is no longer in the docs: update REAL"
    monkeypatch.chdir(workdir)
    results = [run_for_real(tokens, workdir) for tokens in split_commands(command)]
    for result in results:
        assert result.returncode == 0, result.output
    output = results[-1].output
    if "evaluate.py" in command:
        assert "450 images, accuracy" in output and (workdir / "outputs/digits/evaluation/report.html").is_file()
    elif "predict.py" in command:
        rows = (workdir / "predictions.csv").read_text().splitlines()
        assert rows[0].startswith("file,class_1,probability_1") and len(rows) == 1 + len(list(
            (workdir / "my_images").iterdir()))
    elif "export.py" in command:
        assert (workdir / "deploy/digits.onnx").is_file()
        assert json.loads((workdir / "deploy/digits.json").read_text())["class_names"] == [str(n) for n in range(10)]
    elif command.startswith("ls"):
        assert {"metrics.jsonl", "report.html", "best", "model.safetensors", "meta.json"} <= set(output.split())
    elif command.startswith("tail"):
        assert json.loads(output)["epoch"] == 4
    elif "split_dataset.py" in command:
        split = workdir / "data/my-photos-split"
        assert len(list(split.glob("train/*/*.png"))) + len(list(split.glob("val/*/*.png"))) == 85
    elif "compute_mean_std.py" in command:
        statistics = json.loads((workdir / "mean_std.json").read_text())
        assert len(statistics["mean"]) == len(statistics["std"]) == 3


# ---- the python blocks ----

def python_blocks():
    for path in PAGES:
        text = path.read_text()
        for language, first, code in fenced_blocks(path):
            if language == "python":
                title = [line for line in text.split("\n")[:first - 2] if line.strip()][-1]  # the line above
                yield pytest.param(path, first, code, title, id=f"{relative(path)}:{first}")


@pytest.mark.parametrize("path, line, code, title", list(python_blocks()))
def test_every_python_block_is_checked(path, line, code, title, tmp_path, monkeypatch):
    if "notebook_launcher" in code:
        import accelerate

        launched = []
        monkeypatch.setattr(accelerate, "notebook_launcher", lambda *args, **kwargs: launched.append((args, kwargs)))
        monkeypatch.chdir(REPO)
        monkeypatch.setattr(sys, "path", list(sys.path))
        exec(compile(code, f"{path}:{line}", "exec"), {})
        (function, (args,)), kwargs = launched[0]
        assert function.__name__ == "main" and args.data_dir == "data" and kwargs["num_processes"] >= 1
    elif "for epoch in run.epochs" in code:
        check_the_epoch_loop(code)
    elif "local-dir:outputs/seedlings/best" in code:
        run_the_timm_block(code, tmp_path, monkeypatch)
    elif title.endswith(("`resnet18_cifar`:", "`mnist_convnet`:")):
        from test_model_folder import docs_snippet

        assert docs_snippet(title.split()[-1]) == code  # tests/test_model_folder.py runs it without our code
    else:
        pytest.fail(f"{relative(path)}:{line}: a python block this test does not check: add a rule")


def check_the_epoch_loop(code):
    """The loop of recipes.md is scripts/train_cifar.py's, line for line and in order (the script's calls may take
    more arguments: the EMA's), and calls only methods TrainingRun has."""
    from common.run import TrainingRun

    ours = [line.strip() for line in (REPO / "scripts/train_cifar.py").read_text().split("\n")]
    position = 0
    for line in filter(None, (line.strip() for line in code.split("\n"))):
        stem = line.split("  #")[0]
        for index in range(position, len(ours)):
            if ours[index] == line or ours[index].split("  #")[0] == stem or (
                    stem.endswith(")") and ours[index].startswith(stem[:-1] + ", ")):
                position = index + 1
                break
        else:
            pytest.fail(f"the documented epoch loop's line {line!r} is not in scripts/train_cifar.py (in that order)")
    for method in set(re.findall(r"\brun\.(\w+)\(", code)):
        assert callable(getattr(TrainingRun, method, None)), f"TrainingRun has no method {method}"


def run_the_timm_block(code, tmp_path, monkeypatch):
    """The block as written, on a timm best/ written as a run writes it (timm's test_resnet, 3 classes)."""
    from safetensors.torch import save_file

    from common.models import build_model, describe_model, timm_config

    best = tmp_path / "outputs" / "seedlings" / "best"
    best.mkdir(parents=True)
    classes = ["Black-grass", "Charlock", "Maize"]
    meta = describe_model("test_resnet", classes, image_size=(32, 32), dataset="folder", arguments={},
                          normalize=([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))
    model = build_model("test_resnet", **meta["model_kwargs"])
    save_file(model.state_dict(), best / "model.safetensors")
    (best / "meta.json").write_text(json.dumps(meta))
    (best / "config.json").write_text(json.dumps(timm_config(model, meta)))
    shutil.copy(next((FIXTURES / "seedlings").rglob("*.png")), tmp_path / "photo.png")
    monkeypatch.chdir(tmp_path)
    printed = []
    exec(compile(code, "timm block", "exec"), {"print": lambda *values: printed.append(values)})
    label, probability = printed[0]
    assert label in classes and 0 < probability <= 1


# ---- the pages ----

def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    return {github_slug(heading) for heading in re.findall(r"^#{1,6} (.+)$", strip_fences(path.read_text()), re.M)}


def test_the_readme_is_a_front_page_that_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.split("\n")) - 1 <= README_MAX_LINES
    links = set(re.findall(r"\]\(([^)#\s]+)", readme))
    for page in [*sorted((REPO / "docs").glob("*.md")), REPO / "BENCHMARKS.md"]:
        assert relative(page) in links, f"README.md does not link {relative(page)}"


def test_every_relative_link_names_a_file_and_a_heading_that_exist():
    checked = 0
    for path in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", strip_fences(path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{relative(path)} links {target}: no such file"
            if anchor:
                assert anchor in anchors(linked), f"{relative(path)} links {target}: no such heading there"
            checked += 1
    assert checked >= 50, checked


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda page: page.name)
def test_each_docs_page_opens_with_its_commands(page):
    lines = [line for line in page.read_text().split("\n") if line.strip()]
    assert lines[0].startswith("# ") and lines[1] == "```", f"{page.name}: a title, then a block of commands"
    assert any(True for _ in block_commands(page))
