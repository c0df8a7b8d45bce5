"""The README's two set-up commands are the ones CI runs, word for word."""

from pathlib import Path

ROOT = Path(__file__).parent.parent


def code_blocks(markdown: str) -> list[str]:
    return [block.split("\n", 1)[1].strip() for block in markdown.split("```")[1::2]]


def test_ci_runs_the_readme_commands_verbatim():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = code_blocks(section)
    assert len(commands) == 2
    demo, tests = commands
    assert "nanofn generate" in demo and "pytest" in tests
    assert demo in ci and tests in ci
