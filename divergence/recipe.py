"""Typed recipes: YAML files in recipes/ loaded into dataclasses.

Every field carries its meaning in a comment; unknown keys, wrong types and impossible values fail with a
`RecipeError` that names the file and the dotted key (litgpt's args.py, torchtitan's __post_init__).
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .errors import RecipeError, UserError
from .names import OPTIMIZER_NAMES, SLOT_NAMES
from .paths import RECIPES_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout in a source tree; prefer paths.SOURCE_ROOT
# null: eager; inductor: fused kernels; inductor+cudagraphs: and CUDA graphs (reduce-overhead); aot_eager, eager:
# traced but not code-generated (for tests).
COMPILE_BACKENDS = (None, "inductor", "inductor+cudagraphs", "aot_eager", "eager")
TOKENIZATIONS = ("bpe", "word")  # data.tokenization: what a trained tokenizer is (data/corpus.py)


@dataclass
class DataConfig:
    # a file, a folder, a name under the data root (`wikitext-2` is fetched from the hub when no local copy
    # exists), `hf:NAME[:CONFIG]` for the hub, or `synthetic[:SEED]` for seeded Zipfian text (data/synthetic.py)
    source: str = "wikitext-2"
    root: Optional[str] = None  # where named sources live; else $DIVERGENCE_DATA, ../shared/data, <cache>/text
    hf_split: str = "train"  # split of a hub dataset
    hf_text_field: str = "text"  # column holding the text in a hub dataset
    tokenizer: Optional[str] = None  # path to a tokenizer.json; None trains one on the corpus (tokenization)
    # what a trained tokenizer is: bpe (byte-level BPE) | word (one id per whitespace-split word, the rest <unk>;
    # data/wordlevel.py). A given data.tokenizer wins over both.
    tokenization: str = "bpe"
    vocab_size: int = 4096  # a trained tokenizer's size, specials included (word: less if the text has fewer words)
    val_fraction: float = 0.05  # share of the token stream held out (the tail) for validation
    max_chars: Optional[int] = None  # read at most this many characters of text (hub datasets are large)
    # where tokenizers and memory-mapped token ids are cached (a relative path: from the working folder); null:
    # $DIVERGENCE_CACHE, else data/ in a source checkout, else ~/.cache/divergence (paths.cache_root)
    cache_dir: Optional[str] = None

    def validate(self, where):
        if self.tokenization not in TOKENIZATIONS:
            raise RecipeError(f"{_j(where)}tokenization: unknown {self.tokenization!r}; "
                              f"known: {', '.join(TOKENIZATIONS)}")
        if self.tokenization == "bpe" and self.vocab_size < 260:
            raise RecipeError(f"{_j(where)}vocab_size: {self.vocab_size} is below 260 (byte-level BPE needs 256 bytes + specials)")
        if self.tokenization == "word" and self.vocab_size < 3:
            raise RecipeError(f"{_j(where)}vocab_size: {self.vocab_size} is below 3 "
                              "(word level: EOT, <unk> and a word)")
        if not 0.0 < self.val_fraction < 0.5:
            raise RecipeError(f"{_j(where)}val_fraction: {self.val_fraction} must lie in (0, 0.5)")


MLPS = ("swiglu", "geglu")  # model.mlp: the slot that gates the MLP


@dataclass
class ModelConfig:
    n_layers: int = 2  # transformer blocks
    d_model: int = 64  # width
    n_heads: int = 4  # attention heads; must divide d_model unless head_dim is given
    head_dim: Optional[int] = None  # attention head size; None = d_model / n_heads (Gemma-2: 256, not 3584/16)
    n_kv_heads: Optional[int] = None  # key/value heads (grouped-query attention: fewer than n_heads); None = n_heads
    d_ff: int = 176  # the MLP's hidden width (of its gate and up projections)
    mlp: str = "swiglu"  # the MLP's gate: swiglu (Llama's silu) or geglu (Gemma's gelu_tanh), each its own slot
    seq_len: int = 64  # tokens per sequence
    vocab_size: Optional[int] = None  # embedding rows; None takes the tokenizer's size (must not be smaller)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Optional[dict] = None  # Llama-3.1's {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    #                                      original_max_position_embeddings}; None = plain RoPE
    attn_softcap: Optional[float] = None  # Gemma-2 attention-logit softcap (50.0 there); None = off
    final_softcap: Optional[float] = None  # Gemma-2 final-logit softcap (30.0 there); None = off
    norm_eps: float = 1e-6  # RMSNorm epsilon
    # {slot: {input: dtype}}: slots called in a declared problem's dtypes (its definition's), their inputs cast to
    # them in every arm (slots/registry.Kernels); set by declared shapes' `dtypes`. None: the model's own dtypes
    slot_dtypes: Optional[dict] = None
    init_std: float = 0.02  # normal init of the linear weights (a tied head is the embedding: embed_init_std)
    # Normal init of the embedding, which feeds an RMSNorm (scale-invariant): SGD moves a row by lr * g against a
    # row norm of embed_init_std * sqrt(d_model), and g itself scales as 1 / embed_init_std (through rstd), so the
    # embedding's SGD learning rate is in effect lr / embed_init_std^2. At 1.0 the rows keep their gradient at the
    # upstream gradient's scale and barely move under SGD; at 0.02 (GPT-2's, and the lab's: NOTES.md) they train,
    # and an error in their gradient reaches the SGD loss (docs/story.md).
    embed_init_std: float = 1.0
    tie_embeddings: bool = False  # tie LM head to the embedding (off: the embedding's only consumer is the norm)
    # The width the optimizers' learning rates were written for: at another d_model the hidden matrices' rates
    # scale by base_width / d_model (train/width.py); None = d_model (no scaling). Declared shapes set it.
    base_width: Optional[int] = None
    # A transformers config.json whose shapes fill every model key the recipe does not set (hf_config.py);
    # relative to the recipe's folder. The depth stays the recipe's.
    from_hf_config: Optional[str] = None

    def validate(self, where):
        for k in ("n_layers", "d_model", "n_heads", "d_ff", "seq_len"):
            if getattr(self, k) <= 0:
                raise RecipeError(f"{_j(where)}{k}: must be positive, got {getattr(self, k)}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise RecipeError(f"{_j(where)}n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise RecipeError(f"{_j(where)}n_heads: {self.n_heads} does not divide d_model={self.d_model}")
        if self.head_size % 2 or self.head_size <= 0:
            raise RecipeError(f"{_j(where)}{'head_dim' if self.head_dim else 'n_heads'}: head size {self.head_size} "
                              "must be even and positive for RoPE")
        if self.mlp not in MLPS:
            raise RecipeError(f"{_j(where)}mlp: unknown MLP {self.mlp!r}; known: {', '.join(MLPS)}")
        if self.base_width is not None and self.base_width <= 0:
            raise RecipeError(f"{_j(where)}base_width: must be positive or null, got {self.base_width}")
        if self.rope_scaling is not None:
            from .hf_config import check_rope_scaling

            check_rope_scaling(self.rope_scaling, f"{_j(where)}rope_scaling")
        for k in ("init_std", "embed_init_std"):
            if getattr(self, k) <= 0:
                raise RecipeError(f"{_j(where)}{k}: must be positive, got {getattr(self, k)}")
        for k in ("attn_softcap", "final_softcap"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise RecipeError(f"{_j(where)}{k}: must be positive or null, got {v}")
        if self.slot_dtypes is not None:
            from .shapes import check_dtypes

            try:
                check_dtypes(self.slot_dtypes, f"{_j(where)}slot_dtypes")
            except UserError as e:
                raise RecipeError(str(e)) from None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass
class OptimizerConfig:
    lr: float = 1e-3  # peak learning rate
    momentum: float = 0.0  # SGD only
    betas: list = field(default_factory=lambda: [0.9, 0.95])  # AdamW only
    weight_decay: float = 0.0  # decoupled weight decay (AdamW, Adafactor)
    warmup_steps: int = 0  # linear warm-up
    schedule: str = "constant"  # constant | cosine (to 10% of lr at the last step)

    def validate(self, where):
        if self.lr <= 0:
            raise RecipeError(f"{_j(where)}lr: must be positive, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise RecipeError(f"{_j(where)}schedule: unknown {self.schedule!r}; known: constant, cosine")
        if self.warmup_steps < 0:
            raise RecipeError(f"{_j(where)}warmup_steps: must be >= 0")


@dataclass
class TrainConfig:
    steps: int = 30  # optimizer steps per arm
    batch_size: int = 8  # sequences per step (tokens per step = batch_size * seq_len)
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (fp32 on cpu, bf16-mixed on cuda) | fp32 | bf16-mixed
    val_every: int = 10  # validation loss every N steps (and at the last step)
    val_batches: int = 2  # batches per validation
    snapshot_every: int = 10  # save the embedding every N steps for drift analysis (0 = only the last step)
    grad_clip: Optional[float] = None  # max global grad norm; off by default: clipping can hide the bugs we hunt
    threads: int = 1  # CPU threads per arm: fixed so that CPU runs are bitwise reproducible
    progress: bool = True  # progress bar
    # torch.compile of all but the embedding, the same in every arm (candidates stay outside the graph): the GPU
    # recipes' inductor+cudagraphs fuses the fp32 upcasts that dominate the eager step and replays each step as a
    # CUDA graph (COMPILE_BACKENDS above); null = eager.
    compile: Optional[str] = None
    # Where `compile` uses CUDA graphs, an arm that runs no candidate code (the reference and nulls) replays each
    # step's forward, backward and gradient norms as one CUDA graph (train/stepgraph.py: why, and what is not
    # captured), and every arm's body is compiled without inductor's own CUDA graphs (train/module.py: why);
    # false keeps every arm's body under inductor's cudagraph trees alone.
    step_graph: bool = True

    def validate(self, where):
        for k in ("steps", "batch_size", "val_every", "val_batches", "threads"):
            if getattr(self, k) <= 0:
                raise RecipeError(f"{_j(where)}{k}: must be positive, got {getattr(self, k)}")
        if self.snapshot_every < 0:
            raise RecipeError(f"{_j(where)}snapshot_every: must be >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise RecipeError(f"{_j(where)}device: unknown {self.device!r}; known: auto, cpu, cuda")
        if self.precision not in ("auto", "fp32", "bf16-mixed"):
            raise RecipeError(f"{_j(where)}precision: unknown {self.precision!r}; known: auto, fp32, bf16-mixed")
        if self.compile not in COMPILE_BACKENDS:
            raise RecipeError(f"{_j(where)}compile: unknown backend {self.compile!r}; known: null (eager), "
                              + ", ".join(b for b in COMPILE_BACKENDS if b))


ARM_STARTS = ("auto", "forkserver", "spawn")  # ab.arm_start (ab/runner.start_method); never plain fork by request


@dataclass
class ABConfig:
    optimizers: list = field(default_factory=lambda: ["sgd", "adamw", "adafactor"])  # one A/B per optimizer
    nulls: int = 2  # null arms per optimizer (equally-correct kernels that round differently)
    margin: float = 3.0  # candidate flagged when its distance exceeds margin x the largest null distance ...
    window: int = 3  # ... for this many consecutive compared points
    lead: int = 5  # ... against the envelope as it stands this many steps later (detect/verdict.ahead: why)
    # Arms at once: on CUDA at most this many per GPU, fewer where they do not fit in its free memory (ab/memory.py);
    # on the CPU this many in all. auto: 6 per GPU, on the CPU one per train.threads cores (at most 4)
    workers: typing.Any = "auto"
    step_timeout_s: float = 120.0  # a step slower than this ends the arm with TIMEOUT
    arm_timeout_s: float = 3600.0  # an arm longer than this ends with TIMEOUT
    lockstep_every: int = 1  # the candidate arm checks its op on its live inputs every N steps (0 = off)
    probe: bool = True  # run the preflight probe before training
    arm_start: str = "auto"  # how arm processes start: auto | forkserver | spawn (ab/runner.start_method: why)
    # Where train.compile is set, one reference or null arm starts alone and the rest once it has written its first
    # metrics, reading its compiled graphs from inductor's cache instead of compiling the same ones at once
    # (ab/runner.CompileFirst: why; the local scheduler only, not Ray)
    compile_first: bool = True
    # Candidates run in a kernel server: a process of their own that sees nothing of the harness (divergence/sandbox).
    # false: in the process that calls them (the arm, the probe's worker), where the harness's in-process guards
    # apply instead; the verdict's candidate says which ("isolation")
    sandbox: bool = True


@dataclass
class Recipe:
    name: str = "unnamed"  # short name, used in result folders
    seed: int = 0  # seeds the initial weights and the batch order, shared by every arm
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizers: dict = field(default_factory=dict)  # name -> OptimizerConfig; names from names.OPTIMIZER_NAMES
    kernels: dict = field(default_factory=dict)  # slot -> implementation name (reference when absent)
    ab: ABConfig = field(default_factory=ABConfig)
    # Declared shapes, e.g. {hidden: 4096, vocab: 65536}: the axes a kernel was written for (divergence/shapes.py);
    # they set the model's width, head size, SwiGLU width and vocabulary rows. A definition or --shape adds to them.
    shapes: dict = field(default_factory=dict)
    path: Optional[str] = None  # the file it came from (set by the loader)

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.model.seq_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value, tp, where):
    """Check `value` against annotation `tp`, converting ints to floats where a float is wanted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{_at(where)}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{_at(where)}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{_at(where)}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{_at(where)}: expected a string, got {value!r}")
        return value
    if tp in (list, dict) or origin in (list, dict):
        want = origin or tp
        if not isinstance(value, want):
            raise RecipeError(f"{_at(where)}: expected a {want.__name__}, got {value!r}")
        return value
    return value


