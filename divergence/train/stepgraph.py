"""One training step's forward, backward and gradient norms replayed as a single CUDA graph.

Why: on one H200 (2026-11-26, `make bench --profile`) the harness's SGD arm stepped in 7.79 ms with its device
busy 6.88 ms of it: the rest was the host, launching 76 kernels a step around the body's two CUDA graphs (the
eager embedding and its slot backward, the gradient norms, the optimizer) and keeping inductor's cudagraph trees'
books. Captured whole, the step's forward and backward cost one launch.

What is captured: whatever `fn` does (the module's zero_grad, forward, backward and per-group gradient norms).
What is not: the optimizer step and the learning-rate schedule (their step counts and learning rates are host
values, which a graph would freeze at capture), the update ratios, the recorder, evaluations and snapshots. The
optimizer therefore runs exactly as in an arm without the graph, which keeps every arm's update the same code.

Who: only arms that run no candidate code (train/arm.step_graph_for): a candidate inside a CUDA graph could sync,
allocate, or cache by tensor identity (replayed, such a kernel would silently repeat its captured work), so the
candidate's arm runs as written, around the same compiled body (train/module.py). The graph replays the very
kernels the arm would launch eagerly, so its numbers are the eager step's, bit for bit under deterministic
algorithms (tests/test_stepgraph.py, on a GPU).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..errors import one_line


class StepGraph:
    """`graph(fn, *inputs)`: `fn(*inputs)` eagerly for `warmup` calls (compilation, autotuning, lazy state), the
    last of them on the capture stream, then captured once and replayed on every later call with `inputs` copied
    into the captured ones. Returns fresh copies of `fn`'s tensor outputs (a replay rewrites the captured ones).

    `pure=True`, for a function whose only effects are its outputs (an evaluation): the last warm-up call is
    captured right after its eager run, so replays start one call sooner. Not for a training step: capturing
    rebinds the gradients the eager run left for the optimizer.

    If capture fails (an op that cannot be captured, e.g. one that syncs), the graph is given up with its reason
    in `off` and every later call runs `fn` eagerly: the step the capture was for is then run eagerly too, so no
    step is lost or done twice (while capturing, `fn`'s Python runs but none of its device work does)."""

    def __init__(self, warmup: int = 3, capture: Optional[Callable] = None, pure: bool = False, unit: str = "step",
                 before_capture: Optional[Callable[[], None]] = None, pool: Optional["SharedPool"] = None):
        """`before_capture`: called before the last warm-up call and again right before the capture, to hand back
        what the eager calls left behind (the module's gradients and the allocator's cache,
        train/module.ArmModule.release_for_capture). `pool`: graphs given the same SharedPool capture into one
        memory pool (see SharedPool)."""
        self.warmup, self.pure, self.unit = warmup, pure, unit  # unit: what one call is, for describe()
        self.before_capture = before_capture
        self.pool = pool
        self.calls = 0
        self.graph = None
        self.static_inputs = None
        self.static_outputs = None
        self.off: Optional[str] = None  # why the graph was given up, if it was
        self.captured_at: Optional[int] = None  # the call (0-based) that was captured
        self.capture_s: Optional[float] = None
        # (fn, inputs, stream, pool) -> (graph, outputs); injectable for tests
        self._capture = capture or _cuda_capture
        self._stream = None

    def __call__(self, fn: Callable, *inputs):
        call, self.calls = self.calls, self.calls + 1
        if self.off is not None:
            return fn(*inputs)
        if self.graph is not None:
            assert len(inputs) == len(self.static_inputs), "a replay takes the captured call's inputs"
            for dst, src in zip(self.static_inputs, inputs):
                assert dst.shape == src.shape, f"a replay's input is {tuple(src.shape)}, captured {tuple(dst.shape)}"
                dst.copy_(src, non_blocking=True)
            self.graph.replay()
            return _fresh(self.static_outputs)
        if call < self.warmup - 1:
            return fn(*inputs)
        if call == self.warmup - 1:
            self._release()  # the side stream reuses no block cached for the caller's stream
            out = self._on_side_stream(fn, inputs)
            if self.pure:
                self._try_capture(fn, inputs, call)  # the next call is its first replay
            return out
        if not self._try_capture(fn, inputs, call):
            return fn(*inputs)
        self.graph.replay()  # capturing ran nothing: this step is done by its first replay
        return _fresh(self.static_outputs)

    def _on_side_stream(self, fn, inputs):
        # The last warm-up on the stream capture will use: cuBLAS and cuDNN keep per-stream state (workspaces,
        # plans), which must not be first created while capturing.
        self._stream = self.pool.stream() if self.pool is not None else _side_stream()
        if self._stream is None:
            return fn(*inputs)
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = fn(*inputs)
        current.wait_stream(self._stream)
        return out

    def _try_capture(self, fn, inputs, call: int) -> bool:
        """Capture `fn` on copies of `inputs` (True), or give the graph up with the reason (False)."""
        t0 = time.perf_counter()
        self._release()
        static = tuple(x.clone() for x in inputs)
        try:
            graph, outputs = self._capture(fn, static, self._stream, self.pool.handle if self.pool else None)
        except Exception as e:  # give the graph up; this call and the rest run eagerly
            self.off = f"capture failed: {one_line(e)}"
            return False
        self.graph, self.static_inputs, self.static_outputs = graph, static, outputs
        self.captured_at, self.capture_s = call, time.perf_counter() - t0
        if self.pool is not None and self.pool.handle is None:
            self.pool.handle = graph.pool()
        return True

    def _release(self):
        if self.before_capture is not None:
            self.before_capture()

    def describe(self, key: str = "step_graph") -> dict:
        """For arm.json `timings`, under `key`: whether and where it was captured, or why not."""
        if self.off is not None:
            return {key: f"off ({self.off})"}
        if self.graph is None:
            return {key: f"not captured (the arm ended within its {self.warmup} warm-up {self.unit}s)"}
        return {key: f"captured at {self.unit} {self.captured_at}", f"{key}_capture_s": round(self.capture_s, 3)}


class SharedPool:
    """One memory pool for an arm's evaluation graph and its step graph, which never replay at once. Captured into
    one pool, the later capture (the step's, at step 3; the evaluation's is at step 0) takes blocks the earlier one
    freed, its outputs and the gradients its backward allocates among them, so a replay of either may overwrite
    what the other keeps. What makes that safe, and must stay so: every graph's outputs are copied out right after
    its replay (StepGraph returns fresh copies), and nothing reads the gradients but the optimizer, right after the
    step's replay has written them all (an evaluation replays before a step's forward, and its replay overwrites
    them): a reader of `.grad` in the recorder or at an evaluation would read the evaluation's activations.
    The graphs also warm up and capture on one stream: the allocator keeps a freed block for the stream it was
    used on, so two graphs of one pool captured on two streams still kept two sets of blocks. At 4096 x 65,536
    under AdamW (one H100, 2026-11-27, benchmarks/arm_memory.py) the evaluation's blocks were 7.0 GiB and the
    step's 5.65 GiB, each its own, with one pool and two streams as with two pools."""

    def __init__(self):
        self.handle = None  # torch.cuda.graph_pool_handle() of the first capture
        self._stream = None

    def stream(self):
        """The one side stream its graphs warm up and capture on (None without CUDA)."""
        if self._stream is None:
            self._stream = _side_stream()
        return self._stream


def _side_stream():
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def _cuda_capture(fn, inputs, stream, pool=None):
    graph = torch.cuda.CUDAGraph()
    stream = stream or torch.cuda.Stream()
    # A pool of our own naming where the caller gave none (what torch would make), so a failed capture's can be ended
    pool = pool or torch.cuda.graph_pool_handle()
    first_error = None
    # The outer stream context puts the caller's stream back however the capture ends: torch.cuda.graph's exit ends
    # the capture before it restores the stream, and when the capture failed that end raises too, which left the
    # rest of the arm on the capture stream (seen on one H200, 2026-11-26, with a function that synced).
    with torch.cuda.stream(stream):
        try:
            # thread_local: another thread's CUDA calls (a data loader's, a watchdog's) must not void this capture.
            # Autocast's cache off while capturing (as torch.cuda.graph's notes ask): a weight's cast cached during
            # capture would live in the graph's memory, never computed, for any eager op after it in the same
            # autocast region. The same cast kernels run either way; only their reuse within the region is lost.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                try:
                    with _autocast_uncached():
                        outputs = fn(*inputs)
                except Exception as e:
                    first_error = e
                    raise
        except Exception as e:  # the body's own error, not the "previous error during capture" that ending reports
            _end_pool_capture(pool, stream)
            _end_generator_capture(stream)
            raise (first_error or e) from None
    return graph, outputs


def _end_pool_capture(pool, stream):
    """Tells torch's caching allocator that a failed capture into `pool` is over. When a capture's end fails, torch
    never takes it off the allocator's list of captures underway, and the next `torch.cuda.empty_cache()`, or the
    destruction of any memory pool (a kernel server's staging pool, at the process's exit), then aborts the
    process on an internal assert, "captures_underway.empty()", with no Python error (seen on one H200, 2026-11-29,
    torch 2.11: the GPU tests in one process, after the test of a capture that syncs). Where the capture did end,
    torch refuses a second end: nothing to undo. Where it did not, the pool's share the capture took is given back
    too, which a graph whose capture never ended never does: else what the capture allocated stays reserved in the
    pool for the process's life."""
    try:
        torch._C._cuda_endAllocateToPool(stream.device.index, pool)
    except Exception:  # noqa: BLE001 - ended already, or a torch without the call
        return
    try:
        torch._C._cuda_releasePool(stream.device.index, pool)
    except Exception:  # noqa: BLE001 - best effort: the pool's blocks stay reserved, as before
        pass


def _end_generator_capture(stream):
    """Takes torch's CUDA generators out of capture mode after a failed capture: their capture ends only when a
    capture ends cleanly, and until then every random op outside a graph raises "Offset increment outside graph
    capture encountered unexpectedly" (seen on one H200, 2026-11-26, after a capture that synced). A one-op capture
    that succeeds ends it."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream, capture_error_mode="thread_local"):
            torch.zeros(1, device=stream.device).add_(1)
    except Exception:  # best effort: the failed capture's own error is the one to report
        pass


def _autocast_uncached():
    return torch.autocast("cuda", enabled=torch.is_autocast_enabled("cuda"),
                          dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _fresh(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)
