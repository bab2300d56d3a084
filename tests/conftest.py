"""Test setup: use the installed package (it carries the native `_core`); fall back to the
in-tree sources only when deltaspec is not installed, so pure-Python tests still run."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("deltaspec") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


import pytest  # noqa: E402
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401  (hooks)


@pytest.fixture(scope="session")
def chat_gguf(tmp_path_factory):
    """The tiny real-vocabulary model attn2_d32_untied (F16) carrying Qwen3.5-4B's chat template from
    the pinned llama.cpp tree: chat templates, thinking and chat completions end to end."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from deltaspec.convert import convert_hf_to_gguf
    from deltaspec.testing.tiny_models import default_cache_dir, tiny_model_dir
    from upstream import llama_cpp_tree

    template = (llama_cpp_tree() / "models/templates/Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    # a cache folder of its own: tiny_model_dir evicts other builds of the same name from its folder
    hf_dir = tiny_model_dir("attn2_d32_untied", chat_template=template, cache_dir=default_cache_dir() / "chat-template")
    path = tmp_path_factory.mktemp("chat") / "tiny-chat.gguf"
    convert_hf_to_gguf(hf_dir, path, outtype="f16")
    return path


@pytest.fixture(scope="session")
def chat_served(chat_gguf):
    """What the server checks a request against (server.schemas.Served) for the tiny-chat model: its
    name, template and tokenizer, and a 512-token context; for the API converters' tests, which
    render prompts without a server."""
    from deltaspec import Model
    from deltaspec.chat import chat_template_from_metadata
    from deltaspec.server.schemas import Served

    with Model(chat_gguf, n_ctx=512, n_threads=1) as m:
        yield Served(name="tiny-chat", n_ctx=512, tokenize=lambda text: m.tokenize(text, special=True),
                     n_vocab=m.n_vocab, template=chat_template_from_metadata(m.metadata), tokenizer=m.tokenizer)
