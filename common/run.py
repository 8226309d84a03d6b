"""The bookkeeping of one training run, so that the training step can stay in the script (STYLE.md 5-6).

    run = TrainingRun(accelerator, output_dir, model_info=model_info, total_steps=total_steps)
    run.start(checkpoint, model=model, lr_scheduler=lr_scheduler)   # resume, or set an --overwrite's old run aside
    for epoch in run.epochs(args.epochs):
        model.train()
        for batch in run.batches(train_dataloader):
            ...forward, loss, accelerator.backward, clip, optimizer step...
            if accelerator.sync_gradients:  # an optimizer step
                lr_scheduler.step()
                run.merge_batchnorm()  # BatchNorm's running statistics as one process would have them
            run.record(loss, batch)
            if run.checkpoint_due():  # --checkpoint_every, or a SIGTERM; a nan/inf loss stops the run here
                run.save_checkpoint()  # after a SIGTERM the run stops here, saved
        evaluation = evaluate(model, eval_dataloader, accelerator, transform=...)
        run.log_epoch(evaluation)
        run.save_best(model, evaluation)
        run.save_checkpoint()
    train_scores = evaluate(model, train_scoring_dataloader, ...)  # unaugmented: for the suspected wrong labels
    run.finish(evaluation, eval_set=eval_set, train_scores=train_scores, train_set=train_set)  # reports, report.html

TrainingRun counts and writes; it owns no model, optimizer or loss. Nothing waits for the device at every step:
the host looks (nan watch, SIGTERM, progress bar) in one small gather every CHECK_EVERY steps or LOOK_SECONDS.
"""

import functools
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import send_to_device, set_seed
from safetensors.torch import load_file
from tqdm.auto import tqdm

from .checkpoint import ORDER, load_checkpoint, save_checkpoint
from .data import mix_seed
from .distributed import STARTED, BatchNormMerge, is_compiled
from .errors import STOP_HINTS, TERMINATED, Interrupted, Terminated, UserError, launcher_pid
from .mistakes import find_label_issues, write_mistakes_report
from .models import save_best_model
from .outputs import WriteFailed, finish_writes, latest_checkpoint, set_aside_earlier_run, unlock_output_dirs
from .reporting import log_epoch, tta_warning, write_reports

# tqdm's monitor thread exits as evaluation forks its DataLoader workers, which can deadlock the child (a
# seedlings run hung there); the monitor only tunes how often a slow bar redraws.
tqdm.monitor_interval = 0
CHECK_EVERY = 20  # optimizer steps between two looks at the device at most ...
LOOK_SECONDS = 2.0  # ... and fewer when steps are slow: a SIGTERM is obeyed within about this much training
NO_STEP = 2**62  # "no step had a nan/inf loss"


class NonFiniteLoss(UserError):
    """The loss became nan or inf; nothing was saved after that step."""


_signals_received = []


def catch_sigterm():
    """SIGTERM (Slurm, Kubernetes; torchrun passes it on, then SIGKILLs 30 s later) now only sets a flag; one that
    came before and was swallowed where it landed (common.errors.TERMINATED) ends the run here, before its first
    step."""
    if TERMINATED:
        raise Terminated
    signal.signal(signal.SIGTERM, lambda signum, frame: _signals_received.append(signum))  # SIGHUP too (on_hangup)


