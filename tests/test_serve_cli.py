"""scripts/serve.py without the server's extra (fastapi / uvicorn missing): one line on stderr naming the install
command and exit code 2, before any model loads (no traceback). The missing module is simulated with a `None`
entry in sys.modules, which makes its import raise ModuleNotFoundError as an absent package does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "serve.py")
RUN = ("import runpy, sys; sys.modules[{mod!r}] = None; sys.argv = ['serve.py'] + {argv!r}; "
       "runpy.run_path({script!r}, run_name='__main__')")


def _serve_without(mod: str, *argv: str):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = RUN.format(mod=mod, argv=list(argv), script=SCRIPT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("mod", ["fastapi", "uvicorn"])
def test_missing_server_extra_is_one_line(mod):
    p = _serve_without(mod, "--port", "0")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("serve.py: error:") and mod in lines[0], lines[0]
    assert "pip install -e '.[serve]'" in lines[0], lines[0]
    assert p.stdout == ""


def test_missing_extra_checked_before_loading(monkeypatch, capsys):
    """In process: main() stops before load_engine (no model is loaded, nothing compiles); --help still works."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    monkeypatch.setattr(serve, "load_engine", lambda args: pytest.fail("load_engine ran"))
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(SystemExit) as e:
        serve.main(["--no-warmup"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[serve]" in err[0], err
    with pytest.raises(SystemExit) as e:
        serve.main(["--help"])
    assert e.value.code == 0
