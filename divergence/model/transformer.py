"""A Llama-style decoder in which every op is a named kernel slot (nanoGPT's size, Gemma-2's softcaps).

    ids -> [fused_embed_rmsnorm] -> blocks x n_layers -> [rmsnorm] -> head (-> final softcap) -> [cross_entropy]
    block: x + attn([rmsnorm](x)), then x + mlp([rmsnorm](x))
           (each residual add with the norm after it: [add_rmsnorm](sublayer out, x), the sum beside it)
    attn:  [qkv_proj] -> [rope] -> q k^T / sqrt(hd) -> causal mask -> [attn_softcap] (or SDPA without a cap) -> @ v
           -> proj    (grouped-query: n_kv_heads key/value heads, each shared by n_heads / n_kv_heads query heads;
                       rope's backward: [rope_backward])
    mlp:   [swiglu](x W_gate, x W_up) W_down            (its backward: [swiglu_backward])
           or, under `model.mlp: geglu` (Gemma's), [geglu](x W_gate, x W_up) W_down
The embedding's only consumer is the initial RMSNorm (SOL-ExecBench L1/087's pattern), so the embedding gradient
is exactly what the `fused_embed_rmsnorm` slot computes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..slots import rope
from ..slots.registry import Kernels
from .ops import CompiledEmbed, EmbedRMSNorm, call_forward_slot, call_rope, call_swiglu, declared, observed_rmsnorm
from .rope_scaling import model_inv_freq

PARAM_GROUPS = ("embedding", "norms", "attention", "mlp", "head")


class Norm(nn.Module):
    def __init__(self, dim, eps, kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.kernels = eps, kernels

    def after_add(self, x, delta):
        """(x + delta, this norm of it): a residual add and the norm that reads the sum. Through the add_rmsnorm
        slot (delta its hidden_states, x its residual) where that is not the plain reference, the sum added beside
        it for the residual stream; else the sum, then this norm (the rmsnorm slot), as without the add slot.
        delta None: x alone (the first block's, the embedding's output)."""
        if delta is None:
            return x, self(x)
        if self.kernels.is_plain("add_rmsnorm"):
            x = x + delta
            return x, self(x)
        return x + delta, call_forward_slot(self.kernels, "add_rmsnorm", delta, x, self.weight, self.eps)

    def forward(self, x):
        if self.kernels.is_plain("rmsnorm") and self.kernels.is_plain("rmsnorm_backward"):
            # The reference is plain differentiable ops: autograd's own backward, as fast as a bare loop (and
            # traced under `train.compile`).
            return self.kernels("rmsnorm", x, self.weight, self.eps)
        return declared(self.kernels, "rmsnorm", (x, self.weight, self.eps),
                        lambda *cast: observed_rmsnorm(*cast, self.kernels))


class Attention(nn.Module):
    def __init__(self, cfg, kernels):
        super().__init__()
        self.n_heads, self.hd = cfg.n_heads, cfg.head_size  # n_heads x hd may differ from d_model (Gemma-2)
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        # One weight, [q; k; v] by rows: the qkv_proj slot gets its three row blocks as views, which every optimizer
        # step updates in place (at the addresses a kernel may have kept)
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * self.n_kv) * self.hd, bias=False)
        self.proj = nn.Linear(cfg.n_heads * self.hd, cfg.d_model, bias=False)
        self.softcap, self.kernels = cfg.attn_softcap, kernels

    def _qkv(self, x):
        """(q, k, v), (B, heads, S, hd) each: the plain reference as one projection whose output is split into
        strided views, else through the qkv_proj slot with the three weights."""
        B, S, D = x.shape
        nq, nkv = self.n_heads * self.hd, self.n_kv * self.hd
        if not self.kernels.is_plain("qkv_proj"):
            w = self.qkv.weight
            return call_forward_slot(self.kernels, "qkv_proj", x, w[:nq], w[nq:nq + nkv], w[nq + nkv:])
        if self.n_kv == self.n_heads:
            return self.qkv(x).view(B, S, 3, self.n_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = self.qkv(x)
        return tuple(y[..., a:b].view(B, S, -1, self.hd).transpose(1, 2)
                     for a, b in ((0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)))

    def forward(self, x, position_ids, inv_freq, rope_tables=None):
        B, S, D = x.shape
        q, k, v = self._qkv(x)  # (B, nh, S, hd), k and v (B, n_kv, S, hd)
        if rope_tables is not None:  # the plain reference, on tables every layer shares (Transformer._rope_tables)
            q, k = rope.reference_from_tables(q, k, *rope_tables)
        else:
            q, k = call_rope(self.kernels, q, k, position_ids, inv_freq)
        if self.n_kv != self.n_heads:  # each key/value head serves n_heads / n_kv query heads
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))  # (B, nh, S, S)
            mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = call_forward_slot(self.kernels, "attn_softcap", scores, float(self.softcap))
            y = probs.to(v.dtype) @ v
        return self.proj(y.transpose(1, 2).reshape(B, S, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg, kernels):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.kernels, self.geglu = kernels, cfg.mlp == "geglu"

    def forward(self, x):
        if self.geglu:
            return self.down(call_forward_slot(self.kernels, "geglu", self.gate(x), self.up(x)))
        return self.down(call_swiglu(self.kernels, self.gate(x), self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg, kernels):
        super().__init__()
        self.attn_norm = Norm(cfg.d_model, cfg.norm_eps, kernels)
        self.attn = Attention(cfg, kernels)
        self.mlp_norm = Norm(cfg.d_model, cfg.norm_eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(self, x, delta, position_ids, inv_freq, rope_tables=None):
        """(x, delta) -> (x, delta): the stream and the previous sublayer's output, not yet added (it is added
        where the next norm reads the sum: Norm.after_add)."""
        x, h = self.attn_norm.after_add(x, delta)
        x, h = self.mlp_norm.after_add(x, self.attn(h, position_ids, inv_freq, rope_tables))
        return x, self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, cfg, vocab_size: int, kernels: Kernels):
        super().__init__()
        self.cfg, self.vocab_size, self.kernels = cfg, vocab_size, kernels
        kernels.context.setdefault("head_dim", cfg.head_size)  # qkv_proj's: the weights give heads x head size only
        self.embed = nn.Parameter(torch.empty(vocab_size, cfg.d_model))
        self.embed_norm = nn.Parameter(torch.ones(cfg.d_model))
        self.blocks = nn.ModuleList([Block(cfg, kernels) for _ in range(cfg.n_layers)])
        self.final_norm = Norm(cfg.d_model, cfg.norm_eps, kernels)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.register_buffer("inv_freq", model_inv_freq(cfg), persistent=False)
        self.body = self._body  # compile_body replaces it
        self.compiled_embed = None  # and sets this (ops.CompiledEmbed)
        self._rope_cache = {}  # (S, device) -> (cos, sin): _rope_tables
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual projections scaled by depth (GPT-2) so the residual stream stays O(1).
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "down.weight")) else std
                nn.init.normal_(p, 0.0, s)
        # The embedding feeds an RMSNorm, which is scale-invariant: at the default 1.0 its rows keep their gradient
        # at the scale of the upstream gradient (at 0.02 it is 50x larger, through rstd = 1/0.02, and the rows
        # train under SGD: recipe.ModelConfig.embed_init_std says why that matters).
        nn.init.normal_(self.embed, 0.0, self.cfg.embed_init_std)
        if self.cfg.tie_embeddings:
            self.head.weight = self.embed

    def param_group(self, name: str) -> str:
        if name == "embed":
            return "embedding"
        if name.startswith("head"):
            return "head"
        if "norm" in name:
            return "norms"
        if ".attn." in name:
            return "attention"
        return "mlp"

    def compile_body(self, spec: str, cudagraphs: bool = True):
        """torch.compile everything after the embedding (the blocks, final norm, head and loss) as one graph; the
        embedding, whose backward is the `fused_embed_rmsnorm` slot, is compiled apart (ops.CompiledEmbed: its
        fixed forward, and its backward where that is the plain reference). Inside, plain reference slots are
        fused with their neighbours; every other slot call breaks the graph (`torch.compiler.disable` in ops.py),
        so a candidate runs as written, never traced or rewritten. `cudagraphs=False`: without the spec's CUDA
        graphs (an arm whose whole step is captured: train/stepgraph.py)."""
        body = torch.compile(self._body, dynamic=False, **compile_options(spec, cudagraphs))
        self.body = body
        if any(not self.kernels.is_plain(s) for s in self.kernels.impls if s != "fused_embed_rmsnorm"):
            # The body breaks at a slot call, and views of one intermediate cross the break (q, k and v of the qkv
            # projection at the `rope` slot): a graph whose outputs are such views, read back from AOTAutograd's
            # on-disk cache by the next arm, rebuilt them with garbage sizes ("invalid shape dimension
            # -614111580149761574 at index 1 of shape [94736951674613, -614111580149761574, 384]", or a segfault),
            # torch 2.13 on the CPU and 2.11 on an H100 alike; the graph compiled afresh in the same process works.
            # Such a body compiles (at its first call, and again at a new shape) without that cache: it traces its
            # graphs again, inductor's own cache still spares the kernels. (The switch around every call, 20 us on
            # the CPU, since a compile comes at whichever call meets a new shape.)
            import torch._functorch.config as functorch_config

            def uncached(*args):
                with functorch_config.patch(enable_autograd_cache=False):
                    return body(*args)

            self.body = uncached
        self.compiled_embed = CompiledEmbed(compile_options(spec, cudagraphs=False), self.vocab_size)

    def forward(self, ids, targets=None, loss_rows=None):
        """(B, S, V) logits, or with `targets` the mean cross-entropy loss alone. `loss_rows` (an evaluation's, no
        gradients): the head and the loss computed for that many sequences at a time (loss_in_pieces)."""
        B, S = ids.shape
        x = EmbedRMSNorm.apply(self.embed, self.embed_norm, ids, self.cfg.norm_eps, self.kernels,
                               self.compiled_embed)  # (B, S, D)
        position_ids = torch.arange(S, device=ids.device).expand(B, S)
        if loss_rows is not None and targets is not None and loss_rows < B:
            return self._body(x, position_ids, targets, self._rope_tables(position_ids), loss_rows)
        return self.body(x, position_ids, targets, self._rope_tables(position_ids))

    def _rope_tables(self, position_ids):
        """The plain reference RoPE's cos/sin tables, built once (position_ids are always arange(S) here) and given
        to the body as inputs, shared by every layer; None where `rope` or `rope_backward` is not the plain
        reference. Built inside each slot call, under `train.compile` inductor fused them into each layer's rotation
        and evaluated cos and sin once per element of q and k, forward and backward (12 kernels of 27 us a step, 0.33
        ms of the h200 recipe's 7.7; built inside the body once per step, still: one H200, 2026-11-26, `make bench
        --profile`).
        The same arithmetic as the slot's reference (slots/rope.py)."""
        if not (self.kernels.is_plain("rope") and self.kernels.is_plain("rope_backward")):
            return None
        key = (position_ids.shape[-1], position_ids.device)
        # Kept, never replaced: a step or evaluation graph reads these tensors by address.
        if key not in self._rope_cache:
            self._rope_cache[key] = rope.tables(position_ids, self.inv_freq)
        return self._rope_cache[key]

    def _body(self, x, position_ids, targets, tables=None, loss_rows=None):
        delta = None
        for block in self.blocks:
            x, delta = block(x, delta, position_ids, self.inv_freq, tables)
        normed = self.final_norm.after_add(x, delta)[1]
        if loss_rows is not None:
            return self.loss_in_pieces(normed, targets, loss_rows)
        return self._tail(normed, targets)

    def _tail(self, normed, targets):
        B, S, _ = normed.shape
        logits = self.head(normed)  # (B, S, V)
        if self.cfg.final_softcap is not None:
            c = self.cfg.final_softcap
            logits = c * torch.tanh(logits / c)
        if targets is None:
            return logits
        # The loss alone: returned as well, the (B, S, V) logits were a compiled graph's output, written out and
        # kept alive in the CUDA-graph pool every step (512 MiB at the h200 recipe) for no reader.
        return call_forward_slot(self.kernels, "cross_entropy", logits.reshape(B * S, -1), targets.reshape(-1))

    def loss_in_pieces(self, normed, targets, rows: int):
        """The mean loss of the final norm's output, the head and the loss taken `rows` sequences at a time, each
        piece's mean weighted by its rows, in float64: an evaluation's logits are its largest tensors (fp32 at 32 x
        256 tokens x 65,536 rows: 2 GiB, and a captured evaluation keeps its peak for the arm's life). Every arm
        evaluates so, the candidate's too: every slot but `cross_entropy` sees the whole batch as in training."""
        B = normed.shape[0]
        total = torch.zeros((), dtype=torch.float64, device=normed.device)
        for i in range(0, B, rows):
            total += self._tail(normed[i:i + rows], targets[i:i + rows]).double() * (min(rows, B - i) / B)
        return total


CUDAGRAPHS = "+cudagraphs"  # `inductor+cudagraphs`: the backend, with its graphs replayed as CUDA graphs


def compile_options(spec: str, cudagraphs: bool = True) -> dict:
    """`train.compile` -> torch.compile keywords: `inductor+cudagraphs` is inductor with CUDA graphs (mode
    reduce-overhead: each compiled graph replays with one launch instead of one per kernel); `cudagraphs=False`
    drops them."""
    backend = spec.removesuffix(CUDAGRAPHS)
    if cudagraphs and uses_cudagraphs(spec):
        return {"backend": backend, "mode": "reduce-overhead"}
    return {"backend": backend}


def uses_cudagraphs(spec) -> bool:
    return bool(spec) and spec.endswith(CUDAGRAPHS)


def build_model(cfg, vocab_size: int, kernels: Kernels, seed: int) -> Transformer:
    """A fresh model: same seed, same initial weights, whatever the kernels (they hold no parameters)."""
    torch.manual_seed(seed)
    return Transformer(cfg, vocab_size, kernels)
