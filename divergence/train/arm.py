"""One arm: a fresh model whose slots are filled from configuration, trained on the shared batch sequence.

Its folder holds `arm.json` (what ran and how it ended), `metrics.jsonl`, `snapshots/` and `evals/`.
"""
from __future__ import annotations

import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..errors import RecipeError, one_line
from ..candidates.resolve import build_kernels
from ..device import pick_device
from ..gpu import write_servers
from ..sandbox import isolation_of, remotes_of
from ..sandbox import client as kernel_client
from .metrics import write_json
from .recorder import ArmStopped, Recorder


EVAL_VALUES = 1 << 22  # log-probabilities kept per evaluation (positions x vocabulary)


@dataclass
class ArmSpec:
    name: str  # reference | candidate | null-1 | ... (the wandb job_type too)
    optimizer: str  # key of recipe.optimizers
    kernels: dict = field(default_factory=dict)  # slot -> implementation spec (reference where absent)
    # A slot to check in lockstep: its implementation (the candidate, in the candidate arm) against the reference op
    # and the float64 oracle on the inputs it is given, every `ab.lockstep_every` steps.
    lockstep: Optional[str] = None

    @property
    def runs_candidate(self) -> bool:
        """The candidate's arm (which carries the lockstep check): it runs candidate code, so it is never shared,
        keeps its crash on resume and never goes first (ab/share.py, ab/runner.py)."""
        return self.name == "candidate" or bool(self.lockstep)


def runs_no_candidate_code(spec: ArmSpec, kernels) -> bool:
    """No candidate code anywhere in the arm: not the candidate's arm, and every slot filled by a reference or a null
    (`kernels`: its Kernels). Such an arm may be shared and cached (ab/share.py) and have its step captured as one
    CUDA graph (step_graph_for)."""
    return not spec.runs_candidate and all(i.role != "candidate" for i in kernels.impls.values())


def step_graph_for(recipe, spec: ArmSpec, kernels, device: str):
    """A StepGraph for an arm that runs no candidate code, on CUDA, where the recipe asks for CUDA graphs
    (`train.compile: inductor+cudagraphs`) and leaves `train.step_graph` on; else None (train/stepgraph.py: why)."""
    from ..model.transformer import uses_cudagraphs
    from .stepgraph import StepGraph

    if device != "cuda" or not recipe.train.step_graph or not uses_cudagraphs(recipe.train.compile):
        return None
    return StepGraph() if runs_no_candidate_code(spec, kernels) else None


def resolve_device(recipe) -> str:
    """The recipe's `train.device` (auto | cpu | cuda, checked by recipe.py) -> cpu or cuda."""
    return pick_device(recipe.train.device,
                       RecipeError(f"{recipe.path}: train.device: cuda asked for, but no CUDA GPU is visible"))


def resolve_precision(recipe, device: str) -> str:
    p = recipe.train.precision
    if p == "auto":
        return "bf16-mixed" if device == "cuda" else "32-true"
    return {"fp32": "32-true", "bf16-mixed": "bf16-mixed"}[p]


