"""notebooks/explore.ipynb runs top to bottom, its code cells in order in one fresh
interpreter started in notebooks/, as a new Jupyter kernel would run them. Without a GPU
(CI) that is the fallback path the notebook promises to show; with one, the kernels."""
import json
import subprocess
import sys
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "explore.ipynb"

# The notebook's cells, in order, in one namespace. IPython need not be installed
# (requirements.txt leaves it out): the notebook then prints where its plot is.
RUN_CELLS = """
import json, sys
namespace = {"__name__": "__main__"}
cells = [cell for cell in json.load(open(sys.argv[1]))["cells"] if cell["cell_type"] == "code"]
for number, cell in enumerate(cells, 1):
    print(f"== code cell {number}", flush=True)
    exec(compile("".join(cell["source"]), f"<code cell {number}>", "exec"), namespace)
"""


def test_code_cells_have_no_magics():
    """They run outside Jupyter too (and here): plain Python only."""
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["cell_type"] == "code":
            assert not any(line.lstrip().startswith(("%", "!")) for line in cell["source"]), cell["source"]


def test_notebook_runs_top_to_bottom():
    result = subprocess.run([sys.executable, "-c", RUN_CELLS, str(NOTEBOOK)], cwd=NOTEBOOK.parent,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "loader.KERNEL_DIR restored" in result.stdout  # the last cell ran to its end
