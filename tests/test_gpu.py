"""CUDA against CPU on the tiny parity models (runs only where a CUDA build and a GPU exist).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu.py

ggml's CUDA backend multiplies F32 weights in TF32 (cuBLAS math mode and its mma kernels), so
CUDA logits of an f32 model differ from the CPU's by a few 1e-3 relative (measured on the H200:
1.9e-3 to 6.3e-3; exactly bf16-representable weights, which TF32 keeps, gave the low end). The
tests therefore bound the error at 1e-2 and allow argmax / greedy differences only at near-ties,
which they report.
"""

import os

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.convert import convert_hf_to_gguf
from deltaspec.testing.tiny_models import TINY_CONFIGS, tiny_model_dir

NEAR_TIE = 1e-2  # top-2 logit gap, relative to the largest |logit|, below which argmax may flip


def _cuda_available() -> bool:
    from deltaspec import _core

    return _core.has_device("cuda")


# A skipif mark, not a module-level skip: -m "not gpu" then deselects these tests instead of reporting
# a skip, which fails a CI=true run (tests/ci_skips.py).
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]


def recurrent_state(engine):
    """The live conv and DeltaNet states, name -> float32 values."""
    return {k: np.frombuffer(v, dtype=np.float32).copy() for k, v in engine.state_arrays().items()
            if k.startswith(("ssm", "conv"))}


def assert_parts_only_at_near_tie(reference, prompt, a, b, label):
    """Greedy token lists a and b may part only where `reference` (the model that produced a) has
    its top-2 logits within NEAR_TIE of each other."""
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    logits = reference.logits(prompt + a[:i])[-1]
    top2 = np.sort(logits)[-2:]
    gap = (top2[1] - top2[0]) / np.abs(logits).max()
    print(f"{label} diverge at token {i}, top-2 gap {gap:.2e} of max |logit|")
    assert gap < NEAR_TIE, f"{label}: diverged at token {i} where the top-2 gap is {gap:.2e}, not a near-tie"


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / f"{request.param}.gguf"
    convert_hf_to_gguf(tiny_model_dir(request.param), path, outtype="f32")
    kw = dict(n_ctx=512, n_ubatch=32, type_k="f32", type_v="f32")
    with Model(path, device="cpu", **kw) as cpu, Model(path, device="cuda", **kw) as gpu:
        yield request.param, cpu, gpu


def test_cuda_logits_match_cpu(pair, record_property):
    name, cpu, gpu = pair
    ids = np.random.default_rng(1).integers(0, 248000, size=100).tolist()
    a, b = cpu.logits(ids), gpu.logits(ids)
    rel = np.abs(a - b).max() / np.abs(a).max()
    record_property("max_rel_error", float(rel))
    print(f"{name}: max |cpu - cuda| / max |cpu| = {rel:.3g}")
    assert rel < 1e-2
    top2 = np.sort(a, axis=-1)[:, -2:]
    near_tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE * np.abs(a).max()
    mismatch = (a.argmax(-1) != b.argmax(-1)) & ~near_tie
    assert not mismatch.any(), f"argmax differs away from near-ties at {np.flatnonzero(mismatch).tolist()}"


def test_cuda_greedy_equals_cpu(pair):
    name, cpu, gpu = pair
    prompt = cpu.tokenize("The history of the printing press")
    a = cpu.generate(prompt, max_tokens=64, temperature=0).tokens
    b = gpu.generate(prompt, max_tokens=64, temperature=0).tokens
    assert_parts_only_at_near_tie(cpu, prompt, a, b, f"{name}: CPU and CUDA greedy")


def test_cuda_decode_matches_prefill(pair):
    name, cpu, gpu = pair
    ids = np.random.default_rng(2).integers(0, 248000, size=60).tolist()
    full = gpu.logits(ids)
    gpu.reset()
    rows = [gpu.eval(ids[:21], logits="all")] + [gpu.eval([t], logits="all") for t in ids[21:]]
    # batched prefill goes through cuBLAS (TF32), single tokens through ggml's f32 mat-vec kernels
    assert np.abs(np.concatenate(rows) - full).max() / np.abs(full).max() < 1e-2


