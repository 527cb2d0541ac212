"""The LightningModule of one arm: manual optimisation, so every step's metrics are taken exactly where we want
them (gradient norms before the step, update ratios after it) and nothing is clipped unless the recipe asks."""
from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import torch

from ..slots import bitwise
from ..errors import OutputError
from ..model import PARAM_GROUPS, build_model
from ..model.transformer import uses_cudagraphs
from ..slots.outputs import TENSOR_HOOKS, Flags
from .norms import UpdateRatio, group_norms
from .optim import build_optimizer, lr_lambda
from .stepgraph import SharedPool, StepGraph
from .width import param_groups


class ArmModule(pl.LightningModule):
    def __init__(self, recipe, optimizer: str, kernels, vocab_size: int, sink, step_graph=None):
        """`step_graph`: a train/stepgraph.StepGraph to run each step's forward, backward and gradient norms
        through (train/arm.step_graph_for says which arms get one), or None."""
        super().__init__()
        self.automatic_optimization = False
        self.recipe, self.opt_name, self.sink = recipe, optimizer, sink
        self.step_graph = step_graph
        # Its evaluations likewise (same arms, same reasons): replayed from the second on (evaluation). The two
        # graphs share one memory pool and hand back what their eager calls left before they capture: at 4096 x
        # 65,536 under AdamW an arm reserved 32.8 GiB for an allocated peak of 18.5 without that (one H100,
        # 2026-11-27, benchmarks/arm_memory.py; docs/production-shapes.md).
        self.eval_graph = None
        if step_graph is not None:
            if step_graph.before_capture is None:
                step_graph.before_capture = self.release_for_capture
            step_graph.pool = step_graph.pool or SharedPool()
            self.eval_graph = StepGraph(warmup=1, pure=True, unit="evaluation", before_capture=_release_cache,
                                        pool=step_graph.pool)
        self._eval_inputs = None
        self.model = build_model(recipe.model, vocab_size, kernels, recipe.seed)
        # An arm with a whole-step graph compiles its body as plain inductor: inside that graph cudagraph trees
        # cannot run (no nested capture). An arm without one (the candidate's: its call cannot be captured) replays
        # its body under cudagraph trees: the same kernels, the same numbers bit for bit (tests/test_stepgraph.py),
        # but one launch each for the forward and the backward instead of about 250 (the h200 recipe's candidate
        # arm stepped in 21.7 ms with its device busy 8.6: host-bound, one H100, 2026-11-27, `bench.py --profile`).
        # It costs the candidate arms a second compiled variant of the body (about 10 s, on a fresh H200,
        # 2026-11-26), which inductor's cache then keeps for the next candidate arm.
        self.cudagraphs = uses_cudagraphs(recipe.train.compile) and step_graph is None
        if recipe.train.compile:
            self.model.compile_body(recipe.train.compile, cudagraphs=self.cudagraphs)
        self.step_no = 0
        groups = [PARAM_GROUPS.index(self.model.param_group(n)) for n, _ in self.model.named_parameters()]
        self.register_buffer("group_of", torch.tensor(groups), persistent=False)  # moves to the device with the module
        self.update_ratio = None  # train/norms.UpdateRatio, from the first step (on the device)
        self.params = None  # the parameters in order, listed once (at the first step, on the device)
        runs_candidate = any(i.role == "candidate" for i in kernels.impls.values())
        self.untouched = Untouched(kernels) if runs_candidate else None

    def configure_optimizers(self):
        cfg = self.recipe.optimizers[self.opt_name]
        opt = build_optimizer(self.opt_name, param_groups(self.model, cfg.lr, self.recipe.model), cfg,
                              compile=self.recipe.train.compile)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, self.recipe.train.steps))
        return [opt], [sched]

    def training_step(self, batch, _):
        x, y = batch
        step = self.step_no
        if self.untouched is not None and self.untouched.base is None:  # before the first evaluation calls any slot
            self.untouched.start(self, self.optimizers().optimizer)
        self.sink.before_step(self, step)
        opt = self.optimizers()
        sched = self.lr_schedulers()
        if self.update_ratio is None:  # at the first step, on the device
            self.params = list(self.model.parameters())
            self.update_ratio = UpdateRatio(self.params, self.group_of, len(PARAM_GROUPS))
        if self.step_graph is not None:
            loss, gnorm = self.step_graph(self._forward_backward, x, y)  # fresh copies of the graph's outputs
        else:
            loss, gnorm = self._forward_backward(x, y)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        ratio = self.update_ratio()
        # A copy under cudagraph trees: the loss lives in the graph's memory, rewritten by the next replay, and the
        # recorder holds it until its next flush (a step graph's outputs are copies already).
        self.sink.after_step(self, step, loss.detach().clone() if self.cudagraphs else loss.detach(), gnorm, ratio,
                             lr)
        self.step_no += 1
        if self.trainer.progress_bar_callback is not None:
            # Only for a visible progress bar: Lightning turns progress-bar values into Python floats every step,
            # a device sync that stalls a GPU arm's queue.
            self.log("loss", loss.detach(), prog_bar=True, on_step=True, logger=False)

    def _forward_backward(self, x, y):
        """Gradients of this step's loss in every parameter's `.grad`; returns (loss, per-group gradient norms).
        Under a step graph this is what is captured: device work only, no host syncs."""
        params = self.params
        self.optimizers().zero_grad(set_to_none=True)  # before a capture: the graph's backward then owns the grads
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: last step's graph outputs may be reused
        loss = self.model(x, y)
        self.manual_backward(loss)
        if self.untouched is not None:  # before clipping: it rescales .grad, legitimately
            self.untouched.after_backward(self, self.step_no)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        gnorm = group_norms(grads, self.group_of, len(PARAM_GROUPS))
        if self.recipe.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.recipe.train.grad_clip)
        return loss, gnorm

    def release_for_capture(self):
        """Before the step graph's last warm-up (on a side stream) and its capture: the last eager step's gradients
        (the optimizer has stepped on them) and every block the allocator keeps cached. The side stream reuses no
        block cached for the arm's own stream, and the capture allocates the step's activations and gradients again
        in the graph's pool: without this each left a step's worth reserved beside the next for the whole arm."""
        self.optimizers().zero_grad(set_to_none=True)
        _release_cache()

    def on_train_end(self):
        # The last evaluation and snapshot, while the model is still on the device: after `fit`, Lightning's
        # teardown moves it to the CPU, where the h200 recipe's final evaluation took 10 s (H200, 2026-11-21).
        # Under the training precision, as every other evaluation (which run inside training_step): outside it, the
        # last one ran in fp32 under bf16-mixed (seen as fp32 GEMMs in a profile).
        if self.untouched is not None:
            self.untouched.finish()
        with self.trainer.precision_plugin.forward_context():
            self.sink.finish(self)

    def evaluation(self, batches, eval_x) -> tuple:
        """(mean validation loss, log-probabilities of `eval_x`), both left on the device. Under a step graph they
        replay as one CUDA graph after the first, eager, evaluation (captured right after it): eager, an evaluation
        is 5 forward passes of about 150 launches each, about 60 ms of the host on the h200 recipe (one H200,
        2026-11-26), twice inside `make bench`'s steady window. The graph replays the eager kernels, so the numbers
        are those of the candidate's arm, which evaluates eagerly."""
        if self.eval_graph is None:
            return self.evaluate(batches), self.eval_logprobs(eval_x)
        if self._eval_inputs is None:  # on the device once: a captured evaluation reads them where they are
            self._eval_inputs = (batches, eval_x, [(x.to(self.device), y.to(self.device)) for x, y in batches],
                                 eval_x.to(self.device))
        assert batches is self._eval_inputs[0] and eval_x is self._eval_inputs[1], "the graph holds the first inputs"
        batches, eval_x = self._eval_inputs[2:]
        return self.eval_graph(lambda: (self.evaluate(batches), self.eval_logprobs(eval_x)))

    # Evaluations run eagerly under `train.compile`: no-grad passes and the one-sequence log-prob batch would each
    # compile their own graphs, for 5 forward passes every `val_every` steps.
    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")
    def evaluate(self, batches) -> torch.Tensor:
        """Mean validation loss, a float64 scalar left on the device (the recorder reads it at its next flush).
        The head and the loss run eval_rows sequences at a time (model.loss_in_pieces), in every arm alike."""
        with self._eval_mode():
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for x, y in batches:
                rows = eval_rows(x.shape[1], self.model.vocab_size)
                total += self.model(x.to(self.device), y.to(self.device), loss_rows=rows).double()
        return total / max(1, len(batches))

    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")
    def eval_logprobs(self, x) -> torch.Tensor:
        with self._eval_mode():
            logits = self.model(x.to(self.device))
        return torch.log_softmax(logits.float(), -1)

    @contextlib.contextmanager
    def _eval_mode(self):
        # Restored however the pass ends: a failed capture of an evaluation is survived (train/stepgraph.py), and
        # training must go on in training mode.
        was = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was)


