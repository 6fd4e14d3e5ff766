"""Text in, text out: `jspec.load(dir)` -> a Model (params, cfg, tokenizer) whose `generate(text)` returns the new
text, its tokens and stats, and whose `stream(text)` yields the text as tokens commit. Also `jspec.load_hf` and
`jspec.save`, so no user code needs to import the generically named `checkpoints` package itself.

jspec's `checkpoints` package is resolved by `checkpoints_package`: a folder named `checkpoints` in the working
directory (common in ML projects) would otherwise shadow it (Python takes such a folder for a namespace package).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from jspec import checks
from jspec.config import ModelConfig
from jspec.engine import Engine, GenerationResult
from jspec.stats import BatchStats, SpecStats

OWN_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints" / "__init__.py"
BUNDLED = {"demo": "demo_dir", "demo-hybrid": "demo_hybrid_dir"}  # name -> its `checkpoints` directory function


def checkpoints_package() -> ModuleType:
    """jspec's own `checkpoints` package. A `checkpoints` namespace package (a plain folder of that name on sys.path,
    e.g. the working directory) is replaced by it in sys.modules; another project's regular package of that name
    is not touched: then an ImportError names both."""
    mod = sys.modules.get("checkpoints")
    if mod is None:
        try:
            mod = importlib.import_module("checkpoints")
        except ImportError:
            mod = None
    origin = getattr(mod, "__file__", None)
    if origin and Path(origin).resolve() == OWN_CHECKPOINTS:
        return mod
    if origin:
        raise ImportError(
            f"`import checkpoints` finds {origin}, not jspec's checkpoints package ({OWN_CHECKPOINTS.parent}); "
            "rename that package, or use jspec.load / jspec.load_hf / jspec.save from another working directory"
        )
    for name in [m for m in sys.modules if m == "checkpoints" or m.startswith("checkpoints.")]:
        del sys.modules[name]  # the namespace package (a data folder) and anything imported through it
    spec = importlib.util.spec_from_file_location(
        "checkpoints", OWN_CHECKPOINTS, submodule_search_locations=[str(OWN_CHECKPOINTS.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["checkpoints"] = module
    spec.loader.exec_module(module)
    return module


def load_hf(
    hf_dir, dtype: str = "float32", quantize: str | None = None, quantize_lm_head: bool | None = None, mesh=None
):
    """Import a HuggingFace checkpoint directory -> (params, cfg): `checkpoints.load_hf` (its docstring has the
    details: safetensors only, dense and GPTQ / AWQ / compressed-tensors int4, MTP heads; mesh: tensor parallel)."""
    ckpt = checkpoints_package()
    return ckpt.load_hf(hf_dir, dtype=dtype, quantize=quantize, quantize_lm_head=quantize_lm_head, mesh=mesh)


def save(out_dir, params: dict, cfg: ModelConfig) -> None:
    """Write (params, cfg) to a new directory as a jspec (orbax) checkpoint: `checkpoints.save`."""
    checkpoints_package().save(out_dir, params, cfg)


@dataclasses.dataclass
class TextResult:
    """What `Model.generate` returns: the new text, the new tokens and the generation's stats."""

    text: str
    tokens: list[int]
    stats: SpecStats