@pytest.fixture(scope="module")
def tiny_vocab_gpu(tmp_path_factory):
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    root = tmp_path_factory.mktemp("gpu-spec")
    paths = {"target": write_tiny_vocab_model(root / "target.gguf", seed=0),
             "random": write_tiny_vocab_model(root / "random.gguf", seed=1),
             "repeating": write_tiny_vocab_model(root / "repeating.gguf", seed=0, branch_scale=0.0)}
    kw = dict(n_ctx=512, device="cuda")
    models = {name: Model(p, **kw) for name, p in paths.items()}
    models["self"] = Model(paths["target"], **kw)
    yield models
    for m in models.values():
        m.close()


@pytest.mark.parametrize("drafter", ["self", "random", "ngram"])
def test_cuda_speculative_greedy_equals_plain(tiny_vocab_gpu, drafter):
    from deltaspec.testing.tiny_vocab import cycle_prompt

    m = tiny_vocab_gpu
    target = m["repeating"] if drafter == "ngram" else m["target"]
    spec = dict(spec_type="ngram-simple") if drafter == "ngram" else dict(draft_model=m[drafter], draft_n_min=1)
    rng = np.random.default_rng(4)
    if drafter == "ngram":  # the repeating model's own cycles, twice
        prompts = []
        for start in range(32, 256):
            try:
                prompts.append(cycle_prompt(target, start))
            except ValueError:
                continue
        prompts = prompts[:20]
    else:
        prompts = [rng.integers(0, 256, size=12).tolist() for _ in range(20)]
    drafted = accepted = 0
    for k, prompt in enumerate(prompts):
        plain = target.generate(prompt, max_tokens=64, temperature=0).tokens
        fast = target.generate(prompt, max_tokens=64, temperature=0, draft_n_max=8, **spec)
        # a verify batch runs other kernels than a one-token step (TF32 GEMM vs mat-vec)
        assert_parts_only_at_near_tie(target, prompt, plain, fast.tokens, f"{drafter} prompt {k}: plain and spec")
        drafted += fast.stats.n_drafted
        accepted += fast.stats.n_accepted
    print(f"{drafter}: acceptance {accepted}/{drafted}")
    assert drafted > 0
    if drafter in ("self", "ngram"):
        assert accepted / drafted > 0.9


# (quant, tiny shape, tokens per eval): one token per eval is a decode step (our Q4_K / Q6_K
# mat-vecs), 5 and 17 are verify-sized batches (our Q4_K / Q6_K tensor-core kernels, in place of
# ggml's mat-vec and of its tile kernels respectively). Q6_K rows must be multiples of 1024 for ours.
Q4K_SHAPE, Q6K_SHAPE = dict(n_embd=256, n_ff=512), dict(n_embd=1024, n_ff=1024)
KERNEL_CASES = [(q, shape, n) for q, shape in (("q4_k", Q4K_SHAPE), ("q6_k", Q6K_SHAPE)) for n in (1, 5, 17)]


