import shutil

import pytest
import torch

import course_lib
from course_lib import loading
from course_lib.engine.generation import generate
from course_lib.runtime import DeviceError

from conftest import chat_ids

def test_default_model_is_ready(model, tokenizer):
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.device.type == "cpu" and model.dtype == torch.float32
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert "quantization_config" not in cfg.to_dict()  # the GGUF quantizer must not come back

def test_greedy_answer_is_paris(model, tokenizer):
    result = generate(model, tokenizer, chat_ids(tokenizer, "What is the capital of France?"), max_new_tokens=20)
    assert result.text == "The capital of France is Paris."
    assert result.stop_reason == "end_of_turn"

def test_same_request_returns_same_objects(smol):
    again = course_lib.load_model(device="cpu", verbose=False)
    assert again.model is smol.model and again.tokenizer is smol.tokenizer

def test_eager_attention_returns_weights(tokenizer):
    model, _ = course_lib.load_model(device="cpu", attn_implementation="eager", verbose=False)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[1780, 314, 260]]), output_attentions=True)
    assert len(out.attentions) == 30 and out.attentions[0].shape == (1, 9, 3, 3)

def test_local_folder_loads(model):
    other, _ = course_lib.load_model(str(loading.weights_cache_dir()), device="cpu", verbose=False)
    assert torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)

@pytest.mark.slow
def test_cached_weights_match_the_gguf_file(model):
    from transformers import AutoModelForCausalLM
    path = loading.gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name

@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "gpt-5-ultra", "./missing_folder"])
def test_unknown_model_is_a_clear_error_without_network(name):
    with pytest.raises(loading.ModelNotFoundError, match="unknown model"):
        course_lib.load_model(name, verbose=False)

def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(loading.ModelNotFoundError, match="no config.json"):
        course_lib.load_model(str(tmp_path), verbose=False)

def test_bad_attention_implementation():
    with pytest.raises(ValueError, match="attn_implementation"):
        course_lib.load_model(attn_implementation="flash", verbose=False)

def test_invalid_device_when_loading():
    with pytest.raises(DeviceError):
        course_lib.load_model(device="gpu0", verbose=False)

@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"

@pytest.fixture
def real_gguf():
    path = loading.gguf_path()
    assert path.exists(), "run make setup first"
    return path

@pytest.mark.slow
def test_corrupt_model_file_is_fetched_again_never_loaded(real_gguf, temp_cache):
    bad = loading.gguf_path()
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a model")
    fetched = []

    def fetch(dest):
        fetched.append(dest)
        shutil.copyfile(real_gguf, dest)

    assert loading.ensure_model_file(fetch=fetch) == bad
    assert fetched == [bad] and loading.sha256_of(bad) == loading.GGUF_SHA256

def test_wrong_download_raises_and_is_deleted(temp_cache):
    def fetch(dest):
        dest.write_bytes(b"tampered")

    with pytest.raises(loading.ChecksumError, match="expected"):
        loading.ensure_model_file(fetch=fetch)
    assert not loading.gguf_path().exists()

def test_missing_model_says_how_to_fix(temp_cache):
    with pytest.raises(loading.ModelNotFoundError, match="make setup"):
        course_lib.load_model(verbose=False)

def test_unwritable_cache_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a folder cannot be created inside a file, even by root
    monkeypatch.setenv("COURSE_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(loading.CacheNotWritableError, match="COURSE_CACHE_DIR"):
        loading.ensure_model_file(fetch=lambda dest: None)

def test_cache_folder_default_is_inside_the_project(monkeypatch):
    monkeypatch.delenv("COURSE_CACHE_DIR", raising=False)
    assert loading.cache_root().name == ".course_cache"


def test_the_cache_is_found_inside_the_environment_on_a_hub(tmp_path, monkeypatch):
    """postBuild builds the cache in <sys.prefix>/share/llm-course; a repository without .course_cache uses it."""
    monkeypatch.delenv("COURSE_CACHE_DIR", raising=False)
    project = tmp_path / "course"
    (project / "course_lib").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    monkeypatch.setattr(loading, "__file__", str(project / "course_lib" / "loading.py"))
    inside = tmp_path / "env" / "share" / "llm-course"
    monkeypatch.setattr(loading, "environment_cache", lambda: inside)
    assert loading.cache_root() == project / ".course_cache"  # nothing built anywhere: the project's folder
    inside.mkdir(parents=True)
    assert loading.cache_root() == inside
    (project / ".course_cache").mkdir()
    assert loading.cache_root() == project / ".course_cache"  # a project cache wins when there is one
