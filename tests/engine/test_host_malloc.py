"""engine.host_malloc: when ``import engine`` sets glibc's malloc thresholds, and when the user's choice wins."""
import subprocess
import sys

import pytest

from engine import host_malloc


@pytest.mark.parametrize("environ, platform, reason", [
    ({}, "linux", None),
    ({"LD_PRELOAD": "/usr/lib/libfoo.so"}, "linux", None),
    ({"DSV4_HOST_MALLOC": "Default"}, "linux", "DSV4_HOST_MALLOC=default"),
    ({}, "darwin", "not Linux (darwin)"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, "linux",
     "an allocator is preloaded (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "linux", "the environment sets glibc's malloc"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "linux", "the environment sets glibc's malloc"),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, "linux", None),
])
def test_why_not_names_the_users_own_choice(environ, platform, reason):
    assert host_malloc.why_not(environ, platform) == reason


def _imported(env: dict) -> str:
    code = "import engine; print(engine.HOST_MALLOC)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_import_engine_sets_the_thresholds_unless_told_not_to():
    assert _imported({"PATH": "/usr/bin:/bin"}) == "set"
    assert _imported({"DSV4_HOST_MALLOC": "default"}) == "DSV4_HOST_MALLOC=default"
    assert _imported({"MALLOC_MMAP_THRESHOLD_": "131072"}) == "the environment sets glibc's malloc"