@pytest.mark.parametrize("quant,shape,chunk", KERNEL_CASES, ids=[f"{q}-{n}tok" for q, _, n in KERNEL_CASES])
def test_cuda_kernels_match_cpu(tmp_path, monkeypatch, quant, shape, chunk):
    """deltaspec's CUDA kernels (ggml/cuda/) in the engine: logits of every position on a k-quant
    tiny model, against the CPU and against ggml's own CUDA kernels (DELTASPEC_CUDA_KERNELS=0).
    The paths round x differently (ours: int8 per 16 values for one column, per 256 for several;
    ggml CUDA: q8_1 per 32; CPU: q8_K per 256), and 4 random layers amplify that: the largest
    logit difference to the CPU measured several % of the logit range for every path, ours or
    ggml's, and its maximum is too noisy to compare (H200: Q4_K, 17 tokens per eval, ours 1.5e-1
    vs ggml 7.1e-2, with the same argmax agreement). So: ours must be as close to the CPU on
    average as ggml's own CUDA path (mean |difference|), and where ours picks another argmax than
    the CPU, the CPU's top two logits must be a near-tie at the scale of that rounding noise (a
    wrong row or block would move logits far more)."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    # the matrices with >= 256 rows of whole blocks (ffn gate/up/down, attention q, the head, ...)
    # go to our kernels; the rest stays with ggml
    path = write_tiny_vocab_model(tmp_path / f"{quant}.gguf", seed=0, quant=quant, **shape)
    ids = np.random.default_rng(5).integers(0, 256, size=51).tolist()

    def logits(device):
        with Model(path, device=device, n_ctx=256) as m:
            return np.concatenate([m.eval(ids[i:i + chunk], logits="all") for i in range(0, len(ids), chunk)])

    cpu = logits("cpu")
    ours = logits("cuda")
    monkeypatch.setenv("DELTASPEC_CUDA_KERNELS", "0")
    ggml = logits("cuda")
    monkeypatch.delenv("DELTASPEC_CUDA_KERNELS")
    err_ours, err_ggml = np.abs(ours - cpu).mean(), np.abs(ggml - cpu).mean()
    noise = np.sqrt(np.mean((ours - cpu) ** 2))
    flips = np.nonzero(ours.argmax(-1) != cpu.argmax(-1))[0]
    gaps = cpu[flips].max(-1) - cpu[flips, ours.argmax(-1)[flips]]
    print(f"{quant}, {chunk} token(s) per eval, mean |difference| to the CPU: ours {err_ours:.3e}, ggml CUDA "
          f"{err_ggml:.3e} (ours vs ggml {np.abs(ours - ggml).mean():.3e}); argmax unlike the CPU's at "
          f"{len(flips)} of {len(ids)} positions, CPU top-2 gaps there {np.round(gaps, 4).tolist()} "
          f"(rms difference {noise:.3e})")
    assert np.abs(ours - ggml).max() > 0  # the switch took effect: the two GPU paths round differently
    assert err_ours <= 1.5 * err_ggml
    assert np.all(gaps <= 6 * noise)


FOLD_CASES = [(q, shape, n) for q, shape in (("q4_k", Q4K_SHAPE), ("q6_k", Q6K_SHAPE)) for n in (1, 17)]


@pytest.mark.parametrize("quant,shape,chunk", FOLD_CASES, ids=[f"{q}-{n}tok" for q, _, n in FOLD_CASES])
def test_folded_norms_and_stacks_match(tmp_path, monkeypatch, quant, shape, chunk):
    """One-token steps and 17-token batches with the norms (and, for 17, the SwiGLUs and residual
    adds) folded into our kernels (DELTASPEC_FOLD_INPUTS: the mat-vecs', or the tensor-core kernels'
    x quantization and stores) and the input projections stacked (DELTASPEC_STACK_PROJECTIONS),
    against both switched off. The fold only moves where x is scaled (x * w quantized, 1/rms
    applied to the scales; silu(gate) * up computed before quantizing as ggml's swiglu would; the
    residual added as the product is stored) and the stacks only group
    rows (alpha/beta leave the split-K kernel), which changes rounding alone; 4 random layers
    amplify any rounding change to the level of the GPU's own difference to the CPU (H200, Q4_K:
    7.6e-2 moved vs 8.9e-2 to the CPU). A wrong norm weight, eps or row offset moves logits by
    their whole spread instead. So: moved no more than the GPU-CPU noise, as close to the CPU as
    the plain path, argmax changed only at near-ties."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    path = write_tiny_vocab_model(tmp_path / f"{quant}.gguf", seed=1, quant=quant, **shape)
    ids = np.random.default_rng(6).integers(0, 256, size=40).tolist()

    def logits(device):
        with Model(path, device=device, n_ctx=128) as m:
            return np.concatenate([m.eval(ids[i:i + chunk], logits="all") for i in range(0, len(ids), chunk)])

    cpu = logits("cpu")
    fast = logits("cuda")
    monkeypatch.setenv("DELTASPEC_FOLD_INPUTS", "0")
    monkeypatch.setenv("DELTASPEC_STACK_PROJECTIONS", "0")
    plain = logits("cuda")
    moved, noise = np.abs(fast - plain).mean(), np.abs(plain - cpu).mean()
    print(f"{quant}, {chunk} token(s) per eval: mean |folded+stacked - plain| {moved:.3e}, "
          f"mean |plain - CPU| {noise:.3e}")
    assert 0 < moved <= 1.5 * noise  # > 0: the switches took effect
    assert np.abs(fast - cpu).mean() <= 1.5 * noise
    flips = np.nonzero(fast.argmax(-1) != plain.argmax(-1))[0]  # only where plain has a near-tie
    assert np.all(plain[flips].max(-1) - plain[flips, fast.argmax(-1)[flips]] <= 6 * np.sqrt(np.mean((fast - plain) ** 2)))


