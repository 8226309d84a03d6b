"""Building the Accelerator so that the same launch works on N GPUs, several nodes, or a CPU-only laptop."""

import functools
import os
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import accelerate.data_loader
import torch
from accelerate import Accelerator
from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs,
                               ProjectConfiguration)

from .errors import UserError, parent_command


# harmless, and printed by every process: strides that differ along a size-1 dimension (the 1-channel MNIST conv),
# and --compile under DDP, whose buffer broadcast Dynamo cannot trace and runs uncompiled
warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
warnings.filterwarnings("ignore", message="Dynamo does not know how to trace the builtin `torch._C._distributed_c10d")
# recent torch deprecates DDP's broadcast_buffers for forward_sync_buffers, which older versions lack (BatchNormMerge
# needs the buffers left alone)
warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
# Accelerate's prepare_data_loader imports Hugging Face `datasets` (1.5-2 s on every process of a launch) only to ask
# whether a dataset is a datasets.IterableDataset, which none can be before `datasets` was imported
accelerate.data_loader.is_datasets_available = lambda: "datasets" in sys.modules


STARTED = {}  # time.time() when each part of the start-up ended: "imports" (build_accelerator), "data" (the model's
#               build began: common.models.build_model), "ready" (the run's start: model and optimizer on the device)


def build_accelerator(*, mixed_precision=None, compile=False, grad_accum=1, report_to=None, dist_timeout=None,
                      cpu=False):
    """An Accelerator that gives real data parallelism on CPU too, and refuses a launch it cannot honour:
    accelerate_configs/cpu.yaml launches through torchrun (MULTI_GPU), and without CUDA a plain `Accelerator()` would
    then run each process alone, training its own copy; `cpu=True` joins them with gloo instead. `compile`:
    inductor (else the config's dynamo setting); checkpoints still hold the plain model. `report_to`: (--report_to,
    the run folder). `dist_timeout` (seconds): a hung or lost process fails the others after that long."""
    STARTED.update(imports=time.time())  # the start-up's first part ends here (common.run says it); per run
    tracker, output_dir = report_to or ("none", None)
    if not cpu:
        check_gpus_usable()
    cpu = cpu or not torch.cuda.is_available()
    mixed_precision, precision_note = choose_mixed_precision(mixed_precision, cpu=cpu)
    join_after_restart(cpu=cpu, dist_timeout=dist_timeout)
    accelerator = Accelerator(
        cpu=cpu, mixed_precision=mixed_precision, dynamo_backend="inductor" if compile else None,
        # no broadcast of rank 0's buffers before each forward: BatchNormMerge merges the running statistics instead
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)]
        + ([InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout))] if dist_timeout else []),
        gradient_accumulation_steps=grad_accum,
        log_with=None if tracker == "none" else tracker,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=Path(output_dir) / "logs")
        if output_dir else None,
        # non_blocking: batches (pinned by our loaders) go to the GPU without a host-device sync
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),
    )
    check_process_count(accelerator)
    watch_for_restarts()
    if accelerator.num_processes > 1 and sys.version_info < (3, 12):
        pause_before_forks()
    if precision_note:
        accelerator.print(precision_note)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("mixed precision fp16 needs a GPU: on the CPU Accelerate trains in fp32 without saying so. "
                        "Pass --mixed_precision no (or bf16, which recent CPUs run), or use a config without fp16.")
    if compile and accelerator.device.type == "cpu":
        check_cpp_compiler()
    return accelerator


@functools.cache  # once a process
def pause_before_forks():
    """Before this process forks (a DataLoader's workers): 5 ms without the GIL, in which the process group's threads
    finish releasing the last collective's Python objects. Each of them creates a Python thread state to do so, under
    the interpreter's runtime lock, and CPython before 3.12 (gh-112275) deletes the child's other thread states before
    it resets that lock: a fork at that moment leaves the child waiting for it forever. A validation loader's workers,
    forked right after the epoch's last gather, hung so about once in 35 launches; a loop of DDP step, gather and
    fork (2 processes) in 7 of 20,000 forks without the pause, in none of 40,000 with it."""
    os.register_at_fork(before=lambda: time.sleep(0.005))


