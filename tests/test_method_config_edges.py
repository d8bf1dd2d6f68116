"""A method's options are parsed into its typed config once, at the edge (the CLI's --set, a recipe, the
Python call, a checkpoint's config.json); every layer below takes that config object."""

import pytest
import torch
from tiny_models import save_tiny_teacher, tiny_teacher

from linearize import config as method_configs
from linearize.cli import main
from linearize.config import ConfigError, LizardConfig, StillConfig, make_method_config, method_name, method_options
from linearize.convert import convert, set_inference_options
from linearize.loading import load_model
from linearize.modeling import method_config_of
from linearize.train import DistillConfig


@pytest.fixture
def coerced(monkeypatch) -> list[str]:
    """The option names `linearize.config` turns from raw values into typed ones, one entry per parse."""
    seen, real = [], method_configs._coerce

    def counting(name, raw, hint):
        seen.append(name)
        return real(name, raw, hint)

    monkeypatch.setattr(method_configs, "_coerce", counting)
    return seen


def test_the_convert_command_parses_set_once(tmp_path, capsys, coerced):
    teacher = save_tiny_teacher(tmp_path / "teacher")
    code = main(["convert", "--model", str(teacher), "--method", "lizard", "--out", str(tmp_path / "out"),
                 "--set", "window=8"])
    assert code == 0, capsys.readouterr().err
    assert coerced.count("window") == 1


def test_a_distill_config_parses_its_options_once_and_hands_the_typed_config_down(coerced):
    cfg = DistillConfig(model="m", method="lizard", out="o", options={"window": "8", "gate": "vector"})
    assert cfg.method_config == LizardConfig(window=8, gate="vector")
    assert cfg.options == {"window": "8", "gate": "vector"}  # what distill_config.json keeps, as given
    assert sorted(coerced) == ["gate", "window"]
    model = convert(tiny_teacher(), cfg.method_config)
    assert coerced.count("window") == 1  # convert took the typed config as it is
    assert method_config_of(model) is cfg.method_config


def test_a_distill_config_refuses_bad_options_at_once():
    with pytest.raises(ConfigError, match="lizard has no option 'budget'"):
        DistillConfig(model="m", method="lizard", out="o", options={"budget": 8})


def test_convert_takes_a_name_with_options_or_a_typed_config_alike():
    by_name = convert(tiny_teacher(), "lizard", window="8", softmax_layers=[1])
    typed = convert(tiny_teacher(), LizardConfig(window=8), softmax_layers=[1])
    assert by_name.config.linearize == typed.config.linearize
    assert typed.config.linearize["options"] == method_options(LizardConfig(window=8))
    ids = torch.randint(3, 100, (1, 10))
    with torch.no_grad():
        assert torch.equal(by_name(ids).logits, typed(ids).logits)


def test_convert_refuses_a_typed_config_with_options_beside_it_or_bad_values():
    with pytest.raises(ConfigError, match="window given beside a LizardConfig"):
        convert(tiny_teacher(), LizardConfig(), window=8)
    with pytest.raises(ConfigError, match="window must be > 0"):
        convert(tiny_teacher(), LizardConfig(window=0))


def test_a_loaded_checkpoint_parses_its_settings_once_and_inference_options_change_the_typed_config(
        tmp_path, coerced):
    out = tmp_path / "still"
    convert(tiny_teacher(), "still", window="8", chunk_size="4", budget="16", max_chunks="2").save_pretrained(out)
    coerced.clear()
    model = load_model(out)
    options = len(method_options(StillConfig()))
    assert len(coerced) == options  # the config.json's settings, parsed once for every layer
    assert method_config_of(model) == make_method_config("still", window=8, chunk_size=4, budget=16, max_chunks=2)
    coerced.clear()
    set_inference_options(model, budget="24")
    assert coerced == ["budget"]  # only the change is parsed
    assert method_config_of(model).budget == 24 and model.config.linearize["options"]["budget"] == 24
    assert method_name(method_config_of(model)) == "still"
