"""Typed config: recipes, dotted overrides, and errors that name the key before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflash_trainer.cli import main, resolve_recipe
from dflash_trainer.config import ConfigError, config_from_dict, config_to_dict, load_config, save_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_defaults_and_overrides():
    sliding = ["drafter.sliding_layers=[0]", "drafter.sliding_window=64"]
    config = load_config(None, ["optim.lr=3e-4", *sliding])
    assert config.optim.lr == 3e-4 and config.drafter.sliding_layers == [0]
    assert config.train.epochs == 6 and config.drafter.block_size == 16


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"train\.epochs: expected int, got float"):
        load_config(None, ["train.epochs=1.5"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.learning_rate=1e-3", r"optim\.learning_rate: unknown key"),
        ("optimizer.lr=1e-3", r"optimizer: unknown key"),
        ("data.token_budget=lots", r"data\.token_budget: expected int, got str"),
        ("loss.weighting=linear", r"loss\.weighting: 'linear' is not one of"),
        ("drafter.target_layer_ids=[1,x]", r"drafter\.target_layer_ids\[1\]: expected int"),
        ("optim.warmup_ratio=1.5", r"optim\.warmup_ratio: must be in"),
        ("drafter.sliding_layers=[7]", r"drafter\.sliding_window"),
        ("placement.target_ranks=[0]", r"placement: disaggregated placement needs both"),
        ("no_equals_sign", r"expected key\.path=value"),
        ("=3", r"no key before"),
        ("data.token_budget=100", r"data\.token_budget: must be >= data\.max_seq_len \(2048\)"),
        ("metrics.log_every=0", r"metrics\.log_every: must be >= 1"),
        ("train.stall_report_s=0.5", r"train\.stall_report_s: must be 0 \(off\) or >= 1"),
        ("optim.betas=[0.9,1.5]", r"optim\.betas: must be in \[0, 1\)"),
        ("drafter.target_layer_ids=[]", r"drafter\.target_layer_ids: must name at least one layer"),
        ("drafter.target_layer_ids=[1,3,3]", r"drafter\.target_layer_ids: \[1, 3, 3\] must be strictly increasing"),
        ("drafter.target_layer_ids=[20,3,10]", r"drafter\.target_layer_ids: \[20, 3, 10\] must be strictly incr"),
        ("optim.lr=inf", r"optim\.lr: must be a finite number, got inf"),
        ("noise.start=.nan", r"noise\.start: must be a finite number, got nan"),
        ("optim.weight_decay=1e400", r"optim\.weight_decay: must be a finite number"),
        ("train.seed=-1", r"train\.seed: must be >= 0"),
        ("run_dir=", r"run_dir: must name a directory"),
        ("data.seed=-1", r"data\.seed: must be >= 0"),
        ("eval.datasets=[]", r"eval\.datasets: must name at least one prompt set"),
        ("prepare.source=gsm8k", r"prepare\.source: 'gsm8k' holds the 200 held-out GSM8K test questions"),
        ("prepare.source=gsm8k:test", r"prepare\.source: 'gsm8k:test' holds the 200 held-out"),
        ("prepare.source=mtbench:train", r"prepare\.source: 'mtbench:train' is an evaluation set"),
        ("eval.num_prompts=0", r"eval\.num_prompts: must be >= 1"),
        ("eval.argmax_drafts=true", r"eval\.argmax_drafts: needs drafter\.algorithm: dflash2"),
        ("checkpoint.timeout_s=0", r"checkpoint\.timeout_s: must be > 0"),
        ("optim.lr=[", r"optim\.lr: cannot parse value '\[' as YAML"),
        ("optim.lr=" + "[" * 5000, r"optim\.lr: cannot parse value"),
        ("optim.lr=" + "9" * 400, r"optim\.lr: .* too large for a float"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_key_in_a_recipe_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"token_budgett": 10}}))
    with pytest.raises(ConfigError, match=r"data\.token_budgett: unknown key"):
        load_config(recipe)


def test_a_saved_config_with_the_retired_window_opt_in_loads_with_a_warning(tmp_path):
    """Sliding layers need no opt-in any more (they train as the engines serve them); `eval` and resume read old
    runs' config.yaml back, which may still hold the retired key."""
    saved = config_to_dict(load_config(None, ["drafter.sliding_layers=[0]", "drafter.sliding_window=64"]))
    saved["drafter"]["accept_sliding_window_mismatch"] = True
    with pytest.warns(UserWarning, match=r"drafter\.accept_sliding_window_mismatch: ignored: .*per query position"):
        config = config_from_dict(saved)
    assert config.drafter.sliding_layers == [0] and config.drafter.sliding_window == 64
    assert not hasattr(config.drafter, "accept_sliding_window_mismatch")
    with pytest.raises(ConfigError, match=r"drafter\.accept_sliding_window_mismatchh: unknown key"):
        config_from_dict({"drafter": {"accept_sliding_window_mismatchh": True}})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optim:\n  lr: [1, 2\n", r"YAML syntax error at line 3, column 1"),
        ("optim: {lr: 1e-3\ntrain: x", r"YAML syntax error at line 2"),
        ("- just\n- a list\n", r"top level must be a mapping of sections, got list"),
        ("\tbad: tab", r"YAML syntax error at line 1, column 1"),
    ],
)
def test_yaml_syntax_errors_are_one_line_config_errors(tmp_path, text, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(recipe)
    assert "\n" not in str(caught.value)


def test_recipe_that_is_not_utf8_is_a_config_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"optim:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match="recipe"):
        load_config(recipe)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config(RECIPES / "smollm2-135m.yaml", ["optim.lr=2e-4"])
    save_config(config, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert config_to_dict(again) == config_to_dict(config)


def test_every_shipped_recipe_loads():
    recipes = sorted(RECIPES.glob("*.yaml"))
    assert len(recipes) >= 2
    for recipe in recipes:
        load_config(recipe)


def test_cli_fails_before_any_work_with_the_key(capsys, tmp_path):
    code = main(["train", "smollm2-135m", "optim.lrr=1", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "optim.lrr: unknown key" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_recipe_names_resolve_to_files():
    assert resolve_recipe(None) == RECIPES / "smollm2-135m.yaml"
    with pytest.raises(ConfigError, match="recipe 'nope'"):
        resolve_recipe("nope")


def test_help_lists_keys_with_defaults(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr" in out and "0.0006" in out and "placement.queue_depth" in out


def test_a_recipe_with_a_base_is_the_base_with_its_keys_merged_over(tmp_path):
    (tmp_path / "parent.yaml").write_text("run_dir: runs/parent\noptim:\n  lr: 1.0e-3\n  weight_decay: 0.1\n")
    (tmp_path / "child.yaml").write_text("base: parent\nrun_dir: runs/child\noptim:\n  lr: 2.0e-3\n")
    (tmp_path / "grandchild.yaml").write_text("base: child.yaml\ndrafter:\n  num_layers: 3\n")
    config = load_config(tmp_path / "grandchild.yaml")
    assert config.run_dir == "runs/child" and config.drafter.num_layers == 3
    assert config.optim.lr == 2e-3 and config.optim.weight_decay == 0.1  # merged per key: the base's other keys stay
    assert load_config(tmp_path / "grandchild.yaml", ["optim.weight_decay=0.2"]).optim.weight_decay == 0.2
    parent = load_config(tmp_path / "parent.yaml")
    assert (parent.optim.lr, parent.optim.weight_decay) == (1e-3, 0.1)
    assert "base" not in config_to_dict(config)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a.yaml": "base: b\n", "b.yaml": "base: a\n"}, r"cycle \(a.yaml -> b.yaml -> a.yaml\)"),
        ({"a.yaml": "base: missing\n"}, r"a.yaml: its base 'missing' is not a file \(.*missing.yaml\)"),
        ({"a.yaml": "base: [b]\n"}, "base must be the name of another recipe"),
        ({"a.yaml": "base:\n"}, "base must be the name of another recipe, got None"),
    ],
)
def test_recipe_bases_that_cannot_be_read_are_config_errors(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "a.yaml")


def test_base_is_not_an_override():
    with pytest.raises(ConfigError, match="a recipe file names its base recipe"):
        load_config(None, ["base=smollm2-135m"])


def test_the_general_dflash_recipe_is_the_main_job_with_a_dflash_drafter():
    main_job = config_to_dict(load_config(RECIPES / "smollm2-135m-gpu-general.yaml"))
    dflash = config_to_dict(load_config(RECIPES / "smollm2-135m-gpu-general-dflash.yaml"))
    assert (dflash["drafter"]["algorithm"], main_job["drafter"]["algorithm"]) == ("dflash", "dflash2")
    assert dflash["data"] == main_job["data"] and dflash["prepare"] == main_job["prepare"]  # the same answers
    assert dflash["train"] == main_job["train"] and dflash["optim"] == main_job["optim"]  # the same budget
    assert dflash["run_dir"] != main_job["run_dir"]
    # Everything else is the main job's: only the algorithm and the loss's chunking differ.
    assert {**dflash["drafter"], "algorithm": "dflash2"} == main_job["drafter"]
    assert {**dflash["loss"], "chunk_blocks": 512} == main_job["loss"] and dflash["eval"] == main_job["eval"]
