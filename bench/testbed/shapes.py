"""Model shapes, token budget and special tokens of the testbed, full size and smoke size.

Full size is chosen to fit the return channel of the GPU machine: the target in f16 is ~13 MB
(one file of at most 15 MB), the drafters a few MB each. Every DeltaNet / attention shape is one the
engine's kernels accept (DeltaNet head dim 32/64, conv channels a multiple of 128, attention head
dim 64); see python/deltaspec/testing/tiny_models.py for where those limits come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaspec.qwen35 import mrope_sections

EOS_TEXT = "<|endoftext|>"   # separates files in the training stream; the models' end of generation
MASK_TEXT = "<|mask|>"       # DFlash's noise token (dflash_config.mask_token_id)
SPECIAL_TEXTS = (EOS_TEXT, MASK_TEXT)  # ids 0 and 1, ahead of the byte-level vocabulary


def _rope(head_dim: int) -> dict:
    # Qwen3.5's partial rotary (a quarter of the head) with interleaved M-RoPE sections
    return {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": mrope_sections(head_dim // 8)[:3], "mrope_interleaved": True}


@dataclass(frozen=True)
class Shapes:
    name: str
    vocab_size: int
    hidden: int
    ffn: int
    target_layers: int
    draft_layers: int
    dflash_layers: int
    dflash_target_layer_ids: tuple[int, ...]
    linear_head_dim: int        # DeltaNet key/value head dim S
    block_size: int = 16        # DFlash block: anchor + 15 drafted positions
    seq_len: int = 512          # training sequence length
    max_corpus_bytes: int = 120_000_000
    extra: dict = field(default_factory=dict)

    def qwen35_config(self, n_layers: int, layer_types: list[str] | None = None) -> dict:
        """Keyword arguments of transformers' Qwen3_5TextConfig for a model of this family."""
        cfg = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden, "intermediate_size": self.ffn,
            "num_hidden_layers": n_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": self.linear_head_dim, "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "rope_parameters": _rope(64),
            "eos_token_id": 0, "bos_token_id": None, "pad_token_id": None,
        }
        if layer_types is not None:
            cfg["layer_types"] = layer_types
        return cfg

    def target_config(self) -> dict:
        # mtp_num_hidden_layers: the checkpoint carries one MTP block under mtp.* (as Qwen3.5's do)
        return {**self.qwen35_config(self.target_layers), "mtp_num_hidden_layers": 1}

    def draft_config(self) -> dict:
        # same family, two layers: one DeltaNet and one gated attention layer
        return self.qwen35_config(self.draft_layers, ["linear_attention", "full_attention"])

    def dflash_config(self, mask_token_id: int) -> dict:
        """Keyword arguments of transformers' Qwen3Config for dflash's DFlashDraftModel."""
        return {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden, "intermediate_size": self.ffn,
            "num_hidden_layers": self.dflash_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "attention_bias": False,
            "block_size": self.block_size, "num_target_layers": self.target_layers,
            "dflash_config": {"target_layer_ids": list(self.dflash_target_layer_ids),
                              "mask_token_id": mask_token_id, "block_size": self.block_size},
            "architectures": ["DFlashDraftModel"],
        }


FULL = Shapes(name="full", vocab_size=4096, hidden=256, ffn=512, target_layers=8, draft_layers=2,
              dflash_layers=2, dflash_target_layer_ids=(1, 3, 5), linear_head_dim=64)
# Seconds of CPU: the same code paths on a model a few hundred kB big.
SMOKE = Shapes(name="smoke", vocab_size=384, hidden=64, ffn=128, target_layers=4, draft_layers=2,
               dflash_layers=1, dflash_target_layer_ids=(0, 2), linear_head_dim=32, block_size=8,
               seq_len=128, max_corpus_bytes=1_500_000)
SHAPES = {s.name: s for s in (FULL, SMOKE)}