@pytest.mark.parametrize("quant,shape", [("q4_k", Q4K_SHAPE), ("q6_k", Q6K_SHAPE)], ids=["q4_k", "q6_k"])
def test_mma_tilings_agree(tmp_path, monkeypatch, quant, shape):
    """The tensor-core kernels with 1, 2 and 4 tiles of 16 rows per thread block
    (DELTASPEC_MMA_ROW_TILES; Q6_K takes at most 2) and with a tile's k shared by 1..4 thread
    blocks of a cluster (DELTASPEC_MMA_K_SPLIT; with the tiny models' short rows some blocks of a
    cluster get no k at all), on 17-token batches: the tiny models' few rows make the automatic
    choice 1 and 1, so the others are forced here. The warps split the blocks differently, so only
    the order of the float sums changes; a wrong tile offset, a warp summed into the wrong tile or
    a cluster's partial sums lost or added twice would move logits by their whole spread. So: no
    further from one tile and one block than the GPU is from the CPU, argmax changed only at
    near-ties. And a value that is not a tile count or split is refused when the model loads."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    path = write_tiny_vocab_model(tmp_path / f"{quant}.gguf", seed=2, quant=quant, **shape)
    ids = np.random.default_rng(7).integers(0, 256, size=34).tolist()

    def logits(device, tiles="0", split="0"):
        monkeypatch.setenv("DELTASPEC_MMA_ROW_TILES", tiles)
        monkeypatch.setenv("DELTASPEC_MMA_K_SPLIT", split)
        with Model(path, device=device, n_ctx=128) as m:
            return np.concatenate([m.eval(ids[i:i + 17], logits="all") for i in range(0, len(ids), 17)])

    cpu = logits("cpu")
    one = logits("cuda", "1", "1")
    noise = np.abs(one - cpu).mean()
    for tiles, split in [("2", "1"), ("4", "1"), ("1", "2"), ("1", "3"), ("1", "4"), ("2", "2")]:
        other = logits("cuda", tiles, split)
        moved = np.abs(other - one).mean()
        print(f"{quant}, {tiles} row tiles, k split {split}: mean |difference| to 1 and 1 {moved:.3e}, "
              f"1 and 1 to the CPU {noise:.3e}")
        assert moved <= 1.5 * noise
        flips = np.nonzero(other.argmax(-1) != one.argmax(-1))[0]
        gaps = one[flips].max(-1) - one[flips, other.argmax(-1)[flips]]
        assert np.all(gaps <= 6 * max(np.sqrt(np.mean((other - one) ** 2)), 1e-6))
    for var, bad in (("DELTASPEC_MMA_ROW_TILES", "3"), ("DELTASPEC_MMA_K_SPLIT", "5")):
        monkeypatch.setenv("DELTASPEC_MMA_ROW_TILES", "0")
        monkeypatch.setenv("DELTASPEC_MMA_K_SPLIT", "0")
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            Model(path, device="cuda", n_ctx=128)


@pytest.mark.parametrize("quant,shape", [("q4_k", Q4K_SHAPE), ("q6_k", Q6K_SHAPE)], ids=["q4_k", "q6_k"])
def test_wide_products_in_pieces(tmp_path, monkeypatch, quant, shape):
    """Batches of 41 and 96 tokens with products up to 128 columns on our tensor-core kernels
    (DELTASPEC_MMA_MAX_COLUMNS=128: launches of 21 + 20 and 3 x 32 columns, the folded norms,
    SwiGLUs and residual adds with them) against the default, where ggml's mmq takes every product
    over 32 columns: the paths round x differently (ours per 256 values, mmq per 32), so they differ
    (> 0: the switch took effect), but no further from the CPU on average than ggml's path, and the
    argmax moves only at near-ties; a piece's column offset wrong for x, y, the SwiGLU's up half or
    the residual would move whole rows of logits. A value that is not a listed width is refused."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    path = write_tiny_vocab_model(tmp_path / f"{quant}.gguf", seed=3, quant=quant, **shape)
    ids = np.random.default_rng(8).integers(0, 256, size=137).tolist()

    def logits(device, max_columns="0"):
        monkeypatch.setenv("DELTASPEC_MMA_MAX_COLUMNS", max_columns)
        with Model(path, device=device, n_ctx=256) as m:
            return np.concatenate([m.eval(ids[:41], logits="all"), m.eval(ids[41:], logits="all")])

    cpu = logits("cpu")
    ggml = logits("cuda")
    wide = logits("cuda", "128")
    err_wide, err_ggml = np.abs(wide - cpu).mean(), np.abs(ggml - cpu).mean()
    print(f"{quant}: mean |difference| to the CPU, pieces {err_wide:.3e}, ggml's mmq {err_ggml:.3e}")
    assert np.abs(wide - ggml).max() > 0
    assert err_wide <= 1.5 * err_ggml
    flips = np.nonzero(wide.argmax(-1) != cpu.argmax(-1))[0]
    gaps = cpu[flips].max(-1) - cpu[flips, wide.argmax(-1)[flips]]
    assert np.all(gaps <= 6 * np.sqrt(np.mean((wide - cpu) ** 2)))
    monkeypatch.setenv("DELTASPEC_MMA_MAX_COLUMNS", "100")
    with pytest.raises(ValueError, match="DELTASPEC_MMA_MAX_COLUMNS"):
        Model(path, device="cuda", n_ctx=128)


