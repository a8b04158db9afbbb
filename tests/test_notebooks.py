"""Every notebook in notebooks/ runs top to bottom without an error.

The kernel is this interpreter (a temporary kernelspec pointing at ``sys.executable``), so the
test needs nothing beyond ``pip install -e .[test]``: no registered Jupyter kernel. The kernel
gets a plain CPU environment without the test suite's forced device count, as a user would
run the notebooks (the sharded notebook asks for its own 8 simulated devices).
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from child_env import child_env
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "csa-eqx-test"


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {
        "quickstart.ipynb",
        "selection_explorer.ipynb",
        "memory_scaling.ipynb",
        "sharded_topk.ipynb",
        "v41_sharing.ipynb",
    } <= names


def kernel_manager(tmp_path: Path) -> KernelManager:
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "csa_eqx test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)
    km.connection_file = str(tmp_path / "connection.json")  # not in a possibly read-only HOME
    return km


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{path.name} has committed outputs; clear them"
    )
    env = child_env(JAX_PLATFORMS="cpu", IPYTHONDIR=str(tmp_path / "ipython"))
    client = NotebookClient(
        nb,
        km=kernel_manager(tmp_path),
        timeout=300,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=env)  # raises CellExecutionError naming the failing cell
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors


def test_the_documented_command_runs_every_notebook():
    """README's ``make notebooks`` installs the ``notebook`` extra (Jupyter's executor, a kernel
    and matplotlib) and executes every notebook with ``jupyter execute`` (nbclient, as above)."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = {"nbclient", "ipykernel", "matplotlib", "jupyterlab"}
    names = {re.split(r"[<>=\[ ]", req)[0] for req in extra["optional-dependencies"]["notebook"]}
    assert wanted <= names
    makefile = (root / "Makefile").read_text()
    target = re.search(r"^notebooks: (.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "jupyter execute" in target.group(2)
    assert "notebooks/*.ipynb" in target.group(2)
    assert "'.[notebook]'" in makefile and "make notebooks" in (root / "README.md").read_text()