class Untouched:
    """In an arm that runs candidate code, what the optimizer reads is what the slots returned. After every backward
    (before the optimizer step): no hook added to or changed on any parameter, module or the optimizer, nor among
    torch's global module and optimizer hooks, no parameter or module swapped, no module method overridden on the
    instance; and where a candidate fills `fused_embed_rmsnorm`, the `.grad` of the embedding and of its norm weight
    equal, bit for bit, the gradients the slot handed autograd (model/ops.py). The second catches what no hook
    dictionary shows, e.g. a hook on the parameter's AccumulateGrad node that rewrites `.grad` after the lockstep
    check measured the slot's outputs. Either ends the arm with an OutputError naming what changed.

    Where every candidate runs in a kernel server (sandbox/), no code of theirs runs in this process to add a hook:
    the hooks are then compared at the first step and at the end, not after every backward (where walking every
    module's and parameter's hooks took 5.9 ms of a 42.7 ms profiled step at the h200 recipe, one H100,
    2026-11-27, `bench.py --profile`); the gradients still after every backward."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.every_step = any(getattr(i.fn, "sandbox", None) is None for i in kernels.impls.values()
                              if i.role == "candidate")
        self.grads = kernels.impls["fused_embed_rmsnorm"].role == "candidate"
        if self.grads:
            # Held until compared: AccumulateGrad then copies them into `.grad` (it steals only a gradient nobody
            # else holds), so a later write into `.grad` cannot also rewrite what it is compared with.
            kernels.handed = {}
        self.base, self.optimizer = None, None
        self.flags = Flags()  # device flags of the gradient comparison: read without a sync per step

    def start(self, module, optimizer):
        """At the first step, before any call of the candidate in training: the state every later step must keep."""
        self.module, self.optimizer, self.step = module, optimizer, None
        self.base = hook_state(module, optimizer)

    def _compare_hooks(self, when: str):
        now = hook_state(self.module, self.optimizer)
        if now != self.base:
            what = [k for k in self.base.keys() | now.keys() if self.base.get(k) != now.get(k)]
            raise OutputError(f"the candidate changed hooks or objects of the training run {when}: "
                              f"{', '.join(sorted(what)[:5])}{' ...' if len(what) > 5 else ''} (what the optimizer "
                              "reads is then not what the slots returned)")

    def after_backward(self, module, step: int):
        if self.every_step or step == 0:
            self._compare_hooks(f"at step {step}")
        self.step = step
        if self.grads:
            handed = self.kernels.handed.pop("fused_embed_rmsnorm", None)
            if handed is not None:
                model = module.model
                pairs = [("embed", model.embed, handed[0]), ("embed_norm", model.embed_norm, handed[1])]
                if model.head.weight is model.embed:  # tied: the head adds its own gradient to the embedding's
                    pairs = pairs[1:]
                for name, p, g in pairs:
                    bad = torch.ones((), dtype=torch.bool) if p.grad is None else bitwise.changed(p.grad, g)
                    self.flags.add(bad, (step, name))
        self._raise(self.flags.first())

    def finish(self):
        if self.base is not None and self.step is not None:
            self._compare_hooks(f"by step {self.step}")
        self._raise(self.flags.first(wait=True))

    def _raise(self, bad):
        if bad is not None:
            step, name = bad
            raise OutputError(f"fused_embed_rmsnorm: the .grad of {name} that the optimizer reads differs from "
                              f"the gradient the candidate returned (step {step}): something rewrote it after the "
                              "slot's call (a hook)")


def _hooks_of(label: str, obj) -> dict:
    """An object's identity and class, each of its hook dictionaries (by identity and content), and its instance
    attributes that shadow a method of its class (a method overridden on the instance)."""
    d = vars(obj)
    out = {label: (id(obj), type(obj)),
           f"{label}: methods set on the instance": tuple((k, id(v)) for k, v in d.items()
                                                          if callable(getattr(type(obj), k, None)))}
    out.update({f"{label}: {k}": _items(v) for k, v in d.items() if "hook" in k})
    return out


def _items(v):
    return (id(v), tuple(v.items())) if isinstance(v, dict) else v


def hook_state(module, optimizer) -> dict:
    """Everything through which code outside the slots' outputs could change what training does with them: each
    module's and parameter's hooks (and identity and class), the optimizer's, and torch's global ones."""
    import torch.nn.modules.module as nn_module
    import torch.optim.optimizer as optim_module

    out = {}
    for n, m in module.named_modules():
        out.update(_hooks_of(f"module {n or '(root)'}", m))
    for n, p in module.named_parameters():
        out[f"parameter {n}"] = (id(p), type(p))
        out.update({f"parameter {n}: {h}": _items(getattr(p, h)) for h in TENSOR_HOOKS})
    if optimizer is not None:
        out.update(_hooks_of("optimizer", optimizer))
    for mod in (nn_module, optim_module):
        out.update({f"{mod.__name__}.{k}": _items(v) for k, v in vars(mod).items()
                    if k.startswith("_global_") and "hook" in k})
    return out


# The most fp32 logits one piece of an evaluation holds (eval_rows). A captured evaluation keeps its peak in the
# graph's pool for the arm's whole life: at 4096 x 65,536 (32 sequences of 256 a batch) that pool held 7.0 GiB,
# beside the step graph's 5.65 (one H100, 2026-11-27, benchmarks/arm_memory.py).
EVAL_LOGITS_BYTES = 2**29


def eval_rows(seq_len: int, vocab: int) -> int:
    """Sequences an evaluation takes through the head and the loss at a time: as many as keep their fp32 logits
    within EVAL_LOGITS_BYTES (8 of 256 tokens at vocabulary 65,536; a whole batch at the CPU recipes'). Every arm
    evaluates alike, so no arm's loss differs from another's by the pieces (a GEMM of other rows may round
    otherwise)."""
    return max(1, EVAL_LOGITS_BYTES // (4 * seq_len * vocab))


def _release_cache():
    """Hands the CUDA allocator's unused cached blocks back to the driver (nothing where there is no GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
