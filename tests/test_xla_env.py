"""xla_env: the command-buffer update mode goes into XLA_FLAGS only where a GPU client of a new enough XLA will read
it, never over the user's own choice."""

import pytest

from gemma4_mtp_jax import xla_env


@pytest.fixture
def gpu_machine(monkeypatch):
    """A CUDA plugin of JAX 0.11 installed, no backend started, nothing in the environment."""
    monkeypatch.setattr(xla_env, "_jax_version", lambda: (0, 11))
    monkeypatch.setattr(xla_env, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(xla_env, "_backend_started", lambda: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    return monkeypatch


def test_added_on_a_gpu_machine_and_kept_beside_other_flags(gpu_machine):
    gpu_machine.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert xla_env.set_gpu_runtime_flags()
    assert xla_env.os.environ["XLA_FLAGS"] == ("--xla_gpu_autotune_level=0 "
                                               "--xla_gpu_command_buffer_update_mode=SKIP_TEMP")
    assert xla_env.update_mode_in_flags()
    assert not xla_env.set_gpu_runtime_flags()  # a second import adds nothing
    assert xla_env.os.environ["XLA_FLAGS"].count("update_mode") == 1


def test_the_users_own_update_mode_wins(gpu_machine):
    gpu_machine.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")
    assert not xla_env.set_gpu_runtime_flags()
    assert xla_env.os.environ["XLA_FLAGS"] == "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"


@pytest.mark.parametrize("why", ["cpu only", "old jax", "no plugin", "backend started"])
def test_left_alone_where_it_cannot_apply(gpu_machine, why):
    if why == "cpu only":
        gpu_machine.setenv("JAX_PLATFORMS", "cpu")
    elif why == "old jax":
        gpu_machine.setattr(xla_env, "_jax_version", lambda: (0, 10))  # its XLA rejects SKIP_TEMP and aborts
    elif why == "no plugin":
        gpu_machine.setattr(xla_env, "_cuda_plugin_installed", lambda: False)
    else:
        gpu_machine.setattr(xla_env, "_backend_started", lambda: True)
    assert not xla_env.set_gpu_runtime_flags()
    assert "XLA_FLAGS" not in xla_env.os.environ


def test_a_started_backend_is_seen():
    import jax

    jax.devices()  # the backend the suite runs on
    assert xla_env._backend_started()


def test_memory_fraction_set_before_the_backend_only(gpu_machine, caplog):
    gpu_machine.delenv(xla_env.MEM_FRACTION_ENV, raising=False)
    assert xla_env.set_memory_fraction(0.9) and xla_env.os.environ[xla_env.MEM_FRACTION_ENV] == "0.9"
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="in \\(0, 1\\]"):
            xla_env.set_memory_fraction(bad)
    gpu_machine.setattr(xla_env, "_backend_started", lambda: True)
    assert not xla_env.set_memory_fraction(0.5)
    assert xla_env.os.environ[xla_env.MEM_FRACTION_ENV] == "0.9" and "not applied" in caplog.text


def test_the_servers_memory_fraction(gpu_machine):
    """--gpu-memory-utilization, else the user's environment, else the server's default (vLLM's 0.9)."""
    from gemma4_mtp_jax.server import cli, flags

    gpu_machine.delenv(xla_env.MEM_FRACTION_ENV, raising=False)
    cli._set_memory_fraction(None)
    assert xla_env.os.environ[xla_env.MEM_FRACTION_ENV] == str(flags.DEFAULT_GPU_MEMORY_UTILIZATION)
    gpu_machine.setenv(xla_env.MEM_FRACTION_ENV, "0.6")
    cli._set_memory_fraction(None)
    assert xla_env.os.environ[xla_env.MEM_FRACTION_ENV] == "0.6"
    cli._set_memory_fraction(0.8)
    assert xla_env.os.environ[xla_env.MEM_FRACTION_ENV] == "0.8"
    ap = flags.build_parser()
    for bad in (["x"], ["1.5"], ["0"]):
        with pytest.raises(SystemExit):
            flags.check_args(ap, ap.parse_args(["--gpu-memory-utilization", *bad]))
    flags.check_args(ap, ap.parse_args(["--gpu-memory-utilization", "0.95"]))


def test_allocator_memory_of_this_machine():
    """Every GPU of the machine has a known allocator limit, within its memory, whichever allocator JAX runs (the
    VMM one reports no memory_stats); the CPU has none."""
    import jax

    from gemma4_mtp_jax.xla_env import allocator_memory

    for device in jax.devices():
        memory = allocator_memory(device)
        if device.platform == "cpu":
            assert memory is None
            continue
        limit, used = memory
        total = xla_env._cuda_total_memory(device.local_hardware_id)
        assert total and 0 < limit <= total and (used is None or 0 <= used <= limit)
