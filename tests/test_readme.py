"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)  # "```python notest": not run
    assert blocks, "the README has a usage example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_names_the_two_commands():
    text = README.read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
        assert block.startswith('pip install "torch==2.13.0"')
