"""DFlash block drafters (z-lab DFlashDraftModel) from GGUF files of arch `dflash`, as llama.cpp's
converter writes them, checked against the target they draft for.

The drafter has no embedding and no LM head of its own: it runs on the target engine's device and
borrows the target's. What it conditions on is the target's residual stream entering the layers
listed in `dflash.target_layers` (HF `target_layer_ids` + 1), concatenated per position.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _core
from .errors import (HyperParameterError, MissingMetadataError, MissingTensorError, TensorShapeError,
                     UnsupportedArchitectureError, UnsupportedTensorTypeError)
from .gguf_file import GGUFFile, read_gguf
from .grammar import Grammar, grammar_of
from .qwen35 import MATMUL_TYPES, VECTOR_TYPES

ARCH = "dflash"

# Keys of llama.cpp's dflash loader that change the computation in ways this drafter does not
# implement; a file that sets one is refused rather than drafted wrongly.
_UNSUPPORTED_KEYS = {
    "attention.sliding_window": "sliding-window layers",
    "attention.scale": "an attention scale other than 1/sqrt(head_dim)",
    "attention.value_scale": "a value scale",
    "logit_scale": "a logit scale",
    "final_logit_softcapping": "logit soft-capping",
    "embedding_scale": "an embedding scale",
    "conv_kernel_size": "DFlash2 dynamic convolutions",
    "hyper_connection.count": "a DeepSeek-V4 backbone",
    "sample_from_anchor": "a DSpark block layout",
    "has_confidence_head": "a DSpark confidence head",
}
# Tensors of drafter variants this one does not run (own embedding/head, reduced vocabulary, DSpark).
_UNSUPPORTED_TENSORS = ("token_embd.weight", "output.weight", "d2t", "markov_w1.weight")


def read_dflash_hparams(f: GGUFFile, target_hp: Any, target_vocab: int) -> Any:
    """The drafter's hyper-parameters (a `_core.DFlashHParams`), checked against the file's tensors
    and against the target (`target_hp`: its HParams; `target_vocab`: its token count)."""
    md, path = f.metadata, f.path
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise UnsupportedArchitectureError(f"{path}: general.architecture is {arch!r}, a DFlash drafter has {ARCH!r}")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = key if key.startswith("tokenizer.") else f"{ARCH}.{key}"
        if full not in md:
            if required:
                raise MissingMetadataError(f"{path}: metadata key {full!r} is missing")
            return default
        return md[full]

    for key, what in _UNSUPPORTED_KEYS.items():
        if f"{ARCH}.{key}" in md:
            raise HyperParameterError(f"{path}: {ARCH}.{key} is set: deltaspec's DFlash drafter does not implement {what}")
    for name in _UNSUPPORTED_TENSORS:
        if name in f.tensors:
            raise HyperParameterError(f"{path}: tensor {name!r}: drafters with their own embedding, head or "
                                      "vocabulary map are not supported (the target's are used)")

    hp = _core.DFlashHParams()
    hp.n_embd = int(get("embedding_length", required=True))
    hp.n_layer = int(get("block_count", required=True))
    hp.n_head = int(get("attention.head_count", required=True))
    hp.n_head_kv = int(get("attention.head_count_kv", hp.n_head))
    hp.head_dim = int(get("attention.key_length", hp.n_embd // max(hp.n_head, 1)))
    value_length = int(get("attention.value_length", hp.head_dim))
    hp.n_ff = int(get("feed_forward_length", required=True))
    hp.n_rot = int(get("rope.dimension_count", hp.head_dim))
    hp.rope_freq_base = float(get("rope.freq_base", 10000.0))
    hp.rms_eps = float(get("attention.layer_norm_rms_epsilon", required=True))
    hp.block_size = int(get("block_size", 16))  # llama.cpp's driver defaults to 16 too
    hp.causal = bool(get("attention.causal", False))
    hp.mask_token = int(get("tokenizer.ggml.mask_token_id", required=True))
    hp.target_layers = [int(x) for x in get("target_layers", required=True)]

    def bad(what: str) -> HyperParameterError:
        return HyperParameterError(f"{path}: {what}")

    for name, v in (("embedding_length", hp.n_embd), ("block_count", hp.n_layer), ("attention.head_count", hp.n_head),
                    ("attention.head_count_kv", hp.n_head_kv), ("attention.key_length", hp.head_dim),
                    ("feed_forward_length", hp.n_ff)):
        if not 1 <= v <= 1 << 20:
            raise bad(f"{ARCH}.{name} = {v} is out of range")
    if hp.n_head % hp.n_head_kv:
        raise bad(f"{ARCH}.attention.head_count ({hp.n_head}) is not a multiple of head_count_kv ({hp.n_head_kv})")
    if value_length != hp.head_dim:
        raise bad(f"{ARCH}.attention.value_length ({value_length}) differs from key_length ({hp.head_dim})")
    if not (2 <= hp.n_rot <= hp.head_dim and hp.n_rot % 2 == 0):
        raise bad(f"{ARCH}.rope.dimension_count ({hp.n_rot}) must be even and within the head dim {hp.head_dim}")
    sections = get("rope.dimension_sections")
    if sections is not None and (list(sections[1:]) != [0] * (len(sections) - 1) or 2 * sections[0] != hp.n_rot):
        raise bad(f"{ARCH}.rope.dimension_sections = {list(sections)}: only text RoPE [n_rot/2, 0, 0, 0] is supported")
    if not 2 <= hp.block_size <= 256:
        raise bad(f"{ARCH}.block_size = {hp.block_size} is out of range [2, 256]")
    if not hp.target_layers:
        raise bad(f"{ARCH}.target_layers is empty")

    # fit to the target
    if hp.n_embd != target_hp.n_embd:
        raise bad(f"{ARCH}.embedding_length = {hp.n_embd}, but the target's hidden size is {target_hp.n_embd}: "
                  "this drafter was made for another target")
    for layer in hp.target_layers:
        # L is the residual stream entering layer L, i.e. layer L-1's output (the embedding output,
        # L = 0, is not a hidden state the target returns)
        if not 1 <= layer <= target_hp.n_layer:
            raise bad(f"{ARCH}.target_layers = {hp.target_layers}: layer {layer} is not a layer input of the "
                      f"target's {target_hp.n_layer} layers (1 .. {target_hp.n_layer})")
    if not 0 <= hp.mask_token < target_vocab:
        raise bad(f"tokenizer.ggml.mask_token_id = {hp.mask_token} is outside the target's vocabulary of {target_vocab}")
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != target_vocab:
        raise bad(f"the drafter's vocabulary has {len(tokens)} tokens, the target's {target_vocab}: "
                  "this drafter was made for another target")
    _check_tensors(f, hp)
    return hp


def _check_tensors(f: GGUFFile, hp: Any) -> None:
    E, D, H, Hkv, F = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv, hp.n_ff
    want: dict[str, tuple[tuple[int, ...], frozenset]] = {
        "fc.weight": ((len(hp.target_layers) * E, E), MATMUL_TYPES),
        "enc.output_norm.weight": ((E,), VECTOR_TYPES),
        "output_norm.weight": ((E,), VECTOR_TYPES),
    }
    for i in range(hp.n_layer):
        for name, shape, types in (("attn_norm", (E,), VECTOR_TYPES), ("attn_q", (E, H * D), MATMUL_TYPES),
                                   ("attn_k", (E, Hkv * D), MATMUL_TYPES), ("attn_v", (E, Hkv * D), MATMUL_TYPES),
                                   ("attn_output", (H * D, E), MATMUL_TYPES), ("attn_q_norm", (D,), VECTOR_TYPES),
                                   ("attn_k_norm", (D,), VECTOR_TYPES), ("ffn_norm", (E,), VECTOR_TYPES),
                                   ("ffn_gate", (E, F), MATMUL_TYPES), ("ffn_up", (E, F), MATMUL_TYPES),
                                   ("ffn_down", (F, E), MATMUL_TYPES)):
            want[f"blk.{i}.{name}.weight"] = (shape, types)
    for name, (shape, types) in want.items():
        t = f.tensors.get(name)
        if t is None:
            raise MissingTensorError(f"{f.path}: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise TensorShapeError(f"{f.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.type not in types:
            raise UnsupportedTensorTypeError(f"{f.path}: tensor {name!r} is {t.type.name}, which deltaspec cannot use here")


class Drafter:
    """A DFlash drafter for `target` (a deltaspec.Model), from a GGUF of arch `dflash`.

    It lives on the target's device and uses the target's embedding and LM head. Its context is the
    target's features (`inject`, or what the target computed while generating); `block_logits`
    returns the logits of one block for inspection.
    """

    def __init__(self, path: str | os.PathLike[str], target: Any, n_ctx: int | None = None):
        self.path = os.fspath(path)
        self.target = target
        f = read_gguf(self.path)
        self.hparams = read_dflash_hparams(f, target.hparams, target.n_vocab)
        n_ctx = target.n_ctx if n_ctx is None else int(n_ctx)
        # a context per sequence slot of the target (generate_batch / add_request draft for each),
        # allocated when a slot is first used: generate() alone allocates one
        self._core = _core.DFlash(self.path, self.hparams, target._live(), n_ctx, target.n_seq_max)

    @property
    def block_size(self) -> int:
        return self.hparams.block_size

    @property
    def n_slots(self) -> int:
        """Sequence slots the drafter keeps a context for: the target's n_seq_max when loaded."""
        return self._core.n_slots

    @property
    def block_stats(self) -> dict[str, int]:
        """Block passes run, the blocks in them and the most in one pass: generate_batch /
        add_request run every drafting sequence's block in one pass."""
        return dict(self._core.block_stats)

    @property
    def n_cached(self) -> int:
        """Context rows held (target positions 0 .. n_cached - 1)."""
        return self._core.n_cached

    def inject(self, features: np.ndarray, pos0: int | None = None) -> None:
        """Target features, shape (rows, len(target_layers) * n_embd), of positions pos0 .. (default:
        after the cached rows) become context; rows at or after pos0 are replaced."""
        self._core.inject(np.ascontiguousarray(features, dtype=np.float32), self.n_cached if pos0 is None else int(pos0))

    def truncate(self, n: int) -> None:
        """Forget the context rows at positions >= n."""
        self._core.truncate(int(n))

    def read_context(self, ids: Sequence[int]) -> None:
        """The target reads `ids` as a fresh sequence (its own state is reset) and the features it
        computes become the drafter's whole context."""
        arr = self.target._token_array(ids, allow_empty=True)
        with self.target._busy:
            self._core.read_context(arr)

    def block_logits(self, ids: int | Sequence[int]) -> np.ndarray:
        """Logits (block_size - 1, n_vocab) of one block: row i predicts the token i + 1 places after
        the anchor. `ids`: committed token ids (the target reads all but the last, whose features
        become the context; the last is the anchor), or one anchor id placed after the context
        already held (inject / read_context)."""
        return self._core.block_logits(self._anchor(ids))

    def block_top1(self, ids: int | Sequence[int]) -> list[int]:
        """The argmax of every predicted slot (the chain draft), as block_logits takes `ids`."""
        return list(self._core.block_top1(self._anchor(ids)))

    def tree(self, ids: Sequence[int], budget: int, max_depth: int | None = None, temperature: float = 0.0,
             seed: int = 0, grammar: Grammar | str | None = None) -> dict:
        """The DDTree draft tree speculation verifies after `ids` (the target reads all but the last,
        the anchor; its state is reset): {token, parent, depth} per node (parent -1: the anchor),
        and for sampled trees (temperature > 0) the q each expanded node's children were drawn from
        (`dists`: (ids, probs), `child_q` / `root_child_q` index them: one per depth without a
        grammar). With `grammar`, the tree of a constrained generation's first round (the grammar
        at its start): each node's children only what the grammar allows after its path."""
        arr = self.target._token_array(ids)
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= 256:
            raise ValueError(f"budget must be an integer in [1, 256], got {budget!r}")
        depth = self.block_size - 1 if max_depth is None else int(max_depth)
        rule = self._constraint(grammar)
        with self.target._busy:
            return self._core.tree(arr.tolist(), budget, depth, float(temperature), int(seed), rule)

    def chain(self, ids: Sequence[int], n_max: int | None = None, grammar: Grammar | str | None = None) -> list[int]:
        """The chain draft speculation verifies after `ids` (the target reads all but the last, the
        anchor; its state is reset): each slot's argmax, at most n_max (default: the whole block).
        With `grammar`, the chain of a constrained generation's first round (the grammar at its
        start): each slot's most probable of its top 16 the grammar allows after the chain before
        it, ending at a slot with none."""
        arr = self.target._token_array(ids)
        n = self.block_size - 1 if n_max is None else n_max
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.block_size - 1:
            raise ValueError(f"n_max must be an integer in [1, {self.block_size - 1}] (the block's slots), got {n_max!r}")
        rule = self._constraint(grammar)
        with self.target._busy:
            return list(self._core.chain(arr.tolist(), n, rule))

    def _constraint(self, grammar: Grammar | str | None):
        g = grammar_of(grammar)
        return None if g is None else self.target._grammar_constraint(g)

    def _anchor(self, ids: int | Sequence[int]) -> int:
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
            return int(ids)
        ids = list(ids)
        if not ids:
            raise ValueError("ids must hold at least the anchor token")
        self.read_context(ids[:-1])
        return int(ids[-1])
