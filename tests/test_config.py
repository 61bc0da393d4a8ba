import glob
import os
import subprocess
import sys

import pytest
import yaml

from dpllm.config import SECTIONS, ConfigError, config_from_dict, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 7, "learning_rate": 0.5}, "privacy": {"target_epsilon": 3}}))
    cfg = parse_config(["--config", str(path), "--max_steps", "9", "--privacy.accountant", "rdp"])
    assert cfg.train.max_steps == 9  # command line wins
    assert cfg.train.learning_rate == 0.5  # from the YAML
    assert cfg.privacy.target_epsilon == 3.0
    assert cfg.privacy.accountant == "rdp"


def test_command_line_max_steps_replaces_the_files_epochs(tmp_path, caplog):
    """A file with ``epochs: 1`` and ``--max_steps 20`` used to run the epochs and say nothing."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"epochs": 1}}))
    with caplog.at_level("INFO", logger="dpllm.config"):
        cfg = parse_config(["--config", str(path), "--max_steps", "20"])
    assert (cfg.train.epochs, cfg.train.max_steps) == (None, 20)
    assert "--max_steps 20 replaces the config file's epochs: 1" in caplog.text
    assert parse_config(["--config", str(path)]).train.epochs == 1.0  # without the flag the file decides
    caplog.clear()
    with caplog.at_level("INFO", logger="dpllm.config"):
        both = parse_config(["--config", str(path), "--max_steps", "20", "--epochs", "2"])
    assert both.train.epochs == 2.0 and "--max_steps 20 is ignored: --epochs 2.0 sets" in caplog.text


def test_dotted_bool_override():
    cfg = parse_config(["--privacy.enabled", "false"])
    assert cfg.privacy.enabled is False


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_stepz": 7}}))
    with pytest.raises(ConfigError, match="max_stepz"):
        parse_config(["--config", str(path)])


def test_key_in_wrong_section_names_the_right_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"target_epsilon": 7}}))
    with pytest.raises(ConfigError, match="belongs in section 'privacy'"):
        parse_config(["--config", str(path)])


def test_unknown_cli_option_is_an_error():
    with pytest.raises(ConfigError, match="--learning_rat"):
        parse_config(["--learning_rat", "1"])
    with pytest.raises(ConfigError, match="train.nope"):
        parse_config(["--train.nope", "1"])


@pytest.mark.parametrize(
    "args, match",
    [
        (["--finetuning", "half"], "finetuning"),
        (["--physical_batch_size", "128", "--logical_batch_size", "64"], "physical_batch_size"),
        (["--accountant", "moments"], "accountant"),
        (["--train_on", "public"], "privacy.enabled=false"),
    ],
)
def test_invalid_values(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(args)


def test_dp_needs_epsilon_or_noise():
    with pytest.raises(ConfigError, match="target_epsilon"):
        config_from_dict({"privacy": {"target_epsilon": None, "noise_multiplier": None}})


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    import dataclasses

    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f"--{f.name}" in out, f.name
            assert f.metadata["help"], f"{f.name} has no help text"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "*", "*.yaml"))))
def test_every_shipped_config_parses(path):
    doc = yaml.safe_load(open(path))
    if "sweep" in doc:  # a scaling-sweep config: every point of its grids must be a valid run config
        sys.path.insert(0, os.path.join(ROOT, "recipes"))
        from scaling_sweep import expand

        points = expand(doc, quick=False) + expand(doc, quick=True)
        assert len(points) >= 8
        for _, cfg in points:
            config_from_dict(cfg)
        return
    cfg = parse_config(["--config", path])
    assert cfg.train.logical_batch_size >= cfg.train.physical_batch_size


def test_gpu_configs_say_what_they_promise():
    llama = parse_config(["--config", os.path.join(ROOT, "recipes/configs/llama3_8b/lora_eps8.yaml")])
    assert llama.model.finetuning == "lora" and llama.privacy.target_epsilon == 8.0
    assert llama.train.mixed_precision == "bf16" and llama.model.torch_dtype == "bfloat16"
    assert llama.privacy.grad_sample_mode == "auto" and llama.train.logical_batch_size >= 512
    gpt2 = parse_config(["--config", os.path.join(ROOT, "recipes/configs/gpt2/full_eps3.yaml")])
    assert gpt2.model.finetuning == "full" and gpt2.privacy.target_epsilon == 3.0
    assert gpt2.model.model_name_or_path.endswith("gpt2")


def test_round_trip_through_saved_yaml():
    cfg = parse_config(["--max_steps", "5", "--lora_r", "4"])
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_the_fast_yaml_reads_and_writes_what_pyyaml_does(tmp_path):
    from dpllm.io import dump_yaml, load_yaml

    # every shipped file, a saved config with unicode and odd strings: the same values as yaml.safe_load, and the
    # same text as yaml.safe_dump
    cfg = parse_config(["--max_steps", "5", "--text_column", "note: ünïcödé # not a comment", "--dataset", "yes"])
    docs = [open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True))]
    assert len(docs) > 10
    for text in [*docs, cfg.to_yaml(), "a: 1e-5\nb: 0o17\nc: ~\nd: 2026-11-29\ne: [on, off]\n"]:
        assert load_yaml(text) == yaml.safe_load(text)
    assert cfg.to_yaml() == dump_yaml(cfg.to_dict()) == yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    assert load_yaml(cfg.to_yaml())["data"]["text_column"] == "note: ünïcödé # not a comment"
    # a file that does not parse: the pure-Python parser's message, which quotes the line and points at the column
    with pytest.raises(yaml.YAMLError) as err:
        load_yaml("model:\n  lora_r: [4, 8\n  lora_alpha: 16\n")
    assert "line 2" in str(err.value) and "^" in str(err.value)


def test_a_yaml_type_error_is_one_line_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  max_length: long\n")
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", str(path)])
    assert str(err.value) == f"{path}: data.max_length: expected int, got 'long'"
    path.write_text("train:\n  learning_rate: [1]\n")
    with pytest.raises(ConfigError, match=r"train.learning_rate: expected float, got \[1\]"):
        parse_config(["--config", str(path)])
    # What the parser converts stays accepted: PyYAML reads 1e-5 as a string, "true" is a boolean word.
    path.write_text("train:\n  learning_rate: 1e-5\n  max_steps: '7'\n"
                    "privacy:\n  enabled: 'true'\n  target_epsilon: 3\n")
    cfg = parse_config(["--config", str(path)])
    assert (cfg.train.learning_rate, cfg.train.max_steps, cfg.privacy.enabled) == (1e-5, 7, True)
    # The same through the recipe: one line on stderr, no usage block.
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  max_length: long\n")
    r = subprocess.run([sys.executable, "recipes/finetune_llm.py", "--config", str(bad)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: {bad}: data.max_length: expected int, got 'long'\n", r.stderr


def test_mistyped_keys_and_options_get_a_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_stepz": 7}}))
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_stepz'; did you mean train.max_steps\?"):
        parse_config(["--config", str(path)])
    path.write_text(yaml.safe_dump({"privcy": {"target_epsilon": 7}}))
    with pytest.raises(ConfigError, match=r"unknown key 'privcy'; did you mean privacy\?"):
        parse_config(["--config", str(path)])
    with pytest.raises(ConfigError, match=r"unknown option --learning_rat; did you mean --learning_rate\?"):
        parse_config(["--learning_rat", "1"])
    with pytest.raises(ConfigError, match=r"unknown option --train.max_stepz; did you mean --train.max_steps\?"):
        parse_config(["--train.max_stepz", "1"])
