"""Bad configuration fails at start with a message that names the trait."""

from __future__ import annotations

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpushare.server.app import GPUShareApp


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("backend", "gpu"),
        ("simulated_gpus", [16, 0]),
        ("poll_interval", 0),
        ("idle_timeout", -1),
        ("idle_utilization", 150),
        ("min_release_bytes", -5),
        ("release_method", "magic"),
        ("restore_mode", "sometimes"),
        ("restore_grace", -1),
        ("pressure_free_fraction", 1.5),
        ("pressure_idle_timeout", -10),
        ("history_seconds", 0),
        ("lock_timeout", 0),
    ],
)
def test_bad_value_names_the_trait(name, value):
    with pytest.raises(TraitError, match=name):
        GPUShareApp(config=Config({"GPUShareApp": {name: value}}))


def test_defaults_are_the_documented_ones():
    app = GPUShareApp()
    assert (app.idle_timeout, app.poll_interval, app.restore_mode, app.release_method) == (
        600.0, 2.0, "eager", "auto")
    assert app.kernel_env == {"TF_FORCE_GPU_ALLOW_GROWTH": "true",
                              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert app.simulated_gpus == [16 << 30, 16 << 30]


def test_backend_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("JUPYTER_GPUSHARE_BACKEND", "simulated")
    assert GPUShareApp().backend == "simulated"


def test_every_trait_is_documented():
    ours = {name: trait for name, trait in GPUShareApp.class_traits(config=True).items()
            if trait.this_class.__module__.startswith("jupyter_gpushare.")}
    assert len(ours) >= 25, sorted(ours)  # the options classes the app inherits
    for name, trait in ours.items():
        assert len(trait.help) > 60, f"GPUShareApp.{name} needs help= with units and default"
    assert "GPUShareApp.idle_timeout" in GPUShareApp.class_config_section()


def test_the_options_classes_do_not_shadow_each_other():
    """The app inherits every options class: a validator or default of one that had the name
    of another's would silently replace it (traitlets finds them by attribute)."""
    from traitlets.config import Configurable

    from jupyter_gpushare.core.options import RestoreOptions, TrackingOptions
    from jupyter_gpushare.node.options import NodeOptions
    from jupyter_gpushare.policy.options import ReleaseOptions
    from jupyter_gpushare.server.options import KernelOptions, SourceOptions

    internal = set(vars(type("Empty", (Configurable,), {})))  # what traitlets adds to each class
    seen: dict[str, str] = {}
    for cls in (SourceOptions, KernelOptions, TrackingOptions, ReleaseOptions, RestoreOptions,
                NodeOptions):
        assert issubclass(GPUShareApp, cls)
        for name in vars(cls):
            if name.startswith("__") or name in internal:
                continue
            assert name not in seen, f"{cls.__name__}.{name} shadows {seen[name]}.{name}"
            seen[name] = cls.__name__
