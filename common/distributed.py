"""Building the Accelerator so that the same launch works on N GPUs, several nodes, or a CPU-only laptop."""

import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration

from .errors import UserError


# DDP warns when a parameter's gradient strides differ only along a size-1 dimension (the 1-channel
# MNIST conv): harmless, and printed by every process.
warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
# --compile with several processes: Dynamo cannot trace DDP's buffer broadcast and says so on every process;
# that part simply runs uncompiled
warnings.filterwarnings("ignore", message="Dynamo does not know how to trace the builtin `torch._C._distributed_c10d")


def build_accelerator(*, mixed_precision=None, compile=False, grad_accum=1, report_to=None, dist_timeout=None,
                      cpu=False):
    """An Accelerator that gives real data parallelism on CPU too, and refuses a launch it cannot honour.

    `accelerate launch --config_file accelerate_configs/cpu.yaml` starts its processes through torchrun
    (the config says MULTI_GPU, which is the only launcher that spawns N local processes). On a machine
    without CUDA a plain `Accelerator()` then sees LOCAL_RANK but no GPU and falls back to a single,
    non-distributed process, so every process would train its own copy. Passing `cpu=True` there makes
    Accelerate join the processes with gloo (MULTI_CPU) instead.

    `compile=True` has `accelerator.prepare` torch.compile the model (inductor); `save_state` and
    `unwrap_model(model, keep_torch_compile=False)` still see the plain model, so checkpoints and best/
    load without it. Left False, the accelerate config's dynamo setting applies.

    `report_to`: (--report_to, the run folder): the trackers write into its logs/, one of the run's outputs that
    --overwrite sets aside. `dist_timeout` (seconds) bounds every collective: when a process hangs or its node is
    lost, the others fail after that long instead of waiting forever (torch's default is 10 to 30 minutes).
    """
    tracker, output_dir = report_to or ("none", None)
    cpu = cpu or not torch.cuda.is_available()
    mixed_precision, why_fp32 = choose_mixed_precision(mixed_precision, cpu=cpu)
    join_after_restart(cpu=cpu, dist_timeout=dist_timeout)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision,
        dynamo_backend="inductor" if compile else None,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout))] if dist_timeout else None,
        gradient_accumulation_steps=grad_accum,
        log_with=None if tracker == "none" else tracker,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=Path(output_dir) / "logs")
        if output_dir else None,
        # seedable sampler: the shuffle order depends only on (seed, epoch), the same on every rank and on resume
        # non_blocking: batches (pinned by our loaders) go to the GPU without a host-device sync
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=torch.cuda.is_available()),
    )
    check_process_count(accelerator)
    if why_fp32:
        accelerator.print(why_fp32)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("mixed precision fp16 needs a GPU: on the CPU Accelerate trains in fp32 without saying so. "
                        "Pass --mixed_precision no (or bf16, which recent CPUs run), or use a config without fp16.")
    return accelerator


def choose_mixed_precision(given, *, cpu):
    """(the run's mixed precision, why it is fp32 where the config asked for bf16, or None).

    `given` (--mixed_precision) if given, else the accelerate config's (`accelerate launch` passes it on), else
    bf16 where the device computes it natively (a GPU since Ampere, a CPU with bf16 instructions) and fp32
    elsewhere: `python script.py` and a 1-process launch then compute alike. On a CPU without bf16
    instructions bf16 autocast runs slower than fp32, so a config's bf16 (accelerate_configs/cpu.yaml) becomes
    fp32 there; only the flag forces it."""
    if given:
        return given, None
    config = os.environ.get("ACCELERATE_MIXED_PRECISION")
    native = cpu_computes_bf16() if cpu else torch.cuda.is_bf16_supported()
    if config is None:
        return "bf16" if native else "no", None
    if config == "bf16" and cpu and not native:
        return "no", ("the accelerate config asks for bf16, which this CPU has no instructions for (AVX-512 BF16 or "
                      "AMX) and would run slower than fp32: running in fp32 (--mixed_precision bf16 forces it)")
    return config, None


def cpu_computes_bf16():
    """Whether this CPU has bf16 instructions (AVX-512 BF16, or AMX on Intel Xeons since Sapphire Rapids), on
    which PyTorch's bf16 autocast runs convolutions and matrix products natively; elsewhere it converts."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def join_after_restart(*, cpu, dist_timeout=None):
    """After a restart by torchrun (`accelerate launch --max_restarts N`), join the process group under keys of
    this restart. Its static rendezvous hands the restarted processes the launcher's store as the first attempt
    left it, and the process group's keys have no attempt in their names: the new processes read the dead
    ones' addresses and fail to connect (gloo: "connectFullMesh failed ... Connection refused"; NCCL: the old
    unique id). Accelerate then uses the group made here. Nothing is done on a first start."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = timedelta(seconds=dist_timeout or 600)
    if not cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timeout)  # the launcher's own store, served by its agent
    torch.distributed.init_process_group("gloo" if cpu else "nccl", store=torch.distributed.PrefixStore(
        f"restart_{restart}", store), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout)


def check_process_count(accelerator):
    """Stop when the launcher started a different number of processes than Accelerate joined together."""
    if "WORLD_SIZE" in os.environ:
        launched = int(os.environ["WORLD_SIZE"])
        if accelerator.num_processes != launched:
            raise UserError(
                f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate joined "
                f"{accelerator.num_processes} ({accelerator.distributed_type}); each process would train its own "
                "copy of the model. Build the Accelerator with common.distributed.build_accelerator, or launch "
                "with --config_file accelerate_configs/cpu.yaml on a machine without GPUs."
            )
    elif os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_PORT" in os.environ:
        # `accelerate launch --cpu --num_processes N` (N > 1) starts ONE process and only sets MASTER_PORT
        raise UserError(
            "`accelerate launch --cpu --num_processes N` starts a single process whatever N is. For N CPU "
            "processes use `accelerate launch --config_file accelerate_configs/cpu.yaml` (set num_processes there "
            "or pass --num_processes); for one process drop --num_processes."
        )