def prepare_to_evaluate(accelerator, model):
    """`accelerator.prepare_model(model, evaluation_mode=True)` placed on the device as Accelerate places ours, without
    its look for DTensor parameters (FSDP2's, which these models never have): that look imports
    torch.distributed.tensor, 0.4 s of evaluate.py's and predict.py's 1.8 s."""
    return accelerator.prepare_model(model, device_placement=accelerator.device_placement, evaluation_mode=True)


def check_gpus_usable():
    """GPUs named by CUDA_VISIBLE_DEVICES (a Slurm job given GPUs, a config's gpu_ids) that torch cannot use: the run
    would train on the CPU, tens of times slower, saying so in its first line only. A torch without CUDA on a GPU node
    (the CPU wheel, pip's default on some platforms) or a driver torch's CUDA cannot use are the usual causes."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not named or named.startswith("-1") or named.lower() in ("none", "nodevfiles") or torch.cuda.is_available():
        return
    why = ("this torch is built without CUDA (torch.version.cuda is None): install a CUDA build of torch" if
           torch.version.cuda is None else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU it can "
           "use: check that nvidia-smi lists them and that the driver is recent enough for that CUDA")
    raise UserError(f"CUDA_VISIBLE_DEVICES={named} names GPUs, but {why}. To train on the CPU instead, unset "
                    "CUDA_VISIBLE_DEVICES (and launch with accelerate_configs/cpu.yaml for several processes).")


def is_compiled(model):
    """Whether `model` (prepared) is torch.compile's wrapper (--compile), which holds the model as `_orig_mod`; told
    without Accelerate's is_compiled_module, which imports torch._dynamo (2 s) in a process that may never need it."""
    return getattr(model, "_orig_mod", None) is not None