def test_deltanet_verify_kernel_matches_ggml(tmp_path, monkeypatch):
    """Verify batches' DeltaNet recurrence and keep()'s replay of it in our kernels
    (ggml/cuda/deltaspec_deltanet.cu: 4 columns a warp, reduced together in the order of ggml's
    warp sums, each chunk of tokens' inputs staged in shared memory, ggml's math expression for
    expression) against ggml's kernel, in the verify graph and in keep()'s replay graph
    (DELTASPEC_CUDA_DELTANET=0): every row's logits, the state keep() rolls forward to (6 of the
    batch's 17 tokens) and the step after it; then a 9-token batch kept whole (keep(T) copies the
    op's last state) and the step after it. The tiny model gets the real
    models' 128-value DeltaNet heads (the only size our kernel serves), and 2 k-heads for 4
    v-heads (the op's head broadcast). The same sums in the same order give the same bits; the
    bound below only forgives a compiler contracting one multiply-add differently (an index
    off by one moves logits by their whole spread)."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    path = write_tiny_vocab_model(tmp_path / "s128.gguf", seed=3, ssm_state=128, ssm_k_heads=2, ssm_v_heads=4)
    rng = np.random.default_rng(8)
    prefix, batch = rng.integers(0, 256, size=20).tolist(), rng.integers(0, 256, size=17).astype(np.int32)

    def run(flag):
        monkeypatch.setenv("DELTASPEC_CUDA_DELTANET", flag)
        with Model(path, device="cuda", n_ctx=256) as m:
            engine = m._live()
            engine.reserve_slots(len(batch))
            m.eval(prefix)
            launches = _core.cuda_deltanet_launches()
            verify = engine.eval_verify(batch)
            # the switch took effect: ours ran for the verify batch and the replay, or did not
            assert (_core.cuda_deltanet_launches() > launches) == (flag == "1")
            launches = _core.cuda_deltanet_launches()
            engine.keep(6)
            assert (_core.cuda_deltanet_launches() > launches) == (flag == "1")
            state = recurrent_state(engine)
            after = m.eval([99])
            engine.eval_verify(batch[:9])
            engine.keep(9)
            state |= {"all." + k: v for k, v in recurrent_state(engine).items()}
            return verify, state, np.concatenate([after, m.eval([7])])

    (ours, ours_state, ours_next), (ggml, ggml_state, ggml_next) = run("1"), run("0")
    bitwise = np.array_equal(ours, ggml) and np.array_equal(ours_next, ggml_next) and all(
        np.array_equal(ours_state[k], ggml_state[k]) for k in ggml_state)
    print(f"verify logits max |ours - ggml| {np.abs(ours - ggml).max():.3e} (spread {np.ptp(ggml):.3e}); "
          f"bitwise equal everywhere: {bitwise}")
    for a, b in [(ours, ggml), (ours_next, ggml_next)] + [(ours_state[k], ggml_state[k]) for k in ggml_state]:
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_early_launch_changes_no_bits(tmp_path, monkeypatch):
    """Our kernels launched early (programmatic dependent launch, gemv_common.cuh: first weight
    loads issued while the kernel before still runs, activations read and results written only
    after waiting for it) against each launched after the whole kernel before (DELTASPEC_CUDA_PDL=0).
    Only the schedule differs, so decode steps, a 17-token verify batch (tensor-core products, x
    quantization, the DeltaNet kernel, the conv input's concatenation), the state keep() rolls
    back to and the step after it must be bitwise equal; a read before the wait would see a
    half-written input and change them."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    path = write_tiny_vocab_model(tmp_path / "early.gguf", seed=4, quant="q4_k", ssm_state=128, ssm_k_heads=2,
                                  ssm_v_heads=4, **Q4K_SHAPE)
    rng = np.random.default_rng(9)
    prefix, batch = rng.integers(0, 256, size=20).tolist(), rng.integers(0, 256, size=17).astype(np.int32)

    def run(flag):
        monkeypatch.setenv("DELTASPEC_CUDA_PDL", flag)
        with Model(path, device="cuda", n_ctx=256) as m:
            engine = m._live()
            engine.reserve_slots(len(batch))
            steps = [m.eval(prefix)] + [m.eval([t]) for t in (3, 141, 59)]  # the last two replay a CUDA graph
            verify = engine.eval_verify(batch)
            engine.keep(6)
            return np.concatenate(steps), verify, recurrent_state(engine), m.eval([99])

    (early_steps, early_verify, early_state, early_next) = run("1")
    (plain_steps, plain_verify, plain_state, plain_next) = run("0")
    assert np.array_equal(early_steps, plain_steps)
    assert np.array_equal(early_verify, plain_verify)
    assert np.array_equal(early_next, plain_next)
    for k in plain_state:
        assert np.array_equal(early_state[k], plain_state[k]), k


