"""`--preset` (the variant our results recommend, one flag away) and defaults shown in every verb's help."""

import argparse

import pytest

from linearize.cli import build_parser
from linearize.config import PRESETS, make_method_config
from linearize.train.command import config_from_args

BASE = {"convert": ["convert", "--model", "m", "--out", "o"], "distill": ["distill", "--model", "m", "--out", "o"]}


def parse(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("verb", ["convert", "distill"])
def test_preset_means_its_method_and_options(verb):
    args = parse(*BASE[verb], "--preset", "lizard-shared")
    assert args.method == "lizard" and args.set == ["rope_in_window=true", "combine=shared"]


def test_lizard_shared_is_rope_in_the_window_and_one_shared_normaliser():
    cfg = make_method_config(PRESETS["lizard-shared"].method, **PRESETS["lizard-shared"].options)
    assert cfg.rope_in_window is True and cfg.combine == "shared"


def test_method_lizard_stays_the_papers_method():
    args = parse(*BASE["distill"], "--method", "lizard")
    cfg = config_from_args(args)
    assert cfg.method == "lizard" and cfg.options == {} and cfg.head_lr_scale == 1.0
    paper = make_method_config("lizard")
    assert paper.rope_in_window is False and paper.combine == "alpha"


def test_distill_preset_sets_its_training_defaults_unless_given():
    cfg = config_from_args(parse(*BASE["distill"], "--preset", "lizard-shared"))
    assert cfg.options == {"rope_in_window": "true", "combine": "shared"} and cfg.head_lr_scale == 30.0
    for argv in (["--head-lr-scale", "1", "--preset", "lizard-shared"], ["--preset", "lizard-shared", "--head-lr-scale", "1"]):
        assert config_from_args(parse(*BASE["distill"], *argv)).head_lr_scale == 1.0


@pytest.mark.parametrize("order", ["before", "after"])
def test_set_beside_a_preset_wins(order):
    extra = ["--set", "combine=alpha", "--set", "window=64"]
    argv = [*extra, "--preset", "lizard-shared"] if order == "before" else ["--preset", "lizard-shared", *extra]
    cfg = config_from_args(parse(*BASE["distill"], *argv))
    assert cfg.options == {"rope_in_window": "true", "combine": "alpha", "window": "64"}


@pytest.mark.parametrize("verb", ["convert", "distill"])
def test_method_or_preset_one_of_them(verb, capsys):
    for argv in (BASE[verb], [*BASE[verb], "--method", "lizard", "--preset", "lizard-shared"],
                 [*BASE[verb], "--preset", "nope"]):
        with pytest.raises(SystemExit) as e:
            parse(*argv)
        assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def parsers(parser=None, name="linearize"):
    """Every parser of the command: (name, parser), subcommands included."""
    parser = parser or build_parser()
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from parsers(subparser, f"{name} {sub}")


def test_every_verbs_help_shows_its_defaults():
    checked = 0
    for name, parser in parsers():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or action.required or default is None or isinstance(default, bool)
                    or default in ([], argparse.SUPPRESS)):
                continue
            shown = f"{default:,}" if isinstance(default, int) and default >= 10_000 else str(default)
            assert f"default: {shown}" in text or "default" in (action.help or "").lower(), (name, action.dest)
            checked += 1
    assert checked > 20


def test_help_names_the_preset_and_the_papers_method():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["distill"].format_help().split())
    assert "lizard-shared" in text and "the paper's Lizard" in text and "(default: 20,000,000)" in text