def check_cpp_compiler():
    """torch.compile's Inductor builds C++ kernels on the CPU: without a working compiler (a slim container) it
    failed at the first step, in a traceback of 30 frames."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        raise UserError("--compile on the CPU needs a C++ compiler, which torch.compile builds its kernels with, and "
                        f"none works here ({os.environ.get('CXX', 'g++')}): install one (apt-get install g++), or "
                        "drop --compile") from None


def choose_mixed_precision(given, *, cpu):
    """(the run's mixed precision, a line to say about it or None): `given`, else the accelerate config's, else bf16
    where the device computes it natively. A config's bf16 becomes fp32 on a CPU without bf16 instructions, where it
    runs slower; only the flag forces it, and is told what that costs."""
    if given:
        slow = given == "bf16" and cpu and not cpu_computes_bf16()
        return given, ("note: --mixed_precision bf16 on a CPU whose PyTorch has no bf16 instructions to use (AVX-512 "
                       "BF16 or AMX): autocast converts every operation there, many times slower than fp32 "
                       "(--mixed_precision no)" if slow else None)
    config = os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() or None  # a config's BF16 is bf16 to Accelerate
    if config not in (None, "no", "fp16", "bf16", "fp8"):  # set by hand (a launcher checks its own)
        raise UserError(f"ACCELERATE_MIXED_PRECISION={os.environ['ACCELERATE_MIXED_PRECISION']} is not a mixed "
                        "precision Accelerate knows (no, fp16, bf16, fp8): unset it, or pass --mixed_precision no, "
                        "bf16 or fp16")
    native = cpu_computes_bf16() if cpu else torch.cuda.is_bf16_supported()
    if config is None:
        return "bf16" if native else "no", None
    if config == "bf16" and cpu and not native:
        why = ("this CPU has no bf16 instructions (AVX-512 BF16 or AMX)" if not cpu_has_bf16_instructions() else
               "PyTorch is kept from this CPU's bf16 instructions (ATEN_CPU_CAPABILITY="
               f"{os.environ.get('ATEN_CPU_CAPABILITY', '')})")
        return "no", (f"the accelerate config asks for bf16, but {why}, where bf16 runs slower than fp32: running in "
                      "fp32 (--mixed_precision bf16 forces it)")
    return config, None


def cpu_computes_bf16():
    """Whether this CPU has bf16 instructions and PyTorch's kernels may use them, without which bf16 autocast
    converts. ATEN_CPU_CAPABILITY=avx2 (with oneDNN's ONEDNN_MAX_CPU_ISA=AVX2) keeps PyTorch to AVX2 as on a CPU
    without them: then fp32, as there (docs/tests.md measures the suite that way)."""
    return cpu_has_bf16_instructions() and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def cpu_has_bf16_instructions():
    """AVX-512 BF16 or AMX."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def launcher_store(timeout):
    """The launcher's own store, served by its agent (TORCHELASTIC_USE_AGENT_STORE), as a client."""
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=timeout)


def join_after_restart(*, cpu, dist_timeout=None):
    """After a restart by torchrun (--max_restarts), join the process group under keys of this restart: the
    launcher's store still holds the first attempt's keys, so the new processes would read the dead ones' addresses
    ("connectFullMesh failed ... Connection refused"). Accelerate then uses the group made here."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = timedelta(seconds=dist_timeout or 600)
    if not cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = launcher_store(timeout)
    store.set(f"restarted_{restart}", os.environ["RANK"])  # before joining: a process still in the last attempt
    # waits in a collective for the dead one and would never join (watch_for_restarts)
    torch.distributed.init_process_group("gloo" if cpu else "nccl", store=torch.distributed.PrefixStore(
        f"restart_{restart}", store), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout)


def watch_for_restarts():
    """On several machines with restarts left (--max_restarts): a thread that ends this process, for its launcher to
    start it again, within a second of a process of the run being restarted on another machine (join_after_restart
    says so in the launcher's store), which waits for this one to join. Without it this process notices nothing
    until its next collective, and gloo once let that one wait for the dead peer until --dist_timeout (the BatchNorm
    merge's all-reduce right after a step, its peer SIGKILLed: docs/launching.md)."""
    restart, restarts = (int(os.environ.get(name, 0)) for name in ("TORCHELASTIC_RESTART_COUNT",
                                                                   "TORCHELASTIC_MAX_RESTARTS"))
    machines = int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not (machines and restart < restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None

    def watch():
        try:
            store = launcher_store(timedelta(seconds=30))
            while not store.check([f"restarted_{restart + 1}"]):
                time.sleep(1)
        except Exception:  # the store is gone: the launcher on the main machine has ended, and the run with it
            return
        print(f"process {os.environ['RANK']}: a process of this run was restarted on another machine; this one stops "
              "so that its launcher starts it again and both continue from the last checkpoint", file=sys.stderr,
              flush=True)
        os._exit(1)  # at once, from inside any collective the main thread waits in

    thread = threading.Thread(target=watch, name="watch_for_restarts", daemon=True)
    thread.start()
    return thread


def check_process_count(accelerator):
    """Stop when the launcher started a different number of processes than Accelerate joined together."""
    if "WORLD_SIZE" in os.environ:
        launched = int(os.environ["WORLD_SIZE"])
        if accelerator.num_processes != launched:
            raise UserError(f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate "
                            f"joined {accelerator.num_processes} ({accelerator.distributed_type}); each process would "
                            "train its own copy of the model. Build the Accelerator with "
                            "common.distributed.build_accelerator, or launch with --config_file "
                            "accelerate_configs/cpu.yaml on a machine without GPUs.")
    elif "ACCELERATE_USE_CPU" in os.environ and "MASTER_PORT" in os.environ and accelerator.num_processes == 1:
        # Accelerate's one-process launcher, asked for N > 1 processes, starts ONE and only sets MASTER_PORT: with
        # --cpu, or without a config on a machine with fewer than 2 GPUs
        how = ("For N CPU processes use `accelerate launch --config_file accelerate_configs/cpu.yaml` (set "
               "num_processes there or pass --num_processes); for one process drop --num_processes.")
        if os.environ["ACCELERATE_USE_CPU"].lower() == "true":
            raise UserError(f"`accelerate launch --cpu --num_processes N` starts a single process whatever N is. {how}")
        config = launch_config()
        if config:
            kind = (read_yaml(config) or {}).get("distributed_type")
            raise UserError(f"`accelerate launch` started a single process where more were asked: its config {config} "
                            f"(distributed_type: {kind}) makes Accelerate start one on a single machine, whatever "
                            "num_processes is (MULTI_CPU needs mpirun for more). For N processes on CPUs use "
                            "--config_file accelerate_configs/cpu.yaml (distributed_type MULTI_GPU: torchrun starts "
                            "them, joined with gloo), or set num_processes: 1 there for one.")
        raise UserError("`accelerate launch --num_processes N` without a --config_file started a single process: "
                        "Accelerate's defaults start one where fewer than 2 GPUs are visible, whatever N is. "
                        f"{how} On GPUs, use a config of accelerate_configs/ (e.g. 4gpu.yaml).")


def launch_config():
    """The config file of the `accelerate launch` that started this process (its parent): its --config_file, else
    Accelerate's default one (`accelerate config`'s) where there is one; None where neither (or not Linux)."""
    command = parent_command()
    if command is None:
        return None
    launched_from = Path(f"/proc/{os.getppid()}/cwd")  # a relative --config_file, as the launcher read it
    for i, part in enumerate(command):
        if part == "--config_file" and i + 1 < len(command):
            return launched_from.resolve() / command[i + 1]
        if part.startswith("--config_file="):
            return launched_from.resolve() / part.split("=", 1)[1]
    from accelerate.commands.config import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def read_yaml(path):
    """A YAML file's content, or None where it cannot be read."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None


class BatchNormMerge:
    """BatchNorm's running statistics after an optimizer step as if one process had trained all of the step's
    micro-batches in order (MicroBatches gives process p the p-th run of A of them), on every process.

    A running statistic r moves as r <- (1 - m) r + m x per micro-batch: after its A micro-batches process p holds
    (1 - m)^A r + d_p, and all P x A in order give (1 - m)^(PA) r + sum_p (1 - m)^((P-1-p)A) d_p, one all-reduce.
    Layers with momentum None (a cumulative average) and SyncBatchNorm's (statistics over the processes) are left
    as they are. One process: nothing to do."""

    def __init__(self, model, accelerator):
        self.accelerator, self.start = accelerator, None
        layers = [module for module in accelerator.unwrap_model(model, keep_torch_compile=False).modules()
                  if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
                  and not isinstance(module, torch.nn.SyncBatchNorm)] if accelerator.num_processes > 1 else []
        self.layers = [layer for layer in layers if layer.momentum is not None]
        if len(self.layers) < len(layers):
            accelerator.print(f"note: {len(layers) - len(self.layers)} BatchNorm layer(s) with momentum None keep each "
                              "process's running statistics: the run depends on its process count")

    def keep_start(self):
        """Before the first micro-batch of a step."""
        if self.layers:
            self.start = [torch.cat([layer.running_mean, layer.running_var]) for layer in self.layers]

    @torch.no_grad()
    def merge(self):
        """After the step (every process calls it)."""
        if not self.layers:
            return
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        accumulation = self.accelerator.gradient_accumulation_steps
        moved = [(torch.cat([layer.running_mean, layer.running_var]) - (1 - layer.momentum) ** accumulation * start)
                 * (1 - layer.momentum) ** ((processes - 1 - rank) * accumulation)
                 for layer, start in zip(self.layers, self.start)]
        total = self.accelerator.reduce(torch.cat(moved), reduction="sum")
        for layer, start, part in zip(self.layers, self.start, total.split([len(m) for m in moved])):
            merged = (1 - layer.momentum) ** (processes * accumulation) * start + part
            layer.running_mean.copy_(merged[:len(merged) // 2])
            layer.running_var.copy_(merged[len(merged) // 2:])
            layer.num_batches_tracked.add_((processes - 1) * accumulation)