def test_pairs_change_no_bits(tmp_path, monkeypatch):
    """A layer's two input projections of one x (a Q6_K attn_qkv or attn_v beside the Q4_K stack
    of the rest, as Q4_K_M has them) computed as a pair (deltaspec_matmul.cu run_pair: x quantized
    once in both kernels' layouts, the second product launched by the first's call and skipped by
    its own) against each product on its own (DELTASPEC_MMA_PAIRS=0). Each product reads the bytes
    its own quantization gives, so prefill chunks, verify batches of 5 and 17 rows (ggml's
    mat-vec and tile entries), the state keep() rolls back to and the step after it must be
    bitwise equal, and pairs must have run (cuda_pair_count: 2 per batch here, layers 0 and 3).
    Its power, checked here too: with DELTASPEC_TEST_PAIR_BUG=layout the second product reads x
    in the first's layout, and the logits move."""
    from deltaspec import _core
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if not _core.cuda_kernels_available():
        pytest.skip("this ggml-cuda does not carry deltaspec's kernels")
    # layers 0-2 DeltaNet, 3 attention; Q6_K rows of 1024 (our Q6_K kernel's rows)
    mixed = {"blk.0.attn_qkv.weight": "q6_k", "blk.3.attn_v.weight": "q6_k"}
    path = write_tiny_vocab_model(tmp_path / "pairs.gguf", seed=5, quant="q4_k", tensor_quant=mixed, **Q6K_SHAPE)
    rng = np.random.default_rng(10)
    prefix, batch = rng.integers(0, 256, size=20).tolist(), rng.integers(0, 256, size=17).astype(np.int32)

    def run(pairs, bug=""):
        monkeypatch.setenv("DELTASPEC_MMA_PAIRS", pairs)
        monkeypatch.setenv("DELTASPEC_TEST_PAIR_BUG", bug)
        before = _core.cuda_pair_count()
        with Model(path, device="cuda", n_ctx=256) as m:
            engine = m._live()
            engine.reserve_slots(len(batch))
            steps = [m.eval(prefix, logits="all"), m.eval([3, 141, 59, 26, 53], logits="all"), m.eval([7])]
            verify = engine.eval_verify(batch)
            engine.keep(6)
            out = np.concatenate(steps), verify, recurrent_state(engine), m.eval([99])
        return out, _core.cuda_pair_count() - before

    (paired, n_paired), (plain, n_plain) = run("1"), run("0")
    print(f"pairs computed: {n_paired} (paired run), {n_plain} (pairs off)")
    assert n_paired >= 2 * 3 and n_plain == 0  # 2 per batch: the prefill, the 5-row eval, the verify
    for a, b in zip(paired[:2] + paired[3:], plain[:2] + plain[3:]):
        assert np.array_equal(a, b)
    for k in plain[2]:
        assert np.array_equal(paired[2][k], plain[2][k]), k
    planted, _ = run("1", bug="layout")
    moved = np.abs(planted[0] - plain[0]).max()
    print(f"planted layout bug: max |logit change| {moved:.3e}")
    assert moved > 1e-3 * np.abs(plain[0]).max()


