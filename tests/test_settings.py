"""The run settings are declared once (attnrewrite.settings): the API's keywords, the pipeline's
Settings and the CLI's flags are those declarations, and the plan the frontends get is one
frozen value (decision.RunPlan)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import attnrewrite
from attnrewrite import passes, pipeline
from attnrewrite import settings as run_settings
from attnrewrite.cli_check import build_check_parser
from attnrewrite.cli_rewrite import build_parser
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError

DECLARED = {field.name: field for field in run_settings.declared()}
# api.rewrite's own parameters: the model, the method and what is not a group's setting
API_OWN = {
    "model",
    "to",
    "layers",
    "validate",
    "include_single_query",
    "recurrent",
    "standard_ops",
    "state_budget",
    "heads",
    "example_inputs",
    "dynamic_shapes",
    "options",
}


def test_the_apis_keywords_are_the_declared_settings():
    parameters = inspect.signature(attnrewrite.rewrite).parameters
    assert set(parameters) - API_OWN == set(DECLARED)
    for name, field in DECLARED.items():
        assert parameters[name].default == field.default
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_pipelines_settings_hold_every_declared_setting():
    fields = {field.name: field for field in dataclasses.fields(pipeline.Settings)}
    assert set(DECLARED) <= set(fields)
    assert all(fields[name].default == field.default for name, field in DECLARED.items())


@pytest.mark.parametrize(
    "parser,groups",
    [(build_parser(), run_settings.GROUPS), (build_check_parser(), (run_settings.GateSettings,))],
)
def test_the_cli_has_one_flag_per_declared_setting(parser, groups):
    flags = {action.dest: action.option_strings for action in parser._actions}
    for group in groups:
        for field in dataclasses.fields(group):
            declared = field.metadata["flag"]
            assert flags[field.name] == [declared.name]
            assert field.metadata["help"], field.name


def test_no_method_option_is_spelled_as_a_run_setting_or_a_plans_field():
    """The API and RunPlan.of tell a setting from a method's option by its name alone."""
    plan = {field.name for field in dataclasses.fields(RunPlan)}
    for name in passes.PASSES:
        options = {field.name for field in dataclasses.fields(passes.get_pass(name).Options)}
        assert not options & (set(DECLARED) | plan), name


@pytest.mark.parametrize(
    "group,values,message",
    [
        (run_settings.CalibrationSettings, {"calibrate_steps": -1}, "calibrate_steps must be an integer >= 0, got -1"),
        (
            run_settings.CalibrationSettings,
            {"calibrate_lr": float("inf")},
            "calibrate_lr must be a positive number, got inf",
        ),
        (run_settings.FinetuneSettings, {"finetune_rank": True}, "finetune_rank must be an integer >= 1, got True"),
        (run_settings.TextSettings, {"max_length": 0}, "max_length must be an integer >= 1, got 0"),
    ],
)
def test_each_group_refuses_a_value_outside_its_declared_range(group, values, message):
    with pytest.raises(AttnRewriteError) as refused:
        group(**values)
    assert str(refused.value) == message


def test_the_api_splits_settings_from_method_options():
    settings, options = run_settings.split({"calibrate_steps": 3, "features": 16, "seq": 8})
    assert (settings, options) == ({"calibrate_steps": 3, "seq": 8}, {"features": 16})


def test_the_plan_is_frozen_and_made_from_a_method_with_keywords():
    plan = RunPlan.of("favor", layers=[1], features=16)
    assert (plan.method.NAME, plan.options.features, plan.layers) == ("favor", 16, [1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = None
    trial = plan.but(layers=[0], include_single_query=True)
    assert (trial.layers, trial.include_single_query, trial.options) == ([0], True, plan.options)
    assert RunPlan.of(plan) == plan