def environment(device: str, gpu: bool = True) -> dict:
    """Where the arm runs; `gpu=False` leaves out the GPU's name, whose query starts CUDA in this process."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "host": platform.node(), "threads": torch.get_num_threads()}
    if device == "cuda" and gpu:
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")  # which GPU of the host ran the arm
    return env


def model_vocab(recipe, corpus) -> int:
    v = recipe.model.vocab_size or corpus.vocab_size
    if v < corpus.vocab_size:
        raise RecipeError(f"{recipe.path}: model.vocab_size: {v} is smaller than the tokenizer's vocabulary "
                          f"({corpus.vocab_size}); token ids would index past the embedding")
    return v


def run_arm(recipe, spec: ArmSpec, out_dir, corpus=None, progress: Optional[bool] = None,
            boot_s: Optional[float] = None, watcher=None, callbacks=(), hold=None) -> dict:
    """Train one arm to the end (or to the first NaN); returns and writes its `arm.json`.

    `watcher(recipe, slot, kernels, corpus, recorder)` builds the check an ArmSpec with `lockstep` asks for (the
    detectors' Lockstep, passed down by the orchestration layer: training never imports the detectors); its
    `summary()` goes into arm.json. `callbacks`: extra Lightning callbacks (the bench's profiler steps). `hold()`,
    where given, is called once everything is set up on the host and before this process's first touch of its GPU
    (the model still on the CPU; a candidate's kernel server, started with the kernels, holds a CUDA context of its
    own already): it returns when the scheduler lets the arm train (ab/runner.py: a pre-started arm)."""
    from .module import ArmModule  # imports lightning.pytorch first: it sets its loggers' levels on import
    from ..data import load_corpus

    t_enter = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(recipe.train.threads)
    device = resolve_device(recipe)
    corpus = corpus or load_corpus(recipe.data)
    vocab = model_vocab(recipe, corpus)
    # Each kernel server's pids as it starts: what the scheduler waits for after this arm before it lets an arm
    # have the GPU to itself (gpu.SERVERS_FILE)
    kernel_client.set_on_start(lambda: write_servers(out, kernel_client.server_pids()))
    kernels = build_kernels(spec.kernels, {"vocab_size": vocab, "head_dim": recipe.model.head_size},
                            recipe.model.slot_dtypes)
    remotes = remotes_of(kernels)
    for remote in remotes.values():
        # Its calls ordered by CUDA events, not host syncs (sandbox/client.py): at the h200 recipe the candidate
        # arm's step was host-bound, its device busy 8.65 of 22.69 ms (one H100, 2026-11-27)
        remote.server.overlap = True
        # and returning before the server answers, its reply read at the next call (sandbox/pipeline.py)
        remote.server.pipeline = kernel_client.PIPELINE
    batches, val_batches, eval_x = _arm_batches(recipe, corpus, vocab)
    info = {"arm": spec.name, "optimizer": spec.optimizer, "kernels": kernels.describe(), "recipe": recipe.name,
            "seed": recipe.seed, "steps": recipe.train.steps, "tokens_per_step": recipe.tokens_per_step,
            "vocab_size": vocab, "env": environment(device, gpu=hold is None), "status": "RUNNING"}
    # Where each candidate kernel runs, written before its first call: the judge checks the record for a training
    # identical to the reference's only where the candidate could have written this folder (detect/tripwire.py)
    iso = {slot: isolation_of(impl) for slot, impl in kernels.impls.items()
           if getattr(impl, "role", None) == "candidate"}
    if iso:
        info["isolation"] = iso
    write_json(out / "arm.json", info)
    rec = Recorder(out, recipe, val_batches, eval_x, flush_every=1 if device == "cpu" else 25, device=device)
    rec.watch_nonfinite(kernels)
    rec.before_final_wait = lambda: _settle(remotes)
    lockstep = _lockstep(recipe, spec, watcher, kernels, corpus, rec)
    step_graph = step_graph_for(recipe, spec, kernels, device)
    module = ArmModule(recipe, spec.optimizer, kernels, vocab, rec, step_graph)
    trainer = _trainer(recipe, device, progress, callbacks)
    rec.t["setup_s"] = time.perf_counter() - t_enter  # corpus (when not given), kernels, model, recorder
    if hold is not None:
        rec.t["held_s"] = hold()
        info["env"] = environment(device)  # the GPU's name now: asking for it earlier started CUDA while held
    t0 = time.time()
    if boot_s is not None:
        rec.t["boot_s"] = boot_s  # before run_arm: the arm process's start and imports
    rec.t["fit_called"] = time.perf_counter()
    _fit(trainer, module, rec, recipe, batches, device, info)
    info["wall_s"] = time.time() - t0
    _add_rates(info, recipe, module, rec, device)
    if lockstep is not None:
        info["lockstep"] = lockstep.summary()
    # (with whether its calls were pipelined, or why not: sandbox/pipeline.py)
    said = ("pipeline", "overlap_error", "pipeline_mispredicted")
    served = {slot: {**r.server.timing.summary(), **{k: v for k, v in r.server.platform.items() if k in said}}
              for slot, r in remotes.items()}
    if served:  # where a candidate's calls spent their time in and around its kernel server (sandbox/client.py)
        info["sandbox"] = served
    write_json(out / "arm.json", info)
    kernel_client.set_on_start(None)
    return info


def _arm_batches(recipe, corpus, vocab: int) -> tuple:
    """The training batches, the fixed validation batches and the sequences whose log-probabilities are kept."""
    from ..data import Batches

    batches = Batches(corpus.train, recipe.train.batch_size, recipe.model.seq_len, recipe.seed)
    val = Batches(corpus.val, recipe.train.batch_size, recipe.model.seq_len, recipe.seed)
    val_batches = [val.fixed(i) for i in range(recipe.train.val_batches)]
    # Fixed sequences for the log-probability KL between arms, saved in fp32 at every evaluation: up to 4, fewer
    # where 4 would pass 2^22 values per file (h200 recipe: 1 sequence, 16 MiB; 4 were 64 MiB x 11 evaluations
    # x 12 arms = 8.8 GB written and read back per A/B).
    eval_x = val.fixed(0)[0][:max(1, min(4, EVAL_VALUES // (recipe.model.seq_len * vocab)))]
    return batches, val_batches, eval_x


def _lockstep(recipe, spec: ArmSpec, watcher, kernels, corpus, rec):
    """The lockstep check the spec asks for (None where it asks for none)."""
    if not spec.lockstep:
        return None
    if watcher is None:
        raise RecipeError(f"arm {spec.name}: a lockstep check was asked for and no watcher was given")
    return watcher(recipe, spec.lockstep, kernels, corpus, rec)


def _trainer(recipe, device: str, progress: Optional[bool], callbacks=()):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision=resolve_precision(recipe, device),
        max_steps=recipe.train.steps, logger=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, enable_progress_bar=recipe.train.progress if progress is None else progress,
        use_distributed_sampler=False, callbacks=list(callbacks),
    )


def _settle(remotes: dict) -> None:
    """Each candidate's last pipelined call's reply read and checked (sandbox/client.RemoteFunction.settle)."""
    for remote in remotes.values():
        remote.settle()


def _fit(trainer, module, rec, recipe, batches, device: str, info: dict) -> None:
    """Train; `info["status"]` says how it ended: OK, the recorder's stop (NAN, ...) or CRASH."""
    try:
        trainer.fit(module, train_dataloaders=_loader(batches, recipe.train.steps, device == "cuda"))
        if not rec.finished:  # the recorder finishes in the module's on_train_end, at the last step
            raise RuntimeError(f"training stopped at step {module.step_no} of {recipe.train.steps}")
        info["status"] = "OK"
    except ArmStopped as e:
        rec.writer.close()
        info.update(status=e.status, stop_step=e.step, stop_where=e.where)
    except Exception as e:  # a candidate that raises: the arm ends, the run goes on
        stop = rec.close()
        crash = one_line(e, 500)
        if stop is not None:  # a NaN came first, seen only now (a GPU arm reads its metrics one flush late)
            info.update(status=stop.status, stop_step=stop.step, stop_where=stop.where, crash_after_stop=crash)
        else:
            info.update(status="CRASH", error=crash, traceback=traceback.format_exc()[-4000:])


def _add_rates(info: dict, recipe, module, rec, device: str) -> None:
    """Throughput, timings and (on CUDA) peak memory, after `info["wall_s"]` is set."""
    info["tokens_per_s"] = recipe.tokens_per_step * max(0, module.step_no) / max(1e-9, info["wall_s"])
    info["timings"] = rec.timings()
    if module.step_graph is not None:
        info["timings"].update(module.step_graph.describe())
        info["timings"].update(module.eval_graph.describe("eval_graph"))
    if device == "cuda":  # what one arm needs, to size `ab.workers` (arms per GPU) by
        info["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if "steady_ms_per_step" in info["timings"]:
        info["tokens_per_s_steady"] = recipe.tokens_per_step / (1e-3 * info["timings"]["steady_ms_per_step"])


class _StepBatches(torch.utils.data.IterableDataset):
    def __init__(self, batches, steps):
        self.batches, self.steps = batches, steps

    def __iter__(self):
        for step in range(self.steps):
            yield self.batches.get(step)


def _loader(batches, steps, pin: bool):
    # Pinned batches: the host-to-device copy is then truly asynchronous (from pageable memory it is not).
    return torch.utils.data.DataLoader(_StepBatches(batches, steps), batch_size=None, num_workers=0,
                                       pin_memory=pin)