def test_ggml_debug_log_quiet_by_default(tmp_path):
    """ggml prints every log level unless told otherwise, among them a debug line per replayed CUDA
    graph: a line on stderr per decoded token. deltaspec keeps warnings and errors only unless
    DELTASPEC_GGML_LOG asks for more (a fresh process each way: the level is read at import)."""
    import subprocess
    import sys

    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path / "m.gguf", seed=0)
    code = ("import sys; from deltaspec import Model\n"
            "with Model(sys.argv[1], device='cuda', n_ctx=128) as m:\n"
            "    m.generate([1, 2, 3], max_tokens=16, temperature=0.0)\n")

    def stderr(level):
        env = {k: v for k, v in os.environ.items() if k != "DELTASPEC_GGML_LOG"}
        if level is not None:
            env["DELTASPEC_GGML_LOG"] = level
        done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    assert "CUDA Graph id" in stderr("debug")  # the message this is about does exist
    quiet = stderr(None)
    assert "CUDA Graph id" not in quiet and "ggml_cuda_init" not in quiet, quiet[-2000:]


# --- KV cache types on CUDA ---------------------------------------------------------------------------
# Every (type_k, type_v) pair CUDA runs (kv_cache.supported_pairs("cuda"): every pair of the types
# ggml-cuda's flash attention takes, ggml_cuda_fattn_kv_type_supported in ggml/src/ggml-cuda/fattn.cu,
# i.e. all but iq4_nl), on test_kv_cache_types' model and prompt. A batch (the 100-token prompt) runs
# FA's tensor-core kernel, which converts a quantized K/V to F16 first; one-token steps run the
# vector kernel where the pair is compiled in (CUDA_VEC_PAIRS_DEFAULT) and ggml's F16 conversion
# otherwise, so both paths are compared.
from deltaspec.kv_cache import CACHE_TYPES, supported_pairs  # noqa: E402
from test_kv_cache_types import N_CTX, PROMPT, _pair_tolerance, check_allocated  # noqa: E402

CUDA_KV_PAIRS = sorted(supported_pairs("cuda"))
CUDA_REFUSED_PAIRS = sorted({(k, v) for k in CACHE_TYPES for v in CACHE_TYPES} - set(CUDA_KV_PAIRS))
KV_STEPS = np.random.default_rng(3).integers(0, 256, size=16).tolist()  # fed one at a time after PROMPT


@pytest.fixture(scope="module")
def kv_model():
    from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

    return tiny_vocab_model_path(n_layer=8, n_head=4, n_head_kv=1)


def kv_run(path, device, type_k, type_v):
    """(kv_cache_info(), logits of PROMPT's 100 positions and of KV_STEPS' 16 one-token steps)."""
    with Model(path, device=device, n_ctx=N_CTX, n_threads=1, type_k=type_k, type_v=type_v) as m:
        info = m.kv_cache_info()
        rows = [m.logits(PROMPT)] + [m.eval([t]) for t in KV_STEPS]
    return info, np.concatenate(rows)


def kv_difference(a, b):
    """(rms, max) |a - b| in units of the std of a's logits (as test_kv_cache_types measures)."""
    d = np.abs(a - b)
    return float(np.sqrt(np.mean(d ** 2)) / a.std()), float(d.max() / a.std())


@pytest.fixture(scope="module")
def kv_noise(kv_model):
    """CUDA's own difference to the CPU with F32 caches: the TF32 products of the F32 weights, and
    CUDA's flash attention, which casts F32 K/V to F16 (the CPU's reads them as they are)."""
    (_, cpu), (info, cuda) = kv_run(kv_model, "cpu", "f32", "f32"), kv_run(kv_model, "cuda", "f32", "f32")
    check_allocated(kv_model, info, "f32", "f32", buffer="CUDA")
    rel = np.abs(cuda - cpu).max() / np.abs(cpu).max()
    rms, mx = kv_difference(cpu, cuda)
    print(f"f32/f32 KV cache: CUDA vs CPU rms {rms:.3g}, max {mx:.3g} of the logit std; "
          f"max {rel:.3g} of max |logit|")
    assert rel < 1e-2  # the bound test_cuda_logits_match_cpu holds CUDA's F32 arithmetic to
    return rms, mx


