"""Every example of the README and docs/ that talks to a running app (`localhost:8000`) runs, as written, against
the real stack: the tools-and-voice app of this test session (`tools_app`: prefill, decode and the speech role),
with its address and model put in for `make run`'s. Python examples run in this process (the openai client is
imported already; a new interpreter per example would cost seconds each), shell examples in bash with
`set -euo pipefail`. An example passes when it exits cleanly and prints no OpenAI error object.

(Named to run after test_tools.py and test_voice.py, which start the tools app: started here first, its three
engines would sit beside every test in between.)"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.integration.conftest import APP_START_S, TOOLS_APP, wait_app
from tests.unit.docs.blocks import ROOT, Block, live_blocks

pytestmark = pytest.mark.integration

EXAMPLE_S = 120
ERROR_OBJECT = re.compile(r'"error":\s*\{')


def for_app(code: str, base: str) -> str:
    """`make run`'s address and model, made this app's (`local:tiny-llama` serves as `local:tiny-llama-tools`)."""
    code = code.replace("http://localhost:8000", base).replace("localhost:8000", base.removeprefix("http://"))
    return re.sub(r"local:tiny-llama\b(?!-)", "local:tiny-llama-tools", code)


@pytest.fixture(scope="module", autouse=True)
def _tools_app_down_after() -> Iterator[None]:
    """The tools app's last users are these examples (after test_tools.py and test_voice.py): it stops after
    them rather than at the end of the run, beside every test after them."""
    yield
    from ray import serve

    if TOOLS_APP in serve.status().applications:
        serve.delete(TOOLS_APP, _blocking=False)


@pytest.mark.timeout(APP_START_S + EXAMPLE_S)  # run alone, the first example waits for the tools app to start
@pytest.mark.parametrize("block", live_blocks(), ids=lambda b: b.name)
def test_example_runs_against_the_stack(block: Block, tools_app: str, monkeypatch: pytest.MonkeyPatch) -> None:
    code = for_app(block.code, tools_app)
    # The app whole first: a test before may have killed a replica (test_voice.py's last kills the speech one),
    # and an example's spoken turn sent while Serve replaces it is not heard, after a 30 s wait.
    wait_app(tools_app, TOOLS_APP)
    monkeypatch.chdir(ROOT)  # examples name files of the repository (speech/samples/...)
    if block.lang == "python":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, block.name, "exec"), {"__name__": "__main__"})
        output = out.getvalue()
    else:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=EXAMPLE_S, cwd=ROOT
        )
        assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        output = done.stdout
    assert output.strip(), f"{block.name} printed nothing"
    assert not ERROR_OBJECT.search(output), f"{block.name} printed an error:\n{output}"
