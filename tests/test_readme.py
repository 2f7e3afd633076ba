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


def test_readme_tables_are_generated_and_current():
    """The speed table (and the figure beside it) come from stored results, and the lead's table block is kept."""
    import subprocess
    import sys

    script = README.parent / "scripts" / "make_readme_figure.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = README.read_text()
    for marker in ("ff-readme", "readme-speed", "fits-table"):
        assert f"<!-- {marker} -->" in text and f"<!-- /{marker} -->" in text
    assert "![" in text and "docs/readme_gains.png" in text and (README.parent / "docs" / "readme_gains.png").is_file()


def test_fits_tables_are_generated_from_stored_runs_and_current():
    """README's and docs/full_finetune.md's "what fits where" tables come from the stored H200 runs."""
    import subprocess
    import sys

    script = README.parent / "scripts" / "make_fits_table.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    block = README.read_text().split("<!-- fits-table -->")[1].split("<!-- /fits-table -->")[0]
    assert "Llama-3.1-8B" in block and "`apexw_4bit_release`" in block