@pytest.mark.parametrize("type_k,type_v", CUDA_KV_PAIRS, ids=lambda t: t)
def test_cuda_kv_pair_matches_cpu(kv_model, kv_noise, type_k, type_v, record_property):
    """On CUDA the cache is allocated in the asked-for types, in CUDA memory, with the bytes the
    GGUF's shapes give; its logits match the CPU's with the same cache types.

    Tolerance: each device rounds K and V to the pair's types, so each is off its own F32-cache
    logits by the pair's rounding error, which test_kv_cache_types' TOLERANCE bounds on the CPU at
    ~2.5x its measurement (CUDA quantizes with the same block formats and rounding; its vector FA
    kernel quantizes Q to q8_1 where the CPU's takes q8_0, the same 8-bit step); the two F32-cache
    results differ by kv_noise. Hence |cuda - cpu| <= 2 * TOLERANCE(pair) + kv_noise (x1.5 for
    the noise's own spread), rms and max alike. A cache garbled or read at the wrong rows moves
    logits by rms 0.4 of their std (test_kv_cache_types' docstring), above every pair's bound
    (the 4-bit pairs': rms 0.12 + noise).

    Planted bug for the allocation half: DELTASPEC_TEST_FORCE_KV_F32=1 (every cache F32) fails it,
    see test_cuda_planted_all_f32_cache_is_caught; the logits half passes that bug by design (the
    closeness bound is one-sided), which is why the types and bytes are read back."""
    info, cuda = kv_run(kv_model, "cuda", type_k, type_v)
    check_allocated(kv_model, info, type_k, type_v, buffer="CUDA")
    _, cpu = kv_run(kv_model, "cpu", type_k, type_v)
    rms, mx = kv_difference(cpu, cuda)
    tol_max, tol_rms, _ = _pair_tolerance(type_k, type_v)
    bound_rms, bound_max = 2 * tol_rms + 1.5 * kv_noise[0], 2 * tol_max + 1.5 * kv_noise[1]
    record_property("rms_over_std", rms)
    record_property("max_over_std", mx)
    print(f"{type_k}/{type_v}: CUDA vs CPU rms {rms:.3g} (bound {bound_rms:.3g}), max {mx:.3g} "
          f"(bound {bound_max:.3g}) of the logit std")
    assert rms <= bound_rms, f"{type_k}/{type_v}: CUDA vs CPU rms {rms:.3g} of the logit std > {bound_rms:.3g}"
    assert mx <= bound_max, f"{type_k}/{type_v}: CUDA vs CPU max {mx:.3g} of the logit std > {bound_max:.3g}"


def test_cuda_refuses_iq4_nl(kv_model):
    """ggml-cuda has no flash attention for IQ4_NL (ggml would run the op on the CPU behind the
    user's back): every pair with it is refused with a ValueError naming the type and the device,
    before anything is loaded. With the pairs above, every one of the 81 ggml pairs is accounted for
    (the tq types and the rotated ggml types add 225 - 64 CUDA pairs, tested above with a tq or
    rotated side)."""
    ggml_pairs = [p for p in CUDA_KV_PAIRS if set(p) <= set(CACHE_TYPES)]
    assert len(ggml_pairs) + len(CUDA_REFUSED_PAIRS) == 81 and len(CUDA_REFUSED_PAIRS) == 17
    assert len(CUDA_KV_PAIRS) == 15 * 15
    for type_k, type_v in CUDA_REFUSED_PAIRS:
        which = "type_k" if type_k == "iq4_nl" else "type_v"
        with pytest.raises(ValueError, match=rf"{which}='iq4_nl' is not supported on cuda"):
            Model(kv_model, device="cuda", n_ctx=N_CTX, type_k=type_k, type_v=type_v)


def test_cuda_planted_all_f32_cache_is_caught(kv_model, monkeypatch):
    """The planted bug DELTASPEC_TEST_FORCE_KV_F32=1 (every cache allocated F32 whatever was
    asked, csrc/state.cpp) on CUDA: kv_cache_info() shows it, so the pair test's allocation check
    fails."""
    monkeypatch.setenv("DELTASPEC_TEST_FORCE_KV_F32", "1")
    info, _ = kv_run(kv_model, "cuda", "q8_0", "q4_0")
    assert {(a["type_k"], a["type_v"]) for a in info["attention_layers"]} == {("f32", "f32")}
    with pytest.raises(AssertionError, match="q8_0/q4_0: layer 3 allocated"):
        check_allocated(kv_model, info, "q8_0", "q4_0", buffer="CUDA")
