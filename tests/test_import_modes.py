"""Both ways users reach the folder: as a package under any name, and as a plain folder (CPU, CI)."""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILES = ["__init__.py", "losses.py", "loader.py", "op_signatures.py", "loss_helpers.py", "pointwise_loss.py",
                 "mse.py", "kl_div.py", "cross_entropy.py", "row_passes.py", "vocab_parallel.py",
                 "linear_cross_entropy.py", "causal_lm.py", "kernels"]

CHECK_LOSSES = """
import torch, torch.nn.functional as F
x, y = torch.randn(4, 5), torch.randn(4, 5)
t = torch.randint(0, 5, (4,))
assert torch.allclose(L.mse_loss(x, y), F.mse_loss(x, y))
assert torch.allclose(L.cross_entropy(x, t), F.cross_entropy(x, t))
p, q = x.softmax(-1), y.softmax(-1)
assert torch.allclose(L.kl_div(p, q, reduction="batchmean", log_input=False),
                      F.kl_div(p.log(), q, reduction="batchmean"))
print("ok")
"""


def copy_project(destination: Path) -> Path:
    destination.mkdir(parents=True)
    for name in PROJECT_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name)
        else:
            shutil.copy(source, destination / name)
    return destination


def run_python(code: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_as_a_package_under_any_name(tmp_path):
    copy_project(tmp_path / "my_project" / "fused_losses")
    out = run_python("from fused_losses import losses as L\n" + CHECK_LOSSES, cwd=tmp_path / "my_project")
    assert out.strip() == "ok"
    out = run_python("import fused_losses as L\nassert L.loader and L.losses\n" + CHECK_LOSSES,
                     cwd=tmp_path / "my_project")
    assert out.strip() == "ok"
    copy_project(tmp_path / "other" / "third_party_losses")
    out = run_python("from third_party_losses import losses as L\n" + CHECK_LOSSES, cwd=tmp_path / "other")
    assert out.strip() == "ok"


def test_as_a_plain_folder_or_notebook_directory(tmp_path):
    folder = copy_project(tmp_path / "checkout")
    out = run_python("import losses as L, loader\n" + CHECK_LOSSES, cwd=folder)  # a notebook inside the folder
    assert out.strip() == "ok"
    out = run_python(f"import sys; sys.path.insert(0, {str(folder)!r})\nimport losses as L\n" + CHECK_LOSSES,
                     cwd=tmp_path)
    assert out.strip() == "ok"
