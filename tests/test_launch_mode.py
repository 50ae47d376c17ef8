"""The kernel launch path (TVM-FFI or CuTeDSL's classic path): the choice, the one warning when
apache-tvm-ffi is missing, and ``launch_path()`` as the bench and users see it. CPU only."""

import warnings

import pytest

from moe_ep.shim import launch_mode


@pytest.fixture
def fresh(monkeypatch):
    """No earlier warning in this process; MOE_EP_TVM_FFI unset."""
    monkeypatch.setattr(launch_mode, "_warned_classic", False)
    monkeypatch.delenv("MOE_EP_TVM_FFI", raising=False)
    return monkeypatch


def test_missing_tvm_ffi_warns_once_and_launches_classic(fresh):
    fresh.setattr(launch_mode, "_have_tvm_ffi", lambda: False)
    with pytest.warns(launch_mode.LaunchPathWarning, match="apache-tvm-ffi is not installed") as rec:
        assert launch_mode.use_tvm_ffi() is False
        assert launch_mode.use_tvm_ffi() is False  # every compile key asks: one warning per process
    assert len(rec) == 1
    assert launch_mode.launch_path() == "classic (apache-tvm-ffi missing)"


@pytest.mark.parametrize("env, use, path", [("0", False, "classic (MOE_EP_TVM_FFI=0)"),  # classic by choice
                                              (None, True, "tvm-ffi")])                    # installed
def test_chosen_paths_do_not_warn(fresh, env, use, path):
    fresh.setattr(launch_mode, "_have_tvm_ffi", lambda: True)
    if env is not None:
        fresh.setenv("MOE_EP_TVM_FFI", env)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch_mode.use_tvm_ffi() is use
    assert launch_mode.launch_path() == path


def test_required_but_missing_and_bad_values_raise(fresh):
    fresh.setattr(launch_mode, "_have_tvm_ffi", lambda: False)
    fresh.setenv("MOE_EP_TVM_FFI", "1")
    for f in (launch_mode.use_tvm_ffi, launch_mode.launch_path):
        with pytest.raises(RuntimeError, match="apache-tvm-ffi"):
            f()
    for bad in ("yes", "AUTO", " 0", "off"):  # the listed values only, as every MOE_EP_* switch
        fresh.setenv("MOE_EP_TVM_FFI", bad)
        for f in (launch_mode.use_tvm_ffi, launch_mode.launch_path):
            with pytest.raises(ValueError, match=r"MOE_EP_TVM_FFI=.*expected one of"):
                f()
    fresh.setenv("MOE_EP_TVM_FFI", "")  # empty is the default, like unset
    fresh.setattr(launch_mode, "_have_tvm_ffi", lambda: True)
    assert launch_mode.launch_path() == "tvm-ffi"


def test_real_install_and_public_names(fresh):
    """This environment installs apache-tvm-ffi (a dependency), so the default path is TVM-FFI; the
    public API names the same function and warning class."""
    pytest.importorskip("tvm_ffi")
    import moe_ep.api as api
    import moe_ep.backends as backends

    assert api.launch_path is backends.launch_path is launch_mode.launch_path
    assert api.LaunchPathWarning is launch_mode.LaunchPathWarning
    assert issubclass(api.LaunchPathWarning, UserWarning)
    assert launch_mode.launch_path() == "tvm-ffi"


def test_bench_line_names_the_launch_path():
    from moe_ep.bench.report import env_line

    line = env_line(dict(gpu="NVIDIA H200", torch="2.11.0", commit="abc1234", launches="tvm-ffi"))
    assert line.endswith("moe_ep commit abc1234 | kernel launches tvm-ffi")
    assert "kernel launches" not in env_line(dict(gpu="x", torch="y", commit="z"))  # peers' rows: no claim
