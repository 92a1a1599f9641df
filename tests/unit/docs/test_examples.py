"""Every fenced example of the README and docs/ is checked: the ones that talk to a running app run against the
real stack (tests/integration/test_walkthrough.py); the others here. Python compiles; YAML that is an app config
(or a part of one) validates against `AppConfig`, a Kubernetes object parses; JSON parses; a shell command that
runs `make` names a target the Makefile has, and one that runs `python` names a script or module of the repository
that takes the flags shown."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from core.config import AppConfig
from tests.unit.docs.blocks import ROOT, Block, all_blocks

LANGS = {"python", "bash", "sh", "yaml", "json", "text"}
BLOCKS = all_blocks()


def by_lang(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs]


def test_every_block_says_its_language() -> None:
    assert not [b.name for b in BLOCKS if b.lang not in LANGS], f"fences take one of {sorted(LANGS)}"


@pytest.mark.parametrize("block", by_lang("python"), ids=lambda b: b.name)
def test_python_compiles(block: Block) -> None:
    compile(block.code, block.name, "exec")


@pytest.mark.parametrize("block", by_lang("json"), ids=lambda b: b.name)
def test_json_parses(block: Block) -> None:
    json.loads(block.code)


@pytest.mark.parametrize("block", by_lang("yaml"), ids=lambda b: b.name)
def test_yaml_configs_validate(block: Block) -> None:
    data = yaml.safe_load(block.code)
    if isinstance(data, dict) and "applications" in data:
        for app in data["applications"]:
            AppConfig.model_validate(app.get("args") or {})
    elif isinstance(data, dict) and set(data) <= set(AppConfig.model_fields):
        AppConfig.model_validate(data)
    elif isinstance(data, dict) and {"apiVersion", "kind", "metadata"} <= set(data):
        # A Kubernetes object (k8s/README.md): parsed; the manifests themselves are
        # tests/unit/serve_app/test_manifests.py's.
        pass
    else:
        pytest.fail(f"{block.name}: neither a Serve config nor a part of the app's args")


def commands(code: str) -> list[list[str]]:
    """Each simple command of a shell block (continuations joined, comments and `#`-lines dropped), as words."""
    joined = re.sub(r"\\\n", " ", code)
    found = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # a quote that spans lines: a heredoc-like argument, not a command to check
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&") or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    command.append(word[:-1])
                if command:
                    found.append(command)
                command = []
            else:
                command.append(word)
    return found


def program(words: list[str]) -> list[str]:
    """The command without what runs it: environment assignments, `flock <lock>`, `timeout`, `.venv/bin/`."""
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("env", "exec")):
        words = words[1:]
    if words[:1] == ["flock"]:
        words = words[2:]
    return [words[0].removeprefix(".venv/bin/"), *words[1:]] if words else []


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def flags_of(script: Path) -> set[str]:
    """The `--flags` a script's argparse knows (its own source and the bench/ modules it shares them from)."""
    sources = [script] + (sorted((ROOT / "bench").glob("*.py")) if script.parent.name == "bench" else [])
    text = "".join(p.read_text() for p in sources)
    return set(re.findall(r"""["'](--[\w-]+)["']""", text))


def module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.exists():
            return candidate
    return None


def check_command(words: list[str]) -> list[str]:
    words = program(words)
    if not words:
        return []
    if words[0] == "make":
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        return [f"make {t}: no such target" for t in targets if t not in make_targets()]
    if words[0] not in ("python", "python3"):
        return []
    args = words[1:]
    if args[:1] == ["-m"]:
        module = args[1]
        if module.split(".")[0] not in ("serve_app", "router", "prefill", "decode", "speech", "bench"):
            return []  # another package's module (pip, vllm): not this repository's to check
        file = module_file(module)
        if file is None:
            return [f"python -m {module}: no such module in the repository"]
        rest = args[2:]
    elif args and args[0].endswith(".py"):
        file = ROOT / args[0]
        if not file.exists():
            return [f"python {args[0]}: no such script"]
        rest = args[1:]
    else:
        return []
    known = flags_of(file)
    return [
        f"{file.relative_to(ROOT)}: no flag {w}" for w in rest if w.startswith("--") and w.split("=")[0] not in known
    ]


@pytest.mark.parametrize("block", [b for b in by_lang("bash", "sh") if not b.live], ids=lambda b: b.name)
def test_shell_commands_name_what_exists(block: Block) -> None:
    problems = [p for words in commands(block.code) for p in check_command(words)]
    assert not problems, f"{block.name}: " + "; ".join(problems)


def test_the_live_examples_are_found() -> None:
    """The README's first requests run against the real stack: one per surface."""
    readme = [b for b in BLOCKS if b.page.name == "README.md" and b.page.parent == ROOT and b.live]
    assert len(readme) >= 6, [b.name for b in readme]


def test_commands_are_read_as_a_shell_reads_them() -> None:
    code = "flock /tmp/x.lock .venv/bin/python bench/suite.py --quick \\\n  --parts append  # smoke\nmake run test\n"
    assert [program(c) for c in commands(code)] == [
        ["python", "bench/suite.py", "--quick", "--parts", "append"],
        ["make", "run", "test"],
    ]
    assert check_command(["python", "bench/suite.py", "--no-such-flag"]) == ["bench/suite.py: no flag --no-such-flag"]
    assert check_command(["make", "nothing-here"]) == ["make nothing-here: no such target"]