def names_the_last_checkpoint(method):
    """A TrainingRun method whose write fails (a full disk) says where the run can continue from."""

    @functools.wraps(method)
    def write(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except WriteFailed as error:
            latest = latest_checkpoint(self.output_dir / "checkpoints")
            if getattr(self, "_reporting", False):  # finish(): training is over, and saved
                error.fix = (f"Training is finished and saved (best/, the last checkpoint {latest}); only its final "
                             f"reports are missing: {error.remedy}, then python scripts/evaluate.py --model_dir "
                             f"{self.output_dir} writes best/'s (a --resume of a finished run has nothing to do).")
                raise
            error.fix = (f"The last complete checkpoint is {latest}: {error.remedy}, then run the same command "
                         "with --resume latest (or auto) to continue from it." if latest else "The run has no "
                         f"checkpoint yet: {error.remedy}, then run the same command with --resume auto (or "
                         "--overwrite) to start it again.")
            raise

    return write


def count_steps(train_dataloader, *, epochs, max_steps):
    """The run's optimizer steps: the same on any process count (MicroBatches); refused when an epoch has none."""
    sampler = train_dataloader.batch_sampler
    if sampler.steps_per_epoch == 0:
        images, batch_size, per_step = sampler.num_samples, sampler.batch_size, sampler.per_step
        processes = per_step // sampler.accumulation
        if images >= per_step:
            fix = f"Lower --batch_size (to {images // per_step} at most)" + (
                ", --grad_accum, or launch fewer processes" if processes > 1 else " or --grad_accum")
        elif images >= processes:
            fix = (f"Even at --batch_size 1 they make too few: lower --grad_accum (to {images // processes} at most)"
                   + (" or launch fewer processes" if processes > 1 else ""))
        else:
            fix = f"Give it at least {processes} training images, or launch fewer processes"
        raise UserError(f"{images} training images make {images // batch_size} full batch(es) of --batch_size "
                        f"{batch_size}, fewer than the {per_step} of one optimizer step "
                        f"({processes} process(es) x {sampler.accumulation} accumulation step(s)): nothing would be "
                        f"trained. {fix}.")
    return min(epochs * sampler.steps_per_epoch, max_steps or math.inf)


@functools.cache
def launch_clock():
    """(when, in time.time(), and what): the launcher's start for a process that accelerate launch or torchrun
    started (common.errors.launcher_pid), else this process's."""
    import psutil  # Accelerate's dependency

    pid = launcher_pid()
    try:
        launcher = psutil.Process(pid) if pid else None
    except psutil.Error:  # gone already
        launcher = None
    return started_at(launcher or psutil.Process()), "launch" if launcher else "process started"


def started_at(process):
    """When the psutil `process` started, in time.time(). On Linux from its start in clock ticks since boot and the
    boot clock: psutil's create_time adds those ticks to the boot time in whole seconds (/proc/stat's btime), which
    put every start up to a second early (the start-up line said up to 1 s too much)."""
    try:
        ticks = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return process.create_time()


def since_launch():
    """'N s after the launch' (or 'after the process started': launch_clock)."""
    start, what = launch_clock()
    return f"{time.time() - start:.1f} s after the {what}"


def startup_parts():
    """'(start and imports A s, data B s, model and device C s, the first batch D s)': the start-up until now, split
    where build_accelerator was called, where the model's build began and where the run started
    (common.distributed.STARTED)."""
    if not {"imports", "ready"} <= STARTED.keys():  # a script of the user's own that skips one of them
        return "(imports, data, model, the first batch)"
    start, imports, ready = launch_clock()[0], STARTED["imports"], STARTED["ready"]
    data = STARTED.get("data", 0)
    middle = (f"data {data - imports:.1f} s, model and device {ready - data:.1f} s" if imports <= data <= ready
              else f"data and model {ready - imports:.1f} s")  # a model of the user's own
    return f"(start and imports {imports - start:.1f} s, {middle}, the first batch {time.time() - ready:.1f} s)"


def checkpoint_name(epoch, batch=None):
    """epoch_002_batch_000120 inside epoch 2, epoch_002_end after it: the names sort in training order."""
    return f"epoch_{epoch:03d}_end" if batch is None else f"epoch_{epoch:03d}_batch_{batch:06d}"


class TrainingRun:
    """Where a run stands (epoch, batch, step, the epoch's totals) and what it writes: checkpoints, metrics.jsonl,
    best/ and the final report. `model_info` (common.models.describe_model) goes into each checkpoint and best/."""

    def __init__(self, accelerator, output_dir, *, model_info, total_steps, checkpoint_every=None, keep_checkpoints=2):
        self.accelerator, self.output_dir = accelerator, Path(output_dir)
        self.model_info, self.total_steps = model_info, total_steps
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self.epoch, self.batch, self.step, self.best_accuracy, self.best_epoch = 1, 0, 0, -1.0, 0
        self.num_epochs = self.lr_scheduler = None
        self.in_epoch = False  # inside run.batches()'s loop
        self._resumed_totals = None  # a mid-epoch checkpoint's totals of the epoch so far
        self._resumed_stream = self._sampler = None  # a streamed split's positions (common.streaming); its sampler
        self._resumed_from = None  # (path, training images) of the checkpoint resumed from
        self._totals = self._nonfinite = self._started = self._pace = self._loss = self._batchnorm = None
        self._stepped = False  # whether the batch last recorded made an optimizer step
        self._next_look = self._last_look = None  # the step of the next look; (step, time) of the last
        self._said_first_step = False  # the start-up's cost, said once the first optimizer step is done
        self._trained_at = None  # time.perf_counter() when the last epoch ended: the wind-down's start
        self._compiled = self._whole = False  # --compile: the model is torch.compile's; the epoch was trained whole
        self._whole_epochs = []  # --compile: (epoch, seconds) of the first two epochs this launch trained whole

    @property
    def finished(self):
        return self.step >= self.total_steps

    # ---- start ----

    @names_the_last_checkpoint
    def start(self, checkpoint, *, model, lr_scheduler):
        """Continue from `checkpoint` (find_checkpoint's), or set an earlier run aside: all inputs are read by now."""
        accelerator = self.accelerator
        self.lr_scheduler = lr_scheduler
        self._compiled = is_compiled(model)
        if checkpoint is None:
            set_aside_earlier_run(self.output_dir, accelerator)
        else:
            load_checkpoint(accelerator, checkpoint, model=model, lr_scheduler=lr_scheduler, model_info=self.model_info,
                            output_dir=self.output_dir)
            self.epoch, self.batch, self.step = checkpoint["epoch"], checkpoint["batch"], checkpoint["step"]
            self.best_accuracy, self._resumed_totals = checkpoint["best_accuracy"], checkpoint.get("epoch_totals")
            self.best_epoch = checkpoint.get("best_epoch", 0)
            self._resumed_stream = checkpoint.get("stream") if self.batch else None
            self._resumed_from = (checkpoint["path"], checkpoint.get("train_images"))
            accelerator.print(f"resumed from {checkpoint['path']}: epoch {self.epoch}, batch {self.batch}, "
                              f"step {self.step} of {self.total_steps}")
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if restart:  # accelerate launch --max_restarts: a process ended and the launcher started them all again
            accelerator.print(f"restart {restart} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} "
                              "(--max_restarts) after a process ended: "
                              + (f"the steps after step {self.step} are trained again" if checkpoint else
                                 "no checkpoint had been saved, so the run starts over"))
        self._batchnorm = BatchNormMerge(model, accelerator)
        catch_sigterm()
        STARTED.update(ready=time.time())

    # ---- the epoch loop ----

    def epochs(self, epochs, *, patience=None):
        """The epochs left to train; ends at `total_steps`, or after `patience` epochs without a better accuracy."""
        self.num_epochs = epochs
        while self.epoch <= epochs and not self.finished:
            yield self.epoch
            self.epoch, self.batch = self.epoch + 1, 0
            if patience and self.epoch - 1 - self.best_epoch >= patience and self.epoch <= epochs and not self.finished:
                self.accelerator.print(f"early stop after epoch {self.epoch - 1}: val accuracy has not improved for "
                                       f"{patience} epoch(s) (--patience); best/ holds epoch {self.best_epoch} "
                                       f"({self.best_accuracy:.2%}), the reports below are of the last epoch")
                break
        self._trained_at = time.perf_counter()

    def batches(self, train_dataloader):
        """This process's micro-batches of the epoch on the device, from where a resumed epoch stopped; stops at
        `total_steps`. Before each, the random generators are seeded from (seed, epoch, micro-batch), so that
        augmentation, Mixup and dropout draw the same on any process count. Its end looks for a nan/inf loss, before
        the epoch's evaluation, best/ and checkpoint."""
        sampler, accelerator = train_dataloader.batch_sampler, self.accelerator
        self._sampler = sampler
        self._check_same_images()
        if self._resumed_stream:  # a stream goes on where each process's share stopped
            sampler.load_state_dict(self._resumed_stream)
            self._resumed_stream = None
        sampler.set_epoch(self.epoch, start=self.batch)  # self.batch: global micro-batches trained in the epoch
        self._whole = self.batch == 0
        if hasattr(train_dataloader.dataset, "set_epoch"):  # a dataset that augments in its workers, seeded by epoch
            train_dataloader.dataset.set_epoch(self.epoch)
        self._start_totals()
        self.in_epoch = True
        progress_bar = tqdm(train_dataloader, desc=f"epoch {self.epoch}", leave=False, dynamic_ncols=True,
                            mininterval=2, disable=not accelerator.is_main_process)
        for position, batch in enumerate(progress_bar):
            set_seed(mix_seed(sampler.seed, self.epoch, sampler.micro_batch(position)))
            if position % sampler.accumulation == 0:
                self._batchnorm.keep_start()
            yield send_to_device(batch, accelerator.device, non_blocking=accelerator.non_blocking)
            if self._last_look[0] == self.step and self._stepped:  # checkpoint_due() just looked
                progress_bar.set_postfix(loss=f"{self._last_loss:.3f}", img_s=f"{self._images_per_s():,.0f}",
                                         lr=f"{self.lr_scheduler.get_last_lr()[0]:.2e}")
            if self.finished:
                break
        progress_bar.close()
        self._pace = {"time": time.perf_counter() - self._started, "images_per_s": self._images_per_s()}
        self._compare_notes()
        self.in_epoch = False

    def record(self, loss, batch):
        """Add a trained batch to the epoch's totals (after the step); waits for nothing."""
        totals, labels = self._totals, batch["label"]
        totals["loss_sum"] += loss.detach() * len(labels)
        totals["samples"] += len(labels)
        totals["indices"].append(batch["index"])
        # the first step whose loss is nan/inf, kept on the device: the host sees it at the next look
        self._nonfinite = torch.minimum(self._nonfinite, torch.where(loss.detach().isfinite(), NO_STEP, self.step + 1))
        self._loss, self._stepped = loss, self.accelerator.sync_gradients
        self.batch += self.accelerator.num_processes  # global micro-batches, whole at each optimizer step
        self.step += self._stepped

    def merge_batchnorm(self):
        """After each optimizer step: BatchNorm's running statistics as if one process had trained the whole step
        (BatchNormMerge), the same on every process and on any process count. Between accumulation steps: nothing."""
        if self.accelerator.sync_gradients:
            self._batchnorm.merge()

    def checkpoint_due(self):
        """Every process asks, after `record`: every `checkpoint_every` steps, or after a SIGTERM on any process.
        When it looks at the device (`_compare_notes`), a nan/inf loss raises NonFiniteLoss."""
        if not self._stepped:
            return False
        due = bool(self.checkpoint_every) and self.step % self.checkpoint_every == 0
        if self.step < self._next_look and not due:
            return False
        self._last_loss = self._loss.item()  # the host waits for the device here, and in _compare_notes
        return due or self._compare_notes()  # save_checkpoint compares notes too

    # ---- the end of an epoch ----

    @names_the_last_checkpoint
    def log_epoch(self, evaluation, ema_evaluation=None):
        """The epoch's line in metrics.jsonl, the trackers and the console (every process calls it)."""
        totals = self._global_totals()
        samples = sum(totals["samples_per_process"])
        record = {"epoch": self.epoch, "step": self.step, "train_loss": totals["loss_sum"] / max(1, samples),
                  "train_samples": samples, "train_unique_samples": len(totals["indices"]),
                  "train_samples_per_process": totals["samples_per_process"],
                  "images_per_s": self._pace["images_per_s"], "train_time_s": self._pace["time"],
                  **{f"val_{name}": evaluation[name] for name in ("loss", "accuracy", "macro_f1", "samples", "tta")},
                  "lr": self.lr_scheduler.get_last_lr()[0], "epoch_time_s": time.perf_counter() - self._started,
                  "since_launch_s": time.time() - launch_clock()[0]}  # the gaps between epochs: their saves
        if evaluation["tta"] != "none":  # what each step of the TTA bought, from the same passes
            record["val_accuracy_by_tta"] = evaluation["accuracy_by_tta"]
        if ema_evaluation:
            record.update({f"ema_val_{name}": ema_evaluation[name] for name in ("loss", "accuracy", "macro_f1")})
        log_epoch(self.accelerator, self.output_dir, record, epochs=self.num_epochs)
        if self._compiled and self._whole and len(self._whole_epochs) < 2:
            self._whole_epochs.append((self.epoch, record["epoch_time_s"]))
            if len(self._whole_epochs) == 2:  # what --compile cost: the first epoch holds the compiles
                (first, slow), (second, fast) = self._whole_epochs
                self.accelerator.print(f"--compile: epoch {first} took {slow:.1f} s, epoch {second} {fast:.1f} s: "
                                       f"about {slow - fast:.1f} s of compiling the model for training and "
                                       "evaluation (or of loading it from the compile cache), which an eager run "
                                       "does not spend")
        return record

    @names_the_last_checkpoint
    def save_best(self, model, evaluation, *, weights="model"):
        """Replace best/ on the best validation accuracy so far; for an EMA too (`weights="ema"`: meta.json says so)."""
        if evaluation["accuracy"] > self.best_accuracy:
            self.best_accuracy, self.best_epoch = evaluation["accuracy"], self.epoch
            save_best_model(self.accelerator, model, self.output_dir, evaluation=evaluation,
                            meta={**self.model_info, "epoch": self.epoch, "weights": weights,
                                  "metric": "val_accuracy", "value": evaluation["accuracy"], "tta": evaluation["tta"],
                                  # each step's accuracy, as metrics.jsonl has it: without a TTA, `value` alone
                                  **({"value_by_tta": evaluation["accuracy_by_tta"]} if evaluation["tta"] != "none"
                                     else {})},
                            later=True)

    @names_the_last_checkpoint
    def save_checkpoint(self):
        """Checkpoint where the run stands (every process calls it); after a SIGTERM, stop the run there."""
        stop = self._compare_notes()  # nothing diverged is saved; every process decides to stop at the same point
        if self.in_epoch:
            name = checkpoint_name(self.epoch, self.batch)
            state = {"epoch_totals": self._global_totals(), "epoch": self.epoch, "batch": self.batch}  # global
            if hasattr(self._sampler, "state_dict"):  # a stream's positions, one per process
                state["stream"] = self._sampler.state_dict()
        else:  # resumed at the next epoch's start
            name, state = checkpoint_name(self.epoch), {"epoch": self.epoch + 1, "batch": 0}
        state.update(step=self.step, best_accuracy=self.best_accuracy, best_epoch=self.best_epoch,
                     lr_scheduler=self.lr_scheduler.state_dict(), num_processes=self.accelerator.num_processes,
                     threads_per_process=torch.get_num_threads(), order=ORDER,
                     train_images=getattr(self._sampler, "num_samples", None), **self.model_info)
        path = save_checkpoint(self.accelerator, self.output_dir, name, state=state, keep=self.keep_checkpoints,
                               later=not stop)  # published while the next epoch trains
        if stop:
            cause = _signals_received[0]
            self.accelerator.print(f"stopped by {signal.Signals(cause).name} at epoch {self.epoch}, step {self.step}: "
                                   f"saved {path}. Run the same command with --resume latest to continue."
                                   + STOP_HINTS.get(cause, ""),
                                   file=sys.stderr if cause == signal.SIGPIPE else sys.stdout)  # stdout: the pipe
            raise Interrupted(path)

    def load_best(self, model):
        """The prepared `model` with best/'s weights, on every process (to score a test set)."""
        finish_writes()
        self.accelerator.wait_for_everyone()
        weights = load_file(self.output_dir / "best" / "model.safetensors")  # load_state_dict copies to the device
        self.accelerator.unwrap_model(model, keep_torch_compile=False).load_state_dict(weights)
        return model

    @names_the_last_checkpoint
    def finish(self, evaluation, *, eval_set, train_scores=None, train_set=None):
        """The final reports from the last evaluation (of `eval_set`), with the mistakes report: report.html, and
        the suspected wrong labels of `train_set` from `train_scores` (`evaluate` on it unaugmented); then close
        the trackers. Its last line says where the time since the last epoch went: the scoring after training (the
        suspected-label pass, a --val_fraction run's test set), the last checkpoint's writes still under way (they
        run on a thread: common.outputs.finish_later), the reports."""
        accelerator, class_names = self.accelerator, self.model_info["class_names"]
        writes_at = time.perf_counter()
        trained_at = self._trained_at or writes_at  # a script of the user's own may not train through epochs()
        finish_writes()  # the last checkpoint and best/ on the disk
        self._reporting, reports_at = True, time.perf_counter()
        report = write_reports(accelerator, self.output_dir, evaluation=evaluation, class_names=class_names)
        if accelerator.is_main_process:
            accelerator.print(f"classification report of the model after epoch {self.epoch - 1} "
                              f"({evaluation['samples']} images; best/ holds epoch {self.best_epoch}, "
                              f"{self.best_accuracy:.2%}):\n{report}")
            if warning := tta_warning(evaluation):  # e.g. mirrored digits: other digits
                accelerator.print(warning)
            label_issues = None if train_scores is None else find_label_issues(
                train_scores, class_names=class_names, files=train_set.files, split="training", trained_on=True)
        accelerator.wait_for_everyone()  # the plots drawn: report.html embeds them
        if accelerator.is_main_process:
            about = {"title": f"{self.output_dir}: the model after epoch {self.epoch - 1}",
                     "arguments": self.model_info["args"]}
            page = write_mistakes_report(self.output_dir, evaluation=evaluation, dataset=eval_set, about=about,
                                         label_issues=label_issues, training_set=train_set)
            suspects = label_issues and [f"{label_issues['flagged']} suspected wrong labels among the "
                                         f"{label_issues['scored']} training images", label_issues.get("caveat")]
            accelerator.print(f"outputs written to {self.output_dir}; the mistakes: open {page} in a browser"
                              + (f" ({'; '.join(filter(None, suspects))})" if suspects else ""))
            done = time.perf_counter()  # what the wind-down cost, as the first step's line says the start-up's
            accelerator.print(f"run done {since_launch()}, {done - trained_at:.1f} s after the last epoch (scoring "
                              f"after training {writes_at - trained_at:.1f} s, the last checkpoint's writes "
                              f"{reports_at - writes_at:.1f} s, the reports {done - reports_at:.1f} s)")
        accelerator.wait_for_everyone()
        accelerator.end_training()
        unlock_output_dirs()  # the run is written: another may take the folder

    # ---- inside ----

    def _check_same_images(self):
        """A run resumed on another number of training images (the data folder changed since) would not go on as
        the run that was stopped: its order of samples and LR schedule were drawn for the number it had."""
        path, then = self._resumed_from or (None, None)
        now = getattr(self._sampler, "num_samples", None)  # a stream has no count
        if then is not None and now is not None and now != then:
            raise UserError(f"the training set has {now} images, but the run of checkpoint {path} trained on {then}: "
                            "its order of samples and LR schedule were drawn for those, so it cannot go on as that "
                            "run. Resume it with the data it had, or start a new run in another --output_dir.")
        self._resumed_from = None  # checked once

    def _compare_notes(self):
        """The one collective of the bookkeeping: NonFiniteLoss if any process saw a nan/inf loss; True on every
        process once any got SIGTERM, so that all stop at the same step."""
        device, now = self.accelerator.device, time.perf_counter()
        step_ms = 1000 * (now - self._last_look[1]) / max(1, self.step - self._last_look[0])
        mine = torch.tensor([-len(_signals_received), -int(step_ms)], device=device)
        seen = self.accelerator.gather(torch.cat([self._nonfinite[None], mine])[None]).min(0).values.tolist()
        nonfinite, signals, slowest_step_ms = seen[0], seen[1], -seen[2]
        if not self._said_first_step and self.accelerator.is_main_process:
            tqdm.write(f"first optimizer step done {since_launch()} {startup_parts()}")
        self._said_first_step = True
        # the next look: the same on every process, since all see the same numbers
        self._next_look = self.step + max(1, min(CHECK_EVERY, int(1000 * LOOK_SECONDS / max(1, slowest_step_ms))))
        self._last_look = (self.step, now)
        if nonfinite != NO_STEP:
            peak, clip = self.lr_scheduler.base_lrs[0], self.model_info["args"].get("max_grad_norm")
            group = self.lr_scheduler.optimizer.param_groups[0]
            raise NonFiniteLoss(f"the loss became nan or inf at optimizer step {nonfinite} (epoch {self.epoch}); "
                                "training stopped there and saved nothing after it, so the checkpoints and best/ hold "
                                f"only states from before. The run diverged (peak LR {peak:g}, "
                                f"weight decay {group.get('weight_decay', 0):g}, "
                                f"{f'gradients clipped to norm {clip:g}' if clip else 'gradients not clipped'}): start "
                                "again with a lower --lr or --weight_decay, --max_grad_norm 1.0, or bf16 instead of "
                                "fp16 (a resumed run keeps its arguments, and would diverge the same way).")
        if signals and not _signals_received:
            _signals_received.append(signal.SIGTERM)  # another process got it: this one stops too
        return signals < 0

    def _start_totals(self):
        """A resumed epoch starts from the checkpoint's global totals: each process takes its own sample count, and
        the main process the loss sum and indices, so that the final reduction counts them once."""
        device = self.accelerator.device
        self._totals = {"loss_sum": torch.zeros((), device=device), "samples": 0, "indices": []}
        self._nonfinite = torch.full((), NO_STEP, device=device)
        saved, self._resumed_totals = self._resumed_totals, None
        if saved:  # written by another process count: the main process takes all of the samples
            counts, main = saved["samples_per_process"], self.accelerator.is_main_process
            self._totals["samples"] = (counts[self.accelerator.process_index]
                                       if len(counts) == self.accelerator.num_processes else sum(counts) * main)
            if main:
                self._totals["loss_sum"] += saved["loss_sum"]
                self._totals["indices"].append(torch.tensor(saved["indices"], dtype=torch.long, device=device))
        self._started, self._resumed_samples, self._last_loss = time.perf_counter(), self._totals["samples"], 0.0
        self._next_look, self._last_look = self.step + 1, (self.step, self._started)  # the first step measures

    def _images_per_s(self):
        """All processes, from this epoch's start (a resumed epoch's earlier part is not in it)."""
        elapsed = time.perf_counter() - self._started
        return (self._totals["samples"] - self._resumed_samples) * self.accelerator.num_processes / elapsed

    def _global_totals(self):
        """The epoch's totals over all processes (a collective), as JSON-friendly numbers."""
        accelerator, totals = self.accelerator, self._totals
        indices = (torch.cat(totals["indices"]) if totals["indices"]
                   else torch.zeros(0, dtype=torch.long, device=accelerator.device))
        seen = accelerator.gather(accelerator.pad_across_processes(indices, pad_index=-1))
        samples = torch.tensor([totals["samples"]], device=accelerator.device)
        return {"loss_sum": accelerator.reduce(totals["loss_sum"].clone(), reduction="sum").item(),
                "samples_per_process": accelerator.gather(samples).tolist(),
                "indices": seen[seen >= 0].unique().tolist()}  # sorted; the last batches' padding repeats a few
