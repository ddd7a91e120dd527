"""jaxddtree/compile_cache.py: where the tools' persistent compilation cache goes, how it is turned off, and that an
enabled cache is written to."""

import os
import subprocess
import sys

from jaxddtree import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resolve(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve(None) == str(tmp_path / "xdg" / "jaxddtree" / "xla")  # on by default
    assert compile_cache.resolve("none") is None and compile_cache.resolve("OFF") is None
    assert compile_cache.resolve("rel/dir") == os.path.abspath("rel/dir")
    monkeypatch.setenv(compile_cache.ENV, "none")
    assert compile_cache.resolve(None) is None
    assert compile_cache.resolve(str(tmp_path / "c")) == str(tmp_path / "c")  # the flag wins over the variable
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "e"))
    assert compile_cache.resolve(None) == str(tmp_path / "e")


def test_unusable_dir_warns_and_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert compile_cache.enable(str(blocker / "sub"), "prog.py") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prog.py: warning: no compilation cache (") and "none" in err[0]


def test_enabled_cache_is_written(tmp_path):
    d = tmp_path / "cache"
    code = ("import jax, jax.numpy as jnp\n"
            "from jaxddtree import compile_cache\n"
            "compile_cache.MIN_COMPILE_SECS = 0\n"
            f"assert compile_cache.enable({str(d)!r}, 'x') == {str(d)!r}\n"
            "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(4)).block_until_ready()\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert any(d.iterdir())