@dataclasses.dataclass
class Model:
    """A loaded model: params, cfg and (when the checkpoint has a tokenizer.json) its tokenizer.

    generate / stream take text (or token ids) and build, then reuse, one Engine: its cache holds the request
    (prompt + max_new_tokens, rounded up to a multiple of 512 within the model's max_position_embeddings), and a
    later request that fits the same engine and k compiles nothing.
    """

    params: dict
    cfg: ModelConfig
    tokenizer: Any = None
    path: str | None = None
    mesh: Any = None  # a tensor-parallel mesh the params are stacked on (jspec.tensor_parallel), or None
    _engine: Engine | None = dataclasses.field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._need_tokenizer().encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(tokens))

    def _prompt_ids(self, prompt: str | Sequence[int], name: str = "prompt") -> list[int]:
        """Text (encoded) or token ids (checked: `jspec.checks.token_ids`) -> the prompt's token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return checks.token_ids(prompt, name, self.cfg.vocab_size).tolist()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The model's EOS ids: the config's, else the tokenizer's usual end-of-text token."""
        if self.cfg.eos_token_ids:
            return tuple(self.cfg.eos_token_ids)
        for name in ("<|endoftext|>", "</s>", "<eos>"):
            token = None if self.tokenizer is None else self.tokenizer.token_to_id(name)
            if token is not None:
                return (token,)
        return ()

    def engine(self, max_len: int, k: int = 4, batch_size: int = 1) -> Engine:
        """An Engine for max_len positions, draft length k and batch_size slots: the last one built if it has room,
        that k and that batch size."""
        cached = self._engine
        if cached is None or cached.k != k or cached.max_len < max_len or cached.batch_size != batch_size:
            self._engine = None  # let the previous engine's prepared weights go first
            self._engine = Engine(self.params, self.cfg, max_len=max_len, k=k, batch_size=batch_size, mesh=self.mesh)
        return self._engine

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 128, *, batch_size: int = 8, **options
    ) -> tuple[list[TextResult], BatchStats]:
        """Texts (or token-id lists) in -> (one TextResult per prompt, in order; the BatchStats), generated
        batch_size at a time (`Engine.generate_batch`: each sequence's tokens are those `generate` gives it alone).
        Options: drafter, gate, sampler (one or one per prompt), k (default 4), max_len (default: the longest
        prompt + max_new_tokens, rounded up), eos_id (default: `eos_ids`), progress, rounds_per_call."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of texts or token-id lists, got {type(prompts).__name__}")
        ids = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        k = options.pop("k", 4)
        max_len = options.pop("max_len", None)
        options.setdefault("eos_id", self.eos_ids)
        if max_len is None:
            max_len = self._default_max_len(max((len(p) for p in ids), default=1) + max_new_tokens)
        out = self.engine(max_len, k, batch_size).generate_batch(ids, max_new_tokens, **options)
        texts = [self.decode(r.tokens) if self.tokenizer is not None else "" for r in out.results]
        return [TextResult(t, r.tokens, r.stats) for t, r in zip(texts, out.results, strict=True)], out.stats

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **options) -> TextResult:
        """Text (or token ids) in -> TextResult(text = the new text, tokens, stats). Options: drafter, gate, k
        (default 4), max_len (default: prompt + max_new_tokens, rounded up), eos_id (default: `eos_ids`; () never
        stops at a token), on_device, progress, rounds_per_call — as `Engine.generate`."""
        run = self.stream(prompt, max_new_tokens, **options)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **options) -> Iterator[str]:
        """`generate` as a generator: yields the new text piece by piece as tokens commit (a piece is held back
        while it ends inside a multi-byte character) and returns the TextResult (StopIteration.value)."""
        ids = self._prompt_ids(prompt)
        k = options.pop("k", 4)
        max_len = options.pop("max_len", None)
        options.setdefault("eos_id", self.eos_ids)
        if max_len is None:
            max_len = self._default_max_len(len(ids) + max_new_tokens)
        engine = self.engine(max_len, k)
        run = engine.stream(ids, max_new_tokens, **options)
        tokens: list[int] = []
        shown = ""
        while True:
            try:
                tokens += next(run)
            except StopIteration as done:
                result: GenerationResult = done.value
                break
            if self.tokenizer is not None:
                text = self.decode(tokens)
                if not text.endswith("\ufffd") and len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text
        text = self.decode(result.tokens) if self.tokenizer is not None else ""
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown) :]
        return TextResult(text, result.tokens, result.stats)

    def _default_max_len(self, need: int) -> int:
        """The cache a request of `need` positions gets: need rounded up to a multiple of 512 within the model's
        max_position_embeddings (never below need)."""
        return max(need, min(-(-need // 512) * 512, self.cfg.max_position_embeddings))

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.path or 'this model'} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer


def resolve_checkpoint(path: str | os.PathLike | None) -> str:
    """A checkpoint directory: a bundled model for None ("demo") or a name of BUNDLED, else the path itself."""
    name = "demo" if path is None else os.fspath(path)
    if name in BUNDLED:
        return getattr(checkpoints_package(), BUNDLED[name])()
    return name


def checkpoint_kind(root: str | os.PathLike) -> str:
    """ "jspec" (jspec.json inside) or "hf" (config.json inside); raises for a directory holding neither."""
    root = Path(root)
    if not root.is_dir():
        state = "is a file, not a directory" if root.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint directory {os.fspath(root)!r} {state}")
    if (root / "jspec.json").exists():
        return "jspec"
    if (root / "config.json").exists():
        return "hf"
    raise FileNotFoundError(
        f"{root} holds neither jspec.json (a jspec checkpoint) nor config.json (a HuggingFace checkpoint)"
    )


def checkpoint_config(root: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, read without its weights (an HF directory's weight files are
    found and their headers read, so a directory without usable weights fails here)."""
    root = Path(root)
    if checkpoint_kind(root) == "hf":
        cfg = ModelConfig.from_hf(root)
        checkpoints_package().hf.Checkpoint(root)  # the weight files exist and are safetensors (their headers)
        return cfg
    try:
        return ModelConfig.from_dict(json.loads((root / "jspec.json").read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the config in {root / 'jspec.json'}: {e}") from e


def load(
    checkpoint: str | os.PathLike | None = None, dtype: str | None = None, quantize: str | None = None, mesh=None
) -> Model:
    """A Model from a jspec (orbax) checkpoint directory (jspec.json inside), a HuggingFace safetensors directory
    (config.json inside; dtype default "bfloat16", quantize None | "int4"), or a bundled model: None / "demo" (the
    dense demo) or "demo-hybrid" (the Gated DeltaNet hybrid with its MTP head).
    The directory's tokenizer.json, when present, becomes the Model's tokenizer. mesh: a tensor-parallel mesh
    (`jspec.tensor_parallel`): each shard is loaded onto its device and the Model's engines run on the mesh."""
    ckpt = checkpoints_package()
    root = Path(resolve_checkpoint(checkpoint))
    if checkpoint_kind(root) == "jspec":
        if quantize or dtype:
            raise ValueError(f"{root} is a jspec checkpoint (already converted): dtype and quantize apply to HF ones")
        params, cfg = ckpt.load(root, mesh=mesh)
    else:
        params, cfg = ckpt.load_hf(root, dtype=dtype or "bfloat16", quantize=quantize, mesh=mesh)
    tokenizer = read_tokenizer(root / "tokenizer.json") if (root / "tokenizer.json").exists() else None
    return Model(params, cfg, tokenizer, os.fspath(root), mesh)


def read_tokenizer(file: str | os.PathLike):
    """A tokenizer.json -> `tokenizers.Tokenizer`; a file it cannot parse raises ValueError naming the file (the
    tokenizers library raises a bare Exception that names none)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(os.fspath(file))
    except Exception as e:
        raise ValueError(f"cannot read tokenizer {os.fspath(file)}: {e}") from e