def _j(where: str) -> str:
    """Prefix for a key below `where`: `recipes/x.yaml: model.n_heads` names the file, then the dotted key."""
    return where + " " if where.endswith(":") else where + "."


def _at(where: str) -> str:
    """`where` before a colon of its own: the top level's `recipes/x.yaml:` would otherwise read `x.yaml:: ...`."""
    return where.removesuffix(":")


def _join(where: str, key: str) -> str:
    return _j(where) + key


def _build(cls, raw, where):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{_at(where)}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise RecipeError(f"{_at(where)}: unknown key {unknown[0]!r}; known: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], _join(where, k)) for k, v in raw.items()}
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(where)
    return obj


def recipe_from_dict(raw: dict, where: str = "recipe:", base: Optional[Path] = None) -> Recipe:
    """`base`: the folder relative paths in the recipe (model.from_hf_config) start from."""
    raw = _shaped(dict(raw or {}), where, base)
    opts = raw.pop("optimizers", None) or {}
    if not isinstance(opts, dict):
        raise RecipeError(f"{_j(where)}optimizers: expected a mapping of optimizer name to settings")
    recipe = _build(Recipe, raw, where)
    built = {}
    for name, cfg in opts.items():
        if name not in OPTIMIZER_NAMES:
            raise RecipeError(f"{_j(where)}optimizers.{name}: unknown optimizer; known: {', '.join(OPTIMIZER_NAMES)}")
        built[name] = _build(OptimizerConfig, cfg, f"{_j(where)}optimizers.{name}")
    recipe.optimizers = built
    for slot, impl in recipe.kernels.items():
        if slot not in SLOT_NAMES:
            raise RecipeError(f"{_j(where)}kernels.{slot}: unknown slot; known: {', '.join(SLOT_NAMES)}")
        if not isinstance(impl, str):
            raise RecipeError(f"{_j(where)}kernels.{slot}: expected an implementation name or path, got {impl!r}")
    for name in recipe.ab.optimizers:
        if name not in OPTIMIZER_NAMES:
            raise RecipeError(f"{_j(where)}ab.optimizers: unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}")
        if name not in built:
            raise RecipeError(f"{_j(where)}ab.optimizers: {name!r} has no settings under optimizers")
    if recipe.ab.nulls < 1:
        raise RecipeError(f"{_j(where)}ab.nulls: at least one null arm is needed to calibrate, got {recipe.ab.nulls}")
    if recipe.ab.margin <= 1.0:
        raise RecipeError(f"{_j(where)}ab.margin: must exceed 1, got {recipe.ab.margin}")
    if recipe.ab.lead < 0:
        raise RecipeError(f"{_j(where)}ab.lead: must be >= 0 steps, got {recipe.ab.lead}")
    if recipe.ab.window < 1:
        raise RecipeError(f"{_j(where)}ab.window: must be >= 1, got {recipe.ab.window}")
    w = recipe.ab.workers
    if w != "auto" and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise RecipeError(f"{_j(where)}ab.workers: expected auto or a positive integer, got {w!r}")
    if recipe.ab.arm_start not in ARM_STARTS:
        raise RecipeError(f"{_j(where)}ab.arm_start: unknown {recipe.ab.arm_start!r}; known: {', '.join(ARM_STARTS)}")
    return recipe


def _shaped(raw: dict, where: str, base: Optional[Path]) -> dict:
    """The raw recipe with `model.from_hf_config` and then `shapes` applied to its `model` and `data` mappings."""
    model = raw.get("model")
    if isinstance(model, dict) and model.get("from_hf_config"):
        from .hf_config import model_from_hf_config

        raw["model"] = model_from_hf_config(model, base, f"{_j(where)}model.from_hf_config")
    if raw.get("shapes"):
        from .shapes import check_shapes, model_overrides

        shapes = check_shapes(raw["shapes"], f"{_j(where)}shapes")
        if not isinstance(raw.get("model") or {}, dict) or not isinstance(raw.get("data") or {}, dict):
            return raw  # the typed build names the malformed mapping
        raw["model"], raw["data"] = model_overrides(raw.get("model"), raw.get("data"), shapes, ModelConfig())
    return raw


def resolve_recipe_path(name_or_path: str) -> Path:
    """`tiny`, `recipes/tiny.yaml` or any path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return RECIPES_DIR / f"{name_or_path}.yaml"


def read_yaml_mapping(path: Path) -> dict:
    """A YAML file whose top level is a mapping; a one-line RecipeError naming the file (and line) otherwise."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}:{at} malformed YAML: {getattr(e, 'problem', e)}") from None
    if raw is None or not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level")
    return raw


def load_recipe(name_or_path: str, overrides: Optional[dict] = None) -> Recipe:
    path = resolve_recipe_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")))
        raise RecipeError(f"{path}: recipe not found; known recipes: {known}")
    raw = read_yaml_mapping(path)
    where = f"{path}:"
    if overrides:
        raw = _merge(raw, overrides)
        where = f"{path} with {' '.join(_flat(overrides))}:"  # names the override that broke it, if one did
    recipe = recipe_from_dict(raw, where=where, base=path.parent)
    recipe.path = str(path)
    return recipe


def _flat(over: dict, prefix: str = "") -> list:
    """{"train": {"steps": 5}} -> ["train.steps=5"]"""
    out = []
    for k, v in over.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}={v}"]
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def default_recipe_name(shaped: bool = False) -> str:
    """`small` on a CPU machine, `h200` where CUDA is available; `h200-shapes` there for declared production
    shapes (`shaped`), whose width alone makes the h200 recipe's 6 layers too long."""
    if os.environ.get("DIVERGENCE_RECIPE"):
        return os.environ["DIVERGENCE_RECIPE"]
    import torch

    if not torch.cuda.is_available():
        return "small"
    return "h200-shapes" if shaped else "h200"
