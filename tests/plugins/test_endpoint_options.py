"""Endpoint options of the plugins that call a PRM, teacher, critic or judge server: each plugin's ``*_timeout``
and ``*_max_retries`` reach the HTTP client's configuration (nothing is sent: the clients are only built)."""

from types import SimpleNamespace

import pytest

from trl_plugins import build_plugins
from trl_plugins.components.prm import clear_shared_prms, prm_from_options
from trl_plugins.components.teacher import clear_shared_teachers

URL = "http://127.0.0.1:9/v1"  # never contacted


@pytest.fixture(autouse=True)
def _fresh_components():
    yield
    clear_shared_prms()
    clear_shared_teachers()


def _plugin(name, options):
    return build_plugins([name], {name: options}).by_name[name]


def _assert_client(component, timeout, retries):
    assert component.config.base_url == URL
    assert (component.config.timeout, component.config.max_retries) == (timeout, retries)


@pytest.mark.parametrize("name", ["scope", "posterior_grpo"])
def test_prm_endpoint_timeout_and_retries(name):
    base = {"prm": "endpoint", "prm_base_url": URL, **({"mode": "reference_suffix"} if name == "scope" else {})}
    plugin = _plugin(name, {**base, "prm_timeout": 7.5, "prm_max_retries": 1})
    _assert_client(prm_from_options(plugin.options), 7.5, 1)
    default = _plugin(name, base)
    _assert_client(prm_from_options(default.options), 60.0, 4)


def test_scope_teacher_endpoint_timeout_and_retries():
    plugin = _plugin("scope", {"mode": "teacher_step", "teacher": "endpoint", "teacher_base_url": URL,
                               "teacher_timeout": 3.0, "teacher_max_retries": 0, "prm": "programmatic"})
    _assert_client(plugin._build_teacher(), 3.0, 0)


def test_critique_grpo_critic_endpoint_timeout_and_retries():
    plugin = _plugin("critique_grpo", {"critique_type": "text", "critic": "endpoint", "critic_base_url": URL,
                                       "critic_timeout": 9.0, "critic_max_retries": 2})
    plugin.trl_plugins_configure(trainer=None, args=SimpleNamespace(offpolicy_shaping_gamma=0.1, scale_rewards="none"))
    _assert_client(plugin.critic, 9.0, 2)


def test_fbos_rl_judge_endpoint_timeout_and_retries():
    plugin = _plugin("fbos_rl", {"feedback": "judge", "judge": "endpoint", "judge_base_url": URL,
                                 "judge_timeout": 4.0, "judge_max_retries": 3})
    trainer = SimpleNamespace(plugin_stack=[plugin], scale_rewards="group")
    plugin.trl_plugins_configure(trainer=trainer, args=SimpleNamespace(offpolicy_shaping_gamma=0.1, num_generations=8))
    _assert_client(plugin.judge, 4.0, 3)


@pytest.mark.parametrize("name, option", [("scope", "prm_timeout"), ("critique_grpo", "critic_timeout"),
                                          ("fbos_rl", "judge_max_retries")])
def test_bad_endpoint_options_are_refused(name, option):
    from trl_plugins import PluginConfigError

    with pytest.raises(PluginConfigError, match=option):
        _plugin(name, {option: -1})
