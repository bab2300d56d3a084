"""`Model`: a qwen35 GGUF loaded into the native engine, with its tokenizer."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from . import _core, batch_invariance, completions, embeddings, llama_args, session_state
from .cpu import default_threads
from .errors import EngineError, TokenizerError
from .generation import (TEXT_SPECIAL, Generator, GenerationResult, Speculation, TextStream, _Request, engine_of,
                         prompt_entries, result_of, step_logprobs, validate_flag, validate_stop)
from .gguf_file import read_gguf
from .grammar import Grammar, grammar_of
from .reasoning_budget import ReasoningBudget, validate_reasoning_budget
from .qwen35 import check_tensors, read_hparams
from .devices import device_kind, parse_layer_split
from .kv_cache import allocated_state, engine_cache_args, validate_cache_types
from .prediction import predicted_speculation, prediction_ids
from .sampling import SamplingOptions
from .tokenizer import Tokenizer

DEVICES = ("cpu", "cuda")
LOGITS = ("all", "last", "none")
MAX_N_CTX = 1 << 24      # as qwen35.context_length; past it the KV arithmetic overflows before memory runs out
MAX_N_UBATCH = 1 << 24
MAX_THREADS = 512        # ggml's GGML_MAX_N_THREADS
MAX_N_SEQ = 256          # sequence slots; each holds a whole KV cache and recurrent state
SPEC_TYPES = ("draft-simple", "ngram-simple", "mtp", "draft-mtp", "dflash", "draft-dflash")  # draft-*: llama.cpp's names
SMALL_ARRAY = 64  # longer metadata arrays (vocabulary, merges) are left out of Model.metadata


@dataclass
class RequestOutput:
    """What one `Model.step()` did to one request added with `Model.add_request`."""
    request_id: int
    tokens: list[int]                   # the tokens committed in this step
    finished: bool
    result: GenerationResult | None     # once finished
    # a request with logprobs=k: (token, logprob, top [(token, logprob)] * k) of each of those tokens
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # prompt_logprobs=True, in the step that completed the prompt: its entries (GenerationResult's)
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None


def _load_progress(progress, path: str):
    """(callback for the engine's (done_bytes, total_bytes) reports or None, closer to call after the
    load). Called before the file is read, so that a bar shows from the start of the load."""
    if progress is None or isinstance(progress, bool):
        from .load_progress import start_load_progress

        return start_load_progress(path, show=progress)
    def on_fraction(done: int, total: int) -> None:
        progress(done / total if total else 1.0)

    return on_fraction, None


def _check_count(name: str, value: Any, hi: int, alternatives: str = "") -> None:
    """A positive int up to `hi` (a bool is not a count: True would mean 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise ValueError(f"{name} must be an integer in [1, {hi}]{alternatives}, got {value!r}")


class Model:
    """A Qwen3.5 / Qwen3.6 model from a GGUF file.

    The file is validated completely (metadata, tensor names, shapes and types) before the native
    engine reads it; problems raise subclasses of `deltaspec.errors.DeltaspecError`.

    `batch_invariant` says whether a row's logits are bitwise the same whatever batch width computes
    them (see the argument and `deltaspec.batch_invariance`).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, n_ctx: int = 4096, n_threads: int | None = None,
                 device: str | None = None, n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16",
                 progress: bool | Callable[[float], None] | None = None, n_seq_max: int = 1, *,
                 model_path: str | os.PathLike[str] | None = None, n_gpu_layers: int | None = None,
                 seed: int | None = None, n_batch: int | None = None, verbose: bool | None = None,
                 flash_attn: bool | str | None = None, devices: Sequence[str] | str | None = None,
                 split: str | None = None, tensor_split: Sequence[float] | None = None,
                 batch_invariant: bool | None = None):
        """`progress` reports the load: None shows a tqdm bar on stderr when stderr is a terminal
        (and tqdm is installed), True shows it anyway (plain lines when stderr is not a terminal),
        False shows nothing, and a callable receives the fraction of the weights uploaded, 0.0 ..
        1.0, ending with exactly 1.0 (at most ~100 calls; raising aborts the load).

        `device`: "cpu" (the default), "cuda" (= "cuda:0") or "cuda:N", the N-th GPU of ggml's
        registry (deltaspec.devices); the whole model and its state live there.

        `devices` (instead of `device`), `split` and `tensor_split`: one model over several devices,
        e.g. devices=["cuda:0", "cpu"], split="layer", tensor_split=[3, 1] (llama.cpp's
        `-sm layer -ts 3,1`): each decoder layer, with its weights, KV cache and recurrent state, on
        one device by llama.cpp's rule (deltaspec.devices.layer_devices), the token embeddings on the
        CPU, and ggml's scheduler running each step over the devices. split="layer" is the only mode;
        tensor_split None splits by each device's free memory. `device_layers()` says what went where.
        MTP and DFlash drafting need one device; a draft model loaded from a path goes on devices[0]
        (`self.device`).

        `batch_invariant`: True computes every row as it would be computed in any other batch, so
        that greedy speculation (verify chains and trees) and batches of sequences give plain
        greedy's tokens for every weight type, batch width and context length. On the CPU it runs
        ggml-cpu's reference kernels (prefill at 0.55-0.6x, bench/batch_invariance.py); on CUDA
        deltaspec's invariant products and attention (ggml/cuda/deltaspec_invariant.h; the KV cache
        f16, bf16, f32, tq3 or tq4; its cost: bench/batch_invariance_cuda.py). None takes
        DELTASPEC_BATCH_INVARIANT (0 or 1) from the environment, off when unset.

        `n_seq_max` sequence slots, each with a KV cache of n_ctx rows and a recurrent state, let
        generate_batch / add_request run that many sequences at once (the weights are shared).

        llama-cpp-python's names work too: `model_path` (= path), `n_gpu_layers` (0: the CPU; -1 or
        any count: the GPU, this engine keeping the whole model on one device), `seed` (the
        sampling seed of generate(seed=None); -1 or None: a fresh random one per call), `n_batch`
        (caps n_ubatch, as llama.cpp caps its physical batch), `verbose` (True: load progress and a
        summary line on stderr; False: none) and `flash_attn` (True/None: attention always runs as
        flash attention here; False is refused)."""
        self._engine = None
        layer_split = parse_layer_split(devices, split, tensor_split, device)
        if layer_split is not None and n_gpu_layers is not None:
            raise ValueError(f"n_gpu_layers={n_gpu_layers!r} and devices= both place the model; pass devices= alone")
        if layer_split is not None:
            # the first local device speaks for the model (draft models loaded from a path go there)
            device = next((d for d in layer_split[0] if not d.startswith("rpc:")), "cpu")
        choice = llama_args.resolve(path, model_path, device, n_gpu_layers, n_ubatch, n_batch, seed, flash_attn)
        path, device, n_ubatch, self._default_seed = choice.path, choice.device, choice.n_ubatch, choice.seed
        if verbose is not None and not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True, False or None, got {verbose!r}")
        if verbose is not None and progress is None:
            progress = verbose
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike naming a GGUF file, got {type(path).__name__} "
                            f"{path!r}")
        self.path = os.fspath(path)
        _check_count("n_ctx", n_ctx, MAX_N_CTX)
        _check_count("n_ubatch", n_ubatch, MAX_N_UBATCH)
        _check_count("n_seq_max", n_seq_max, MAX_N_SEQ)
        if n_threads is None:
            n_threads = min(default_threads(), MAX_THREADS)
        _check_count("n_threads", n_threads, MAX_THREADS, " or None")
        device_kind(device)  # "cpu", "cuda" or "cuda:N"; ValueError naming it otherwise
        self.batch_invariant = batch_invariance.resolve(batch_invariant, layer_split[0] if layer_split else [device],
                                                        type_k, type_v)
        if not (progress is None or isinstance(progress, bool) or callable(progress)):
            raise TypeError(f"progress must be None, a bool or a callable taking a float, got {progress!r}")

        # before the file is read: the bar shows from the start of the load (a bar left open by a
        # bad file closes when collected)
        on_bytes, close_bar = _load_progress(progress, self.path)
        gguf = read_gguf(self.path)
        self.hparams = read_hparams(gguf)
        check_tensors(self.hparams, gguf)
        for d in layer_split[0] if layer_split else [device]:  # an RPC device: held to the CPU's types
            validate_cache_types(type_k, type_v, "cpu" if d.startswith("rpc:") else d, self.hparams.head_dim)
        # the vocabulary and merges stay with the tokenizer; everything else is kept as read
        self.metadata: dict[str, Any] = {k: v for k, v in gguf.metadata.items()
                                         if not (isinstance(v, list) and len(v) > SMALL_ARRAY)}
        # n_vocab is the token list's length, and check_tensors held token_embd to it
        try:
            self.tokenizer = Tokenizer.from_metadata(gguf.metadata)
        except TokenizerError as e:  # its messages name the key; the file is named here
            raise TokenizerError(f"{self.path}: {e}") from None
        split_args = dict(devices=layer_split[0], tensor_split=layer_split[1]) if layer_split else {}
        try:
            self._engine = _core.Engine(self.path, self.hparams, n_ctx=n_ctx, n_ubatch=n_ubatch,
                                        n_threads=n_threads, device=device, **engine_cache_args(type_k, type_v),
                                        progress=on_bytes, n_seq_max=n_seq_max,
                                        batch_invariant=self.batch_invariant, **split_args)
        except RuntimeError as e:  # the file passed validation: device, memory, or the file changed since
            message = str(e)
            raise EngineError(message if message.startswith(self.path) else f"{self.path}: {message}") from None
        finally:
            if close_bar is not None:
                close_bar()
        if verbose:
            print(f"deltaspec: loaded {self.path} on {self._engine.backend}: n_ctx {self._engine.n_ctx}, "
                  f"KV cache {type_k}/{type_v}, {n_threads} threads", file=sys.stderr)
        # the engine finds stop strings in the text the user gets
        self._engine.set_pieces([self.tokenizer.token_to_piece(i, special=TEXT_SPECIAL) for i in range(self.n_vocab)])
        self._control = threading.Lock()  # guards _active: one generation at a time, cancels reach only it
        self._active: Callable[[], Generator | None] = lambda: None  # a weakref to the running Generator
        # Held by whoever runs the engine, which is not thread-safe: one direct call (eval, logits,
        # reset) or a generation's worker for its whole run. See generation.engine_of.
        self._busy = threading.Lock()
        self.device = device
        self.devices = list(layer_split[0]) if layer_split else None  # None: one device (self.device)
        self.n_threads = n_threads
        self.n_seq_max = n_seq_max
        self._batch_running = False  # a generate_batch call runs (cancel() reaches it)
        # add_request id -> (prompt ids, grammar constraint, whether it asked for logprobs)
        self._request_prompts: dict[int, tuple] = {}
        # The tokens slot 0's state holds, in order (None: unknown, e.g. after a batch): a prompt
        # that extends them continues from that state (save_state / load_state, resumed chats).
        self._cached_tokens: list[int] | None = []

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._live().n_ctx

    @property
    def n_past(self) -> int:
        """Tokens currently held in the sequence state."""
        return self._live().n_past

    def kv_cache_info(self) -> dict[str, Any]:
        """The sequence state as the engine allocated it, read from its tensors (not from the
        type_k / type_v asked for):

            {"n_ctx": 256,                       # rows per KV cache (n_ctx rounded up to 256)
             "n_seq_max": 1,                     # sequence slots; the layer lists are one slot's

             "attention_layers": [{"layer": 3, "type_k": "q8_0", "type_v": "q4_0",
                                   "k_bytes": 17408, "v_bytes": 9216, "buffer": "CPU"}, ...],
             "recurrent_layers": [{"layer": 0, "conv_type": "f32", "conv_bytes": 1536,
                                   "ssm_type": "f32", "ssm_bytes": 8192, "buffer": "CPU"}, ...],
             "slots": [{"slot": 0, "kv_bytes": ..., "recurrent_bytes": ..., "total_bytes": ...},
                       ...],                     # what each slot holds
             "k_bytes": ..., "v_bytes": ..., "kv_bytes": ...,   # totals over the attention layers and slots
             "recurrent_bytes": ...,             # the live Gated DeltaNet state (conv + DeltaNet)
             "total_bytes": ...}

        Types are ggml's names (as type_k / type_v take them); bytes are ggml_nbytes of each tensor;
        "buffer" is the device memory holding it ("CPU", "CUDA0"). Like the other calls, it waits
        for the model (a running generation makes it raise RuntimeError)."""
        with engine_of(self) as engine:
            return allocated_state(engine.state_info, engine.n_ctx)

    def device_layers(self) -> list[dict[str, Any]]:
        """Where the model lives, one dict per device (one entry on one device):

            [{"device": "cuda:0", "backend": "CUDA0", "layers": [0, 1, 2],  # decoder layers there
              "input": False, "output": False,      # token embeddings; output norm + LM head
              "weight_bytes": ..., "kv_bytes": ...,  # weights; KV cache (k + v, every slot)
              "state_bytes": ...}, ...]              # recurrent state (conv + DeltaNet, checkpoint copy)

        read from the buffers the engine allocated (csrc/engine_split.cpp). Under a layer split the
        devices come in the order given, then "cpu" when it was not listed (it holds the token
        embeddings, as in llama.cpp)."""
        with engine_of(self) as engine:
            return list(engine.device_layers)

    # --- tokens --------------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, special: bool = False, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (a str, or UTF-8 bytes as llama-cpp-python takes); with special=True,
        control tokens such as <|im_start|> are parsed. add_bos (llama-cpp-python's default True)
        puts the BOS token first when the model's vocabulary asks for one
        (tokenizer.ggml.add_bos_token); Qwen3.5's does not."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"text must be a str or bytes, got {type(text).__name__} {text!r:.80}")
        ids = self.tokenizer.encode(text, special=validate_flag("special", special))
        if validate_flag("add_bos", add_bos) and self.tokenizer.add_bos and self.tokenizer.bos_id is not None:
            ids = [self.tokenizer.bos_id, *ids]
        return ids

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        """Text of token ids; control tokens such as <|im_start|> render only with special=True
        (llama-cpp-python's default, and how generated text is made)."""
        arr = self._token_array(ids, "ids", allow_empty=True)
        return self.tokenizer.decode(arr.tolist(), special=validate_flag("special", special))

    # --- compute -------------------------------------------------------------------------------
    # Each call below holds the model for its duration (engine_of): calls from several threads run
    # one after another, never interleaved; while a generation runs they raise RuntimeError, and a
    # stream suspended between pieces is cancelled first, as a new generate() would cancel it.
    def reset(self) -> None:
        """Forget the sequence: the next eval starts at position 0."""
        with engine_of(self) as engine:
            engine.reset()
            self._cached_tokens = []

    def eval(self, ids: Sequence[int], logits: str = "last") -> np.ndarray:
        """Append tokens to the sequence. Returns float32 logits of shape (rows, n_vocab), rows being
        len(ids) for logits="all", 1 for "last" and 0 for "none"."""
        arr = self._token_array(ids)
        if not isinstance(logits, str) or logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        with engine_of(self) as engine:
            known, self._cached_tokens = self._cached_tokens, None
            out = self._append(engine, arr, logits)
            self._cached_tokens = None if known is None else known + arr.tolist()
            return out

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits of every position of a fresh sequence `ids`: shape (len(ids), n_vocab). The reset
        and the evaluation are one call: no other thread's call lands between them."""
        arr = self._token_array(ids)
        with engine_of(self) as engine:
            self._cached_tokens = None
            engine.reset()
            out = self._append(engine, arr, "all")
            self._cached_tokens = arr.tolist()
            return out

    @staticmethod
    def _append(engine, arr: np.ndarray, logits: str) -> np.ndarray:
        if engine.n_past + len(arr) > engine.n_ctx:
            raise ValueError(f"{engine.n_past} tokens in the context + {len(arr)} new ones exceed n_ctx = "
                             f"{engine.n_ctx}")
        return engine.eval(arr, logits)

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, penalty_last_n: int = 64,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stream: bool = False, draft_model: "Model | str | os.PathLike[str] | None" = None,
                 spec_type: str | None = None, draft_n_max: int = 16,
                 draft_n_min: int = 0, tree_budget: int = 0, grammar: Grammar | str | None = None,
                 ignore_eos: bool = False, logit_bias: dict[int, float] | None = None,
                 logprobs: int | None = None, reasoning_budget: int | None = None,
                 reasoning_budget_message: str = "") -> GenerationResult | TextStream:
        """Generate a continuation of `prompt` (text, parsed with special tokens, or token ids).

        Stops at `max_tokens` (None: until the context is full), an end-of-generation token, a stop
        string (cut from the text) or a cancel. Sampling follows llama.cpp's chain; temperature 0
        is greedy. With stream=True returns an iterator of text pieces (never a split UTF-8
        character, never part of a stop string) whose `.result` is set when it is exhausted or
        closed. Control tokens (<|im_start|>, ...) are not part of the text. cancel() stops a
        running generation: it returns (or the stream ends) with finish_reason "cancelled".

        Speculative decoding (lossless: same greedy output, same sampling distribution):
        spec_type "draft-simple" with draft_model (a Model or a GGUF path with the same
        vocabulary), "ngram-simple" (prompt lookup) or "mtp" (alias "draft-mtp": the model's own MTP
        head, for files converted with their MTP layer) or "dflash" (alias "draft-dflash": draft_model
        a DFlash block drafter, deltaspec.Drafter or its GGUF path, one pass drafting a block);
        draft_n_max / draft_n_min bound the draft length, which adapts to the acceptance rate (tree
        nodes count for draft_n_min). tree_budget > 0 drafts trees of up to that many nodes
        (draft model: best-first with the top-1 chain first; DFlash: DDTree's best-first over the
        block's per-slot distributions, children drawn without replacement when sampling; the MTP
        head: its chain with its next-best tokens as extra leaves at each depth; n-gram drafts
        branch where the text went on differently) verified in one target pass; 0 drafts chains.
        Stats then
        report n_drafted, n_accepted, acceptance_rate, mean_acceptance_length, n_tree_nodes,
        accepted_lengths (per verified draft) and draft / verify / rollback time.

        Structured output: `grammar` (a deltaspec.Grammar, or a GBNF / Lark string) is enforced
        while decoding, also with speculation (drafts the grammar forbids are cut before they are
        verified, and every verified position, of a chain or of a draft tree, is masked as plain
        decoding would mask it after that position's path, so greedy output is token-identical with
        and without speculation). The text ends when the grammar is complete (an end-of-generation token is
        then allowed), or earlier at max_tokens.

        reasoning_budget=N (llama.cpp's --reasoning-budget; None or -1: none) lets a <think> block hold
        at most N tokens (those of the prompt after an opening <think> count), then forces its
        </think> (after `reasoning_budget_message`, if given: llama.cpp's --reasoning-budget-message);
        0 closes the block at once (deltaspec.reasoning_budget). It is enforced as a
        grammar is (every loop, with speculation the forced end drafted); until the budget runs out
        the rows stay on the device's argmax / top rows, only the forced end's are read whole. Not
        with a grammar, except the tool-call grammars (deltaspec.tool_call_grammar), whose reasoning
        is free.

        seed None uses the Model's seed (random when it has none); -1 is random. ignore_eos bans the
        end-of-generation tokens (logit -inf), so only max_tokens, a stop string or the context
        ends the text; logit_bias ({token id: value}, as OpenAI's) is added to the logits after the
        penalties. logprobs=k fills result.logprobs / top_logprobs from the raw logits (with
        speculation, those of the verify rows that predicted the committed tokens: the values plain
        decoding reports for the same tokens). A prompt that extends the tokens this model's sequence holds (the last
        generate's prompt and output, or load_state) continues from that state instead of
        re-reading them: result.stats.cached_tokens counts them."""
        validate_flag("stream", stream)
        request = self._request(prompt, max_tokens, SamplingOptions(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
            seed=self._default_seed if seed is None else seed, logit_bias=self._logit_bias(logit_bias, ignore_eos)),
            stop)
        request.speculation = self._speculation(spec_type, draft_model, draft_n_max, draft_n_min, tree_budget)
        request.n_logprobs = self._n_logprobs(logprobs)
        self._constrain(request, grammar, ignore_eos, reasoning_budget, reasoning_budget_message)
        generator = Generator(self, request)
        return TextStream(generator) if stream else generator.result()

    def _logit_bias(self, logit_bias, ignore_eos) -> tuple[tuple[int, float], ...]:
        """(token, bias) pairs for the sampler: logit_bias's ({id: value}; ids may be strings of
        digits, as JSON gives them) then -inf on every end-of-generation token for ignore_eos."""
        pairs = []
        if logit_bias is not None:
            if not isinstance(logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {type(logit_bias).__name__}")
            for key, value in logit_bias.items():
                tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
                if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.n_vocab:
                    raise ValueError(f"logit_bias: token id {key!r} is outside the vocabulary [0, {self.n_vocab})")
                pairs.append((tid, value))
        if validate_flag("ignore_eos", ignore_eos):
            pairs += [(t, float("-inf")) for t in sorted(self.tokenizer.eog_ids)]
        return tuple(pairs)

    @staticmethod
    def _n_logprobs(logprobs) -> int:
        if logprobs is None:
            return -1
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 1000:
            raise ValueError(f"logprobs must be None or an integer in [0, 1000] (top tokens per position), "
                             f"got {logprobs!r}")
        return logprobs

    def _request(self, prompt, max_tokens, sampling: SamplingOptions, stop, scored: bool = False) -> _Request:
        ids = self._prompt_ids(prompt)
        if max_tokens is None:
            # until the context is full: the last token is sampled from the last row, never evaluated
            max_tokens = self.n_ctx - len(ids) + 1
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < (0 if scored else 1):
            raise ValueError(f"max_tokens must be a positive integer or None (0 only with prompt_logprobs=True: the "
                             f"prompt scored alone, or hidden_states=True), got {max_tokens!r}")
        return _Request(ids, max_tokens, sampling, validate_stop(stop))

    def _batch_request(self, prompt, options: dict[str, Any], where: str, scored: bool = False) -> _Request:
        """A request for generate_batch / add_request from generate()'s keyword arguments (`scored`:
        add_request's prompt_logprobs, which allows max_tokens=0)."""
        options = dict(options)
        prediction = options.pop("prediction", None)
        unknown = sorted(set(options) - set(_GENERATE_DEFAULTS))
        if unknown:
            raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
        o = {**_GENERATE_DEFAULTS, **options}
        # a (non-empty) prediction drafts by lookup in place of any other drafter (deltaspec.prediction)
        predicted = prediction_ids(self, prediction, where) if prediction is not None else []
        if validate_flag("stream", o["stream"]):
            raise ValueError(f"{where}() does not stream (stream=True); stream one prompt with generate()")
        sampling = SamplingOptions(**{k: o[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                                          "presence_penalty", "frequency_penalty", "penalty_last_n")},
                                   seed=self._default_seed if o["seed"] is None else o["seed"],
                                   logit_bias=self._logit_bias(o["logit_bias"], o["ignore_eos"]))
        request = self._request(prompt, o["max_tokens"], sampling, o["stop"], scored)
        request.n_logprobs = self._n_logprobs(o["logprobs"])
        # the drafter's arguments are checked even where a prediction replaces it
        request.speculation = self._speculation(o["spec_type"], o["draft_model"], o["draft_n_max"], o["draft_n_min"],
                                                o["tree_budget"])
        if predicted:
            request.speculation = predicted_speculation(self, predicted, request.speculation, o["draft_n_max"],
                                                        o["draft_n_min"])
        self._constrain(request, o["grammar"], o["ignore_eos"], o["reasoning_budget"], o["reasoning_budget_message"])
        return request

    @staticmethod
    def _constrain(request: _Request, grammar, ignore_eos, reasoning_budget, reasoning_budget_message) -> None:
        """The request's grammar and reasoning budget, checked."""
        request.grammar = grammar_of(grammar)
        request.reasoning_budget = validate_reasoning_budget(reasoning_budget)
        if not isinstance(reasoning_budget_message, str):
            raise TypeError(f"reasoning_budget_message must be a string, got {type(reasoning_budget_message).__name__}")
        request.reasoning_budget_message = reasoning_budget_message
        if request.grammar is not None and ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: once the grammar is complete only an "
                             "end-of-generation token is allowed")
        if request.grammar is not None and request.reasoning_budget is not None and not request.grammar.free_reasoning:
            raise ValueError("reasoning_budget cannot be combined with a grammar (the grammar constrains the whole "
                             "text, a <think> block included; the tool-call grammars, which leave the reasoning "
                             "free, are the exception)")

    @staticmethod
    def _native_spec(request: _Request):
        """The scheduler's speculation of a request: None, or (n_max, n_min, ngram_max, the lookup's
        reference ids (a prediction's), tree_budget, whether the draft model drafts, whether the
        DFlash drafter drafts, whether the MTP head drafts)."""
        spec = request.speculation
        if spec is None:
            return None
        return (spec.n_max, spec.n_min, spec.ngram_max, list(spec.reference), spec.tree_budget,
                spec.draft is not None and not spec.dflash, spec.dflash, spec.mtp)

    @staticmethod
    def _one_drafter(requests: Sequence[_Request], dflash: bool, what: str):
        """The one drafter (draft Model, or DFlash Drafter) of the requests that draft with one."""
        drafts = {id(r.speculation.draft): r.speculation.draft for r in requests
                  if r.speculation is not None and r.speculation.draft is not None and r.speculation.dflash == dflash}
        if len(drafts) > 1:
            raise ValueError(f"the requests of a batch draft with one {what} (got several draft_model values)")
        return next(iter(drafts.values()), None)

    def _batch_dflash(self, requests: Sequence[_Request]):
        """The native DFlash drafter of the requests that draft with DFlash (None if none does)."""
        drafter = self._one_drafter(requests, True, "DFlash drafter")
        if drafter is not None and drafter.n_slots < self.n_seq_max:
            raise ValueError(f"the DFlash drafter {drafter.path} has {drafter.n_slots} slots: drafting for concurrent "
                             f"sequences needs one per sequence (n_seq_max = {self.n_seq_max})")
        return None if drafter is None else drafter._core

    def _batch_draft(self, requests: Sequence[_Request]):
        """The one draft Model of the requests that draft with one (None if none does)."""
        draft = self._one_drafter(requests, False, "draft model")
        if draft is not None and draft.n_seq_max < self.n_seq_max:
            raise ValueError(f"draft model {draft.path} has n_seq_max = {draft.n_seq_max}: drafting for concurrent "
                             f"sequences needs one slot per sequence (load it with n_seq_max={self.n_seq_max})")
        return draft

    @property
    def batch_spec_stats(self) -> dict[str, int]:
        """Speculation across the sequences of add_request's scheduler (else of the last generate_batch):
        verify_passes (target passes that verified drafts, each over every running sequence's rows),
        multi_draft_passes (those with drafts of 2+ sequences), mixed_passes (of those, the ones that
        accepted drafts and rejected drafts), max_drafting (the most sequences drafting in one pass)."""
        return dict(self._live().batch_spec_stats)

    def _grammar_constraint(self, grammar: Grammar):
        """The engine-side state of `grammar` at the start of a generation (a lazy grammar: before
        its trigger)."""
        if grammar.after_token is not None:
            from .lazy_grammar import LazyGrammarConstraint

            return LazyGrammarConstraint(self.tokenizer, grammar)
        from .constraint import GrammarConstraint

        return GrammarConstraint(self.tokenizer, grammar)

    def _constraint(self, request: _Request):
        """The engine-side state of the request's grammar and/or reasoning budget (None without either)."""
        budget = None if request.reasoning_budget is None else ReasoningBudget(
            self.tokenizer, request.reasoning_budget, request.prompt, request.reasoning_budget_message)
        if request.grammar is None:
            return budget
        grammar = self._grammar_constraint(request.grammar)
        if budget is None:
            return grammar
        from .constraint_pair import BothConstraints

        return BothConstraints(grammar, budget)

    @staticmethod
    def _add_grammar_stats(out: dict, constraint) -> dict:
        if constraint is not None:
            out["grammar_masked_rows"] = constraint.n_masked_rows
            out["grammar_cut_tokens"] = constraint.n_cut_tokens
            out["grammar_forced_tokens"] = constraint.n_forced_tokens
            out["grammar_draft_rows"] = constraint.n_draft_rows
        return out

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], per_prompt: Sequence[dict] | None = None,
                       **generate_kwargs: Any) -> list[GenerationResult]:
        """Generate continuations of several prompts concurrently, up to n_seq_max at a time (the
        rest wait for a slot): each prompt is prefilled, then every running sequence decodes in
        one batch per step. Each result equals generate(prompt, **generate_kwargs) alone (same
        tokens for greedy and for seeded sampling, on the CPU on one thread or with
        batch_invariant=True; see the README for where other kernels part at near-ties); sequences
        finish independently.

        generate_kwargs are generate()'s (max_tokens, temperature, ..., seed, stop), for every
        prompt; `per_prompt`, one dict per prompt, overrides them for that prompt (another
        max_tokens, seed, stop or grammar). spec_type="ngram-simple" (prompt lookup, draft_n_max,
        draft_n_min, tree_budget for n-gram draft trees), draft_model (a Model with n_seq_max slots;
        chains or trees), spec_type="dflash" (a DFlash drafter; chains or DDTree trees) or spec_type="mtp" (the
        model's MTP head, a head per sequence; chains or trees; not with DFlash in the same batch)
        speculates: every step verifies the drafts of all running sequences in one target pass, and
        each result equals generate() alone with the same speculation (greedy and seeded sampling; a
        sequence with a grammar drafts what it forces, its drafts cut or pruned by it, its verify rows
        masked, as alone). logprobs=k fills each result's logprobs
        and top_logprobs as generate()'s. stream=True raises ValueError. cancel() stops every sequence.
        `prediction` (text or ids, here or per prompt): the output the caller expects, which the
        sequence's prompt lookup drafts from (deltaspec.prediction)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise TypeError(f"prompts must be a non-empty list of prompts (str or token ids), got {prompts!r:.80}")
        if per_prompt is None:
            per_prompt = [{}] * len(prompts)
        if (isinstance(per_prompt, (str, bytes)) or not isinstance(per_prompt, Sequence) or len(per_prompt) != len(prompts)
                or not all(isinstance(d, dict) for d in per_prompt)):
            raise TypeError(f"per_prompt must be None or a list of {len(prompts)} dicts (one per prompt), "
                            f"got {per_prompt!r:.80}")
        requests = []
        for i, (p, extra) in enumerate(zip(prompts, per_prompt)):
            try:
                requests.append(self._batch_request(p, {**generate_kwargs, **extra}, "generate_batch"))
            except (TypeError, ValueError) as e:  # which of the prompts: its index first, same exception
                if e.args and isinstance(e.args[0], str):
                    e.args = (f"prompts[{i}]: {e.args[0]}", *e.args[1:])
                raise
        eog = sorted(self.tokenizer.eog_ids)
        constraints = [self._constraint(r) for r in requests]
        native = [(r.prompt, r.max_tokens, r.sampling.native(), [x.encode() for x in r.stop], c, self._native_spec(r),
                   r.n_logprobs) for r, c in zip(requests, constraints)]
        draft_model = self._batch_draft(requests)
        dflash = self._batch_dflash(requests)
        with engine_of(self) as engine, contextlib.ExitStack() as held:
            draft = None if draft_model is None else held.enter_context(engine_of(draft_model))
            self._cached_tokens = None  # the slots' states are the batch's now
            with self._control:
                engine.clear_cancel()
                self._batch_running = True
            try:
                outs = engine.generate_batch(native, eog, draft, dflash)
            finally:
                with self._control:
                    self._batch_running = False
        return [result_of(self.tokenizer, len(r.prompt), self._add_grammar_stats(out, c))[0]
                for r, out, c in zip(requests, outs, constraints)]

    # --- requests stepped by the caller (a server's loop) ----------------------------------------
    def add_request(self, prompt: str | Sequence[int], *, prompt_logprobs: bool = False, hidden_states: bool = False,
                    **generate_kwargs: Any) -> int:
        """Queue a request (generate()'s keyword arguments, no streaming; speculation and `prediction`
        as generate_batch's) for step(); returns its id. With logprobs=k each step's RequestOutput
        carries the log-probabilities of the tokens it committed, and the result all of them.
        prompt_logprobs=True (with logprobs=k) scores the prompt too (a completion's echo with
        logprobs): each prompt token's log-probability given the ones before it and the top k there,
        in the RequestOutput of the step that completes the prompt and in the result (max_tokens=0:
        nothing generated, the request finishes there with "length"). Such a prompt
        is evaluated whole (never resumed from a kept state), 128 rows (or n_ubatch, if fewer) at a
        time with every row's logits on the host (128 MB for Qwen3.5's vocabulary); its first token
        comes from those logits, whose head ran over every row: it is generate()'s where rows do
        not depend on the batch (batch_invariant=True), elsewhere it may differ at a near-tie.
        hidden_states=True reads the prompt's final hidden states instead (embeddings beside running
        requests): nothing is generated (max_tokens 0), and result.hidden_states holds them, one
        row per prompt token, as embeddings.hidden_states computes them alone.
        While requests are unfinished, one-sequence calls (generate, eval, ...)
        raise RuntimeError. A finished request's state stays in its slot while the slot is idle; a
        later request whose prompt begins with that request's prompt and output (a chat's next turn)
        resumes from it and prefills only the rest (result.stats.cached_tokens counts the tokens it
        skipped). A one-sequence call forgets every such state."""
        scored = validate_flag("prompt_logprobs", prompt_logprobs)
        if validate_flag("hidden_states", hidden_states):
            if scored or generate_kwargs.get("max_tokens", 0) != 0:
                raise ValueError("hidden_states=True reads the prompt alone: no prompt_logprobs, max_tokens 0 (or left out)")
            generate_kwargs = {**generate_kwargs, "max_tokens": 0}
        req = self._batch_request(prompt, generate_kwargs, "add_request", scored or hidden_states)
        if scored and req.n_logprobs < 0:
            raise ValueError("prompt_logprobs=True needs logprobs=k (how many top tokens each prompt entry lists)")
        constraint = self._constraint(req)
        draft_model = self._batch_draft([req])
        dflash = self._batch_dflash([req])
        with engine_of(self) as engine:
            self._cached_tokens = None
            # the scheduler keeps the draft model's engine for its requests (the caller keeps the Model)
            request_id = engine.add_request(req.prompt, req.max_tokens, req.sampling.native(),
                                            sorted(self.tokenizer.eog_ids), [x.encode() for x in req.stop],
                                            constraint=constraint, speculation=self._native_spec(req),
                                            draft=None if draft_model is None else draft_model._live(),
                                            dflash=dflash, n_logprobs=req.n_logprobs,
                                            prompt_logprobs=prompt_logprobs, hidden_states=hidden_states)
        self._request_prompts[request_id] = (req.prompt, constraint, req.n_logprobs >= 0)
        return request_id

    def step(self) -> list[RequestOutput]:
        """One scheduler step: waiting requests that find a free slot are prefilled, then every
        running request decodes one token (all in one batch). Returns what happened to each."""
        with engine_of(self) as engine:
            events = engine.step()
        out = []
        for ev in events:
            result = None
            prompt, constraint, wants_logprobs = self._request_prompts[ev["id"]]
            if ev["finished"]:
                del self._request_prompts[ev["id"]]
                result = result_of(self.tokenizer, len(prompt), self._add_grammar_stats(ev["result"], constraint))[0]
                result.prompt_logprobs = prompt_entries(prompt, ev["result"])
                if "hidden" in ev["result"]:
                    result.hidden_states = np.asarray(ev["result"]["hidden"]).reshape(-1, self.hparams.n_embd)
                if wants_logprobs and result.logprobs is None:  # it finished before its first token
                    result.logprobs, result.top_logprobs = [], []
            out.append(RequestOutput(ev["id"], list(ev["tokens"]), ev["finished"], result, step_logprobs(ev),
                                     prompt_entries(prompt, ev)))
        return out

    def cancel_request(self, request_id: int) -> None:
        """Cancel a request from add_request: it finishes at the next step with finish_reason
        "cancelled" and the tokens it has."""
        with engine_of(self) as engine:
            engine.cancel_request(request_id)

    def set_prefill_budget(self, n_tokens: int) -> None:
        """Prompt tokens one step() prefills at most (0, the default: every request that finds a
        slot, whole). The running requests decode in every step, so their tokens keep coming while
        new prompts arrive; a prompt that does not fit is split over steps (its request decodes
        once its prompt is complete, and waiting requests are admitted after it)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"prefill budget must be an integer >= 0 (0: no limit), got {n_tokens!r}")
        self._live().set_prefill_budget(n_tokens)

    @property
    def has_unfinished_requests(self) -> bool:
        return self._live().n_requests > 0

    def cancel(self) -> None:
        """Stop the generation running on this model, from any thread (or from a stream's loop):
        generate() returns, or the stream ends, with finish_reason "cancelled" and the tokens made
        so far. Does nothing when no generation runs."""
        active = self._active()
        if active is not None:
            active.cancel()
        with self._control:
            if self._batch_running:
                self._live().cancel()

    def create_completion(self, prompt: str | Sequence[int], stream: bool = False, max_tokens: int | None = 16,
                          **kwargs: Any):
        """OpenAI-shaped completion dict (chunk dicts when streaming), as llama-cpp-python's."""
        return completions.create_completion(self, prompt, stream=stream, max_tokens=max_tokens, **kwargs)

    def create_chat_completion(self, messages: Sequence[dict], stream: bool = False, **kwargs: Any):
        """OpenAI-shaped chat completion rendered with the GGUF's chat template; see
        deltaspec.completions.create_chat_completion for the options (tools, enable_thinking, ...)."""
        return completions.create_chat_completion(self, messages, stream=stream, **kwargs)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text a chat completion would send to the model."""
        return completions.apply_chat_template(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def _speculation(self, spec_type, draft_model, n_max, n_min, tree_budget=0) -> Speculation | None:
        if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or not 0 <= tree_budget <= 256:
            raise ValueError(f"tree_budget must be an integer in [0, 256], got {tree_budget!r}")
        if spec_type is None and draft_model is None:
            if tree_budget:
                raise ValueError("tree_budget drafts trees for speculative decoding: pass draft_model or spec_type too")
            return None
        if spec_type is None:
            spec_type = "draft-simple"
        if spec_type not in SPEC_TYPES:
            raise ValueError(f"spec_type must be one of {SPEC_TYPES} or None, got {spec_type!r}")
        for name, v, lo in (("draft_n_max", n_max, 1), ("draft_n_min", n_min, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 256:
                raise ValueError(f"{name} must be an integer in [{lo}, 256], got {v!r}")
        if n_min > n_max:
            raise ValueError(f"draft_n_min ({n_min}) must not exceed draft_n_max ({n_max})")
        if spec_type in ("mtp", "draft-mtp"):
            if draft_model is not None:
                raise ValueError(f"spec_type {spec_type!r} drafts with this model's own MTP head; do not pass draft_model")
            if not self._engine.has_mtp:
                raise ValueError(f"spec_type {spec_type!r}: {self.path} has no MTP layer "
                                 "(qwen35.nextn_predict_layers is 0; convert the checkpoint with its MTP weights)")
            return Speculation(None, n_max, n_min, tree_budget=tree_budget, mtp=True)
        if spec_type == "ngram-simple":
            if draft_model is not None:
                raise ValueError("spec_type 'ngram-simple' drafts from the text itself; do not pass draft_model")
            return Speculation(None, n_max, n_min, tree_budget=tree_budget)
        if spec_type in ("dflash", "draft-dflash"):
            return self._dflash_speculation(draft_model, n_max, n_min, tree_budget)
        if draft_model is None:
            raise ValueError("spec_type 'draft-simple' needs draft_model (a Model or a GGUF path)")
        if not isinstance(draft_model, (Model, str, os.PathLike)):
            raise TypeError(f"draft_model must be a Model or a GGUF path, got {type(draft_model).__name__} "
                            f"{draft_model!r}")
        if not isinstance(draft_model, Model):
            draft_model = self._draft_cache(draft_model)
        if draft_model is self:
            raise ValueError("the draft model must be a separate Model instance (load the file twice to self-draft)")
        if not draft_model.tokenizer.same_vocabulary(self.tokenizer):
            raise ValueError(f"draft model {draft_model.path} has a different vocabulary than {self.path}: "
                             "draft and target must share the tokenizer")
        return Speculation(draft_model, n_max, n_min, tree_budget=tree_budget)

    # --- llama-cpp-python's other calls ----------------------------------------------------------
    def __call__(self, prompt: str | Sequence[int], **kwargs: Any):
        """create_completion(prompt, **kwargs), as llama-cpp-python's `llm(prompt, ...)`."""
        return self.create_completion(prompt, **kwargs)

    def embed(self, input: str | Sequence[str], normalize: bool = False, pooling: str = "last",
              return_count: bool = False):
        """The final hidden state of each text, pooled (see deltaspec.embeddings: "last" token by
        default, "mean", or "none" for one vector per token); normalize=True makes each vector unit
        length. Runs on a fresh sequence and leaves it empty."""
        return embeddings.embed(self, input, normalize=normalize, pooling=pooling, return_count=return_count)

    def create_embedding(self, input: str | Sequence[str], model: str | None = None, **kwargs: Any) -> dict:
        """OpenAI-shaped embeddings (`{"object": "list", "data": [...], "usage": ...}`) of embed()."""
        return embeddings.create_embedding(self, input, model_name=model, **kwargs)

    def save_state(self) -> session_state.LlamaState:
        """A snapshot of the sequence (its tokens, KV rows and recurrent state) for load_state()."""
        return session_state.save(self)

    def load_state(self, state: session_state.LlamaState) -> None:
        """Restore a save_state() snapshot: a generate() whose prompt extends its tokens evaluates only
        the new ones (result.stats.cached_tokens says how many it skipped)."""
        session_state.load(self, state)

    def _dflash_speculation(self, draft_model, n_max, n_min, tree_budget=0) -> Speculation:
        from .dflash import Drafter

        if draft_model is None:
            raise ValueError("spec_type 'dflash' needs draft_model (a deltaspec.dflash.Drafter or a DFlash GGUF path)")
        if isinstance(draft_model, (str, os.PathLike)):
            path = os.fspath(draft_model)
            cached = self.__dict__.setdefault("_dflash_drafters", {})
            if path not in cached:
                cached[path] = Drafter(path, target=self)
            draft_model = cached[path]
        if not isinstance(draft_model, Drafter):
            raise TypeError(f"spec_type 'dflash': draft_model must be a deltaspec.dflash.Drafter or a GGUF path, "
                            f"got {type(draft_model).__name__} {draft_model!r}")
        if draft_model.target is not self:
            raise ValueError(f"the DFlash drafter {draft_model.path} was loaded for another target model")
        # a block predicts block_size - 1 tokens: longer drafts do not exist (llama.cpp clamps too)
        n_max = min(n_max, draft_model.block_size - 1)
        return Speculation(draft_model, n_max, min(n_min, n_max), tree_budget=tree_budget, dflash=True)

    def _draft_cache(self, path) -> "Model":
        """A draft Model loaded from a path once and kept with this model."""
        path = os.fspath(path)
        cached = getattr(self, "_draft_models", {})
        if path not in cached:
            # as many slots as this model: generate_batch / add_request draft for every sequence
            cached[path] = Model(path, n_ctx=self.n_ctx, n_threads=self.n_threads, device=self.device,
                                 n_seq_max=self.n_seq_max)
            self._draft_models = cached
        return cached[path]

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            ids = self.tokenize(prompt, special=True)
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__} "
                            f"{prompt!r:.80}")
        else:
            ids = self._token_array(prompt, "prompt").tolist()
        if len(ids) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                             "(n_ctx); shorten the prompt or load the model with a larger n_ctx")
        return ids

    def _token_array(self, ids: Sequence[int], what: str = "ids", allow_empty: bool = False) -> np.ndarray:
        if isinstance(ids, (str, bytes, bytearray)):  # np.asarray would make a 0-d string array
            raise TypeError(f"{what} must be a sequence of token ids, got {type(ids).__name__} {ids!r:.80}")
        try:
            arr = np.asarray(ids)
        except ValueError:  # ragged nesting
            arr = np.empty((0, 0))
        if arr.ndim != 1 or (len(arr) == 0 and not allow_empty):
            raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids")
        if len(arr) == 0:
            return arr.astype(np.int32)
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"token ids ({what}) must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.n_vocab))
        if len(bad):
            raise ValueError(f"token id {int(arr[bad[0]])} at index {int(bad[0])} is outside the vocabulary "
                             f"[0, {self.n_vocab})")
        return arr.astype(np.int32)

    # --- lifetime ------------------------------------------------------------------------------
    def _live(self):
        if self._engine is None:
            raise RuntimeError("the model is closed")
        return self._engine

    def close(self) -> None:
        """Free the weights and state now rather than at garbage collection."""
        self._engine = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        return (f"Model({self.path!r}, n_layer={hp.n_layer}, n_embd={hp.n_embd}, n_vocab={hp.n_vocab}, "
                f"device={getattr(self, 'device', '?')!r})")


# generate()'s keyword arguments and defaults: what generate_batch and add_request take
_GENERATE_DEFAULTS = {name: p.default for name, p in inspect.signature(Model.generate).parameters.items()
                      if name not in ("self", "prompt")}
